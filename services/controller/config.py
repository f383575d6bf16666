"""Controller settings and the command line that sets them (`lmcache_controller` / `kvmesh controller`).

LMCache's own controller flags are accepted too (docs/compatibility.md): `--monitor-ports` (its "pull" port is
our NATS port), `--config` (LMCache's controller YAML: controller_host, controller_port,
controller_monitor_ports, health_check_interval, lmcache_worker_timeout), `--health-check-interval`,
`--lmcache-worker-timeout` (= --producer-expiry-secs). What maps onto ours takes effect; what does not is
accepted with one WARNING each saying what KVMesh does instead. A flag given on the command line wins over the
same setting in the --config file.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from kvmesh.shared.bus import NatsAuth
from kvmesh.shared.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.nats_url import argument as nats_url_argument

TOKEN_ENV = "KVMESH_CONTROLLER_TOKEN"
TOKEN_FILE_ENV = "KVMESH_CONTROLLER_TOKEN_FILE"
MiB = 1 << 20


@dataclass(frozen=True)
class ControllerConfig:
    host: str = "localhost"  # REST bind address
    port: int = 9000  # REST port; 0 picks a free one
    monitor_port: int = 9001  # port of the embedded NATS server (LMCache's "monitor" port), when no nats_url
    nats_url: str | None = None  # join an existing NATS instead of embedding one
    controller_id: str = ""  # "" -> controller-<host>-<pid>
    liveness_timeout_s: float = 6.0  # a producer silent this long is down (3 x the 2 s heartbeat)
    command_timeout_s: float = 5.0  # pin / unpin / clear: per-worker NATS request timeout
    max_tokens: int = 1_000_000  # longer token lists are refused with 413
    auth_token: str | None = None  # bearer token required on the API when set
    insecure_no_auth: bool = False  # allow a REST API beyond loopback without a token (WARNING at every start)
    large_body_bytes: int = MiB  # a request body over this many bytes is "large"...
    max_large_bodies: int = 2  # ...and at most this many are read, parsed and served at once...
    large_body_queue: int = 32  # ...while at most this many more wait (unread) for a turn; the rest get 503
    nats_host: str = "127.0.0.1"  # where the embedded NATS listens (whatever `host` the REST API uses)
    nats_auth: NatsAuth | None = None  # credentials for --nats-url (None: those of a KVMesh-started NATS here)
    event_window_size: int = 100_000  # /check_finish remembers at most this many pin/unpin/clear event ids...
    lookup_window_size: int = 100_000  # ...and, apart (a lookup flood must not evict them), this many lookup ids...
    event_window_s: float = 3600.0  # ...for at most this long
    max_commands: int = 64  # pin/unpin/clear in flight at once; more get 429 (bounds what silent workers pin)
    max_producers: int = 4096  # registrations of new producers past this are refused (each costs a slot)
    producer_expiry_s: float = 600.0  # a producer down this long is forgotten: keys dropped, slot reused
    min_chunk_size: int = 16  # registrations with a chunk_size outside [min, max] are refused...
    max_chunk_size: int = 65536  # ...(a tiny chunk makes every lookup hash and probe per few tokens)
    max_key_param_sets: int = 128  # distinct (model, kv_format, ranks, chunk_size, ...) sets a lookup hashes for
    # Each principal's share of the two tables above (at most half of each, checked by parse_args): one
    # principal's registrations never refuse another's. TP/PP with 64 ranks and a few incarnations fits.
    max_workers_per_principal: int = 256
    max_key_param_sets_per_principal: int = 64
    max_keys_per_principal: int = 4_000_000  # chunk keys one principal's producers may have indexed (~200 B each)
    sync_retry_s: float = 3.0  # re-ask a producer for a full sync after this long without one
    heartbeat_grace_s: float = 1.0  # a heartbeat's seq claim must be met by batches within this
    tick_interval_s: float = 0.25  # maintenance pass period
    log_level: str | None = None  # None: $KVMESH_LOG_LEVEL, else info
    notices: tuple[str, ...] = ()  # WARNINGs about LMCache settings that mean nothing here (logged at start)

    def resolved_controller_id(self) -> str:
        return self.controller_id or f"controller-{socket.gethostname()}-{os.getpid()}"

    def max_body_bytes(self) -> int:
        """Largest request body accepted before parsing: max_tokens ids of up to 20 characters, plus slack."""
        return self.max_tokens * 21 + 65536

    def exposure_error(self) -> str | None:
        """Why this REST API must not start open (bound beyond loopback, no token, no --insecure-no-auth)."""
        if self.auth_token or self.insecure_no_auth or is_loopback(self.host):
            return None
        return (f"the REST API would listen on {self.host!r} (--host, or controller_host in --config), beyond "
                f"loopback, with no token: anyone who reaches it could look up, pin, unpin, move and clear. Give "
                f"--auth-token-file FILE or --auth-token (or ${TOKEN_FILE_ENV} / ${TOKEN_ENV}), bind --host "
                "127.0.0.1, or pass --insecure-no-auth to serve it open anyway")


def is_loopback(host: str) -> bool:
    """Whether a bind address only listens on this machine: localhost, 127.0.0.0/8 or ::1 (a wildcard such as
    0.0.0.0 or "", any other name or address, is not)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its errors
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache_controller",
        description="KVMesh controller: the LMCache controller REST API (lookup, pin, unpin, clear, "
                    "check_finish, health, query_worker_info) backed by a chunk index built from NATS events.")
    # host, port, monitor ports and --producer-expiry-secs default to None: "not given", so a --config file
    # value can apply (resolved in parse_args).
    parser.add_argument("--host", default=None, help=f"REST bind address (default: {DEFAULTS['host']})")
    parser.add_argument("--port", type=int, default=None, help=f"REST port (default: {DEFAULTS['port']})")
    parser.add_argument("--monitor-port", type=int, default=None,
                        help="port of the NATS server the controller embeds when --nats-url is not given; "
                             f"engines reach it as controller_url (default: {DEFAULTS['monitor_port']})")
    parser.add_argument("--monitor-ports", type=_monitor_ports, default=None,
                        help="LMCache's JSON of named monitor ports, e.g. '{\"pull\": 9001}': the \"pull\" port is "
                             "the embedded NATS port (as --monitor-port); KVMesh needs no other (\"reply\", "
                             "\"heartbeat\": accepted with a warning). Wins over --monitor-port")
    parser.add_argument("--config", type=Path, default=None,
                        help="LMCache's controller config file (YAML): controller_host, controller_port, "
                             "controller_monitor_ports, health_check_interval and lmcache_worker_timeout apply "
                             "as their flags; any other key is named in a warning and ignored. Flags given on "
                             "the command line win")
    parser.add_argument("--health-check-interval", type=int, default=None,
                        help="LMCache's worker health check period; accepted with a warning: KVMesh checks "
                             "liveness continuously from heartbeats (--liveness-timeout, --producer-expiry-secs)")
    parser.add_argument("--lmcache-worker-timeout", type=_positive(float), default=None,
                        help="LMCache's name for --producer-expiry-secs: seconds a silent worker is kept "
                             "before it is forgotten")
    parser.add_argument("--nats-url", type=nats_url_argument, default=None,
                        help="join this NATS (e.g. nats://host:4222; a cluster's servers comma-separated) "
                             "instead of embedding a server")
    parser.add_argument("--nats-host", default="127.0.0.1",
                        help="address the embedded NATS listens on (default: loopback, whatever --host is); "
                             "engines on other hosts need it reachable and their credentials (docs/security.md)")
    parser.add_argument("--controller-id", default="", help="name on NATS (default: controller-<host>-<pid>)")
    parser.add_argument("--liveness-timeout", type=_positive(float), default=6.0,
                        help="seconds without a heartbeat before a producer is down (default: 6)")
    parser.add_argument("--command-timeout", type=_positive(float), default=5.0,
                        help="seconds to wait for a worker's answer to pin/unpin/clear/move (default: 5)")
    parser.add_argument("--max-tokens", type=_positive(int), default=1_000_000,
                        help="longest token list accepted; longer gets 413 (default: 1000000)")
    parser.add_argument("--auth-token", default=None,
                        help=f"require 'Authorization: Bearer <token>' on the API (or set ${TOKEN_ENV}); "
                             "every endpoint but /healthz and the OpenAPI pages needs it")
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"read the token from this file (its first line; or set ${TOKEN_FILE_ENV}); keeps it "
                             "out of ps and the environment")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve the API without a token although --host is not loopback (logged as a WARNING "
                             "at every start); without it such a controller refuses to start")
    parser.add_argument("--large-body-bytes", type=_positive(int), default=MiB,
                        help=f"a request body over this many bytes counts as large (default: {MiB})")
    parser.add_argument("--max-large-bodies", type=_positive(int), default=2,
                        help="large bodies read, parsed and served at once; each holds its token list until "
                             "answered (default: 2)")
    parser.add_argument("--large-body-queue", type=_non_negative_int, default=32,
                        help="large bodies that wait, unread, for a turn; one more gets 503 with Retry-After "
                             "(default: 32)")
    parser.add_argument("--event-window-size", type=_positive(int), default=100_000,
                        help="how many recent pin/unpin/clear event ids /check_finish remembers (default: 100000)")
    parser.add_argument("--event-window-secs", type=_positive(float), default=3600.0,
                        help="how long /check_finish remembers an event id (default: 3600)")
    parser.add_argument("--lookup-window-size", type=_positive(int), default=100_000,
                        help="how many recent lookup event ids /check_finish remembers, apart from the "
                             "pin/unpin/clear ones (default: 100000)")
    parser.add_argument("--max-commands", type=_positive(int), default=64,
                        help="pin/unpin/clear/move requests in flight at once; more get 429 (default: 64)")
    parser.add_argument("--max-producers", type=_positive(int), default=4096,
                        help="most producers (engine workers and stores) known at once; a registration of a "
                             "new one past it is refused and counted (default: 4096)")
    parser.add_argument("--producer-expiry-secs", type=_positive(float), default=None,
                        help="seconds a producer stays down before it is forgotten: its keys are dropped and "
                             f"its slot reused (default: {DEFAULTS['producer_expiry_secs']:g}; "
                             "also --lmcache-worker-timeout)")
    parser.add_argument("--min-chunk-size", type=_positive(int), default=16,
                        help="smallest chunk_size an engine may register with (default: 16)")
    parser.add_argument("--max-chunk-size", type=_positive(int), default=65536,
                        help="largest chunk_size an engine may register with (default: 65536)")
    parser.add_argument("--max-key-param-sets", type=_positive(int), default=128,
                        help="most distinct key parameter sets (model, kv_format, world_size, rank, chunk_size, "
                             "save_unfull_chunk) a lookup hashes for; a registration adding one past it is "
                             "refused and counted (default: 128)")
    parser.add_argument("--max-workers-per-principal", type=_positive(int), default=256,
                        help="most producers one principal (engine.<instance_id>: its workers, every rank and "
                             "incarnation; store.<id>) has registered at once; past it the principal's own down "
                             "workers are forgotten, else the registration is refused and counted. At most half "
                             "of --max-producers (default: 256)")
    parser.add_argument("--max-key-param-sets-per-principal", type=_positive(int), default=64,
                        help="most distinct key parameter sets one principal's workers register (a TP/PP "
                             "instance has one per rank); past it as --max-workers-per-principal. At most half "
                             "of --max-key-param-sets (default: 64)")
    parser.add_argument("--max-keys-per-principal", type=_positive(int), default=4_000_000,
                        help="most chunk keys one principal's producers have indexed together (about 200 bytes "
                             "each); admissions past it are dropped and counted, lookups miss them "
                             "(default: 4000000)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="log level (default: $KVMESH_LOG_LEVEL, else info)")
    add_nats_auth_flags(parser)
    return parser


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _auth_token(parser: argparse.ArgumentParser, args: argparse.Namespace, notices: list[str]) -> str | None:
    """The API token: --auth-token, --auth-token-file, $KVMESH_CONTROLLER_TOKEN, $KVMESH_CONTROLLER_TOKEN_FILE (the
    first given); a file that cannot be read or holds no token is an error naming it."""
    if args.auth_token and args.auth_token_file:
        parser.error("give --auth-token or --auth-token-file, not both")
    if args.auth_token:
        return args.auth_token
    path = args.auth_token_file
    source = "--auth-token-file"
    if path is None:
        if os.environ.get(TOKEN_ENV):
            return os.environ[TOKEN_ENV]
        if not os.environ.get(TOKEN_FILE_ENV):
            return None
        path, source = Path(os.environ[TOKEN_FILE_ENV]), f"${TOKEN_FILE_ENV}"
    try:
        token = path.read_text().strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"{source} {path}: cannot read the controller token ({exc})")
    if not token or len(token.splitlines()) != 1 or any(c.isspace() for c in token):
        parser.error(f"{source} {path}: expected one line holding the token (no spaces), got "
                     f"{'an empty file' if not token else 'more'}")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        notices.append(f"{source} {path}: the controller token file is open to other users (mode "
                       f"{mode & 0o777:o}); make it 0600")
    return token


def _check_shares(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A principal's share may be at most half its global bound: else one principal fills the table alone."""
    for share, bound in (("max_workers_per_principal", "max_producers"),
                         ("max_key_param_sets_per_principal", "max_key_param_sets")):
        if getattr(args, share) * 2 > getattr(args, bound):
            flag = "--" + share.replace("_", "-")
            parser.error(f"{flag} {getattr(args, share)} is more than half of --{bound.replace('_', '-')} "
                         f"{getattr(args, bound)}: one principal could fill it and refuse every other; lower "
                         f"{flag} or raise --{bound.replace('_', '-')}")


def parse_args(argv: list[str] | None = None) -> ControllerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        notices = _resolve_lmcache_settings(args)
    except ValueError as exc:
        parser.error(str(exc))
    _check_shares(parser, args)
    return ControllerConfig(
        host=args.host, port=args.port, monitor_port=args.monitor_port, nats_url=args.nats_url,
        controller_id=args.controller_id, liveness_timeout_s=args.liveness_timeout,
        command_timeout_s=args.command_timeout, max_tokens=args.max_tokens,
        auth_token=_auth_token(parser, args, notices), insecure_no_auth=args.insecure_no_auth,
        large_body_bytes=args.large_body_bytes, max_large_bodies=args.max_large_bodies,
        large_body_queue=args.large_body_queue,
        event_window_size=args.event_window_size, event_window_s=args.event_window_secs,
        lookup_window_size=args.lookup_window_size, max_commands=args.max_commands,
        max_producers=args.max_producers, producer_expiry_s=args.producer_expiry_secs,
        min_chunk_size=args.min_chunk_size, max_chunk_size=args.max_chunk_size,
        max_key_param_sets=args.max_key_param_sets, max_workers_per_principal=args.max_workers_per_principal,
        max_key_param_sets_per_principal=args.max_key_param_sets_per_principal,
        max_keys_per_principal=args.max_keys_per_principal,
        log_level=args.log_level, nats_host=args.nats_host, nats_auth=nats_auth_from_args(args).or_none(),
        notices=tuple(notices),
    )


# -------------------------------------------------------------------------------------------------------
# LMCache's controller settings

DEFAULTS: dict[str, Any] = {"host": "localhost", "port": 9000, "monitor_port": 9001, "producer_expiry_secs": 600.0}
# LMCache's controller config keys -> our argparse dest (each also a flag of LMCache's lmcache_controller).
CONFIG_KEYS = {"controller_host": "host", "controller_port": "port", "controller_monitor_ports": "monitor_ports",
               "health_check_interval": "health_check_interval", "lmcache_worker_timeout": "lmcache_worker_timeout"}
HEALTH_CHECK_NOTICE = ("health_check_interval={value}: ignored; KVMesh needs no periodic health check: every "
                       "worker heartbeats (every 2 s), one silent for --liveness-timeout is down (out of lookups), "
                       "and one down for --producer-expiry-secs (LMCache's lmcache_worker_timeout) is forgotten")


def _monitor_ports(text: str | dict[str, Any]) -> dict[str, int]:
    """LMCache's --monitor-ports: a JSON object of named ports."""
    try:
        ports = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); expected e.g. '{{\"pull\": 9001}}'") from None
    if not isinstance(ports, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536 for v in ports.values()):
        raise argparse.ArgumentTypeError(f"expected a JSON object of port numbers, e.g. '{{\"pull\": 9001}}', "
                                         f"got {text!r}")
    if "pull" not in ports:
        raise argparse.ArgumentTypeError(f"needs a \"pull\" port (the embedded NATS port), got {text!r}")
    return ports


def _load_lmcache_config(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: cannot read it as YAML ({exc})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path}: expected a mapping of LMCache controller keys, got a "
                         f"{type(loaded).__name__}")
    return loaded


def _from_config(key: str, value: Any) -> Any:
    """A --config value, checked as its flag would be (ValueError naming the key otherwise)."""
    try:
        if key == "controller_monitor_ports":
            return _monitor_ports(value if isinstance(value, dict) else str(value))
        if key == "controller_host":
            if not isinstance(value, str) or not value:
                raise ValueError("expected a host name")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                key == "controller_port" and not isinstance(value, int)):
            raise ValueError("expected a number")
        if key == "lmcache_worker_timeout" and value <= 0:
            raise ValueError("must be positive")
        return value
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"--config: {key}={value!r}: {exc}") from None


def _resolve_lmcache_settings(args: argparse.Namespace) -> list[str]:
    """Fold --config and LMCache's flags into ours (flags win over the file); the WARNINGs to log."""
    notices: list[str] = []
    if args.config is not None:
        ignored = []
        for key, value in _load_lmcache_config(args.config).items():
            dest = CONFIG_KEYS.get(str(key))
            if dest is None:
                ignored.append(str(key))
            elif getattr(args, dest) is None and not (dest == "monitor_ports" and args.monitor_port is not None):
                setattr(args, dest, _from_config(key, value))  # (a flag, --monitor-port too, wins over the file)
        if ignored:
            notices.append(f"--config {args.config}: key(s) {', '.join(sorted(ignored))} mean nothing to the KVMesh "
                           f"controller and are ignored (it reads {', '.join(CONFIG_KEYS)})")
    if args.monitor_ports is not None:
        if args.monitor_port is not None and args.monitor_port != args.monitor_ports["pull"]:
            notices.append(f"--monitor-port {args.monitor_port} and --monitor-ports pull "
                           f"{args.monitor_ports['pull']} differ: using the pull port, as LMCache does")
        args.monitor_port = args.monitor_ports["pull"]
        others = sorted(name for name in args.monitor_ports if name != "pull")
        if others:
            notices.append(f"monitor port(s) {', '.join(others)} ignored: KVMesh's workers reach the controller "
                           f"over the one NATS port ({args.monitor_port}, the pull port), replies and heartbeats "
                           "included")
    if args.health_check_interval is not None:
        notices.append(HEALTH_CHECK_NOTICE.format(value=args.health_check_interval))
    if args.lmcache_worker_timeout is not None:
        if args.producer_expiry_secs is not None and args.producer_expiry_secs != args.lmcache_worker_timeout:
            notices.append(f"lmcache_worker_timeout {args.lmcache_worker_timeout:g} ignored: "
                           f"--producer-expiry-secs {args.producer_expiry_secs:g} is given")
        elif args.producer_expiry_secs is None:
            args.producer_expiry_secs = float(args.lmcache_worker_timeout)
    for dest, default in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    return notices
