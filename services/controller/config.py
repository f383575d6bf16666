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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from kvmesh.shared import options_cli
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.bus import NatsAuth
from kvmesh.shared.messaging.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.messaging.nats_url import argument as nats_url_argument
from kvmesh.shared.messaging.sharing_domains import domains_file_of, domains_file_option
from kvmesh.shared.ops.http_gate import resolve_token
from kvmesh.shared.options_cli import DEFAULT, option
from kvmesh.shared.tls import server_context_of

TOKEN_ENV = "KVMESH_CONTROLLER_TOKEN"
TOKEN_FILE_ENV = "KVMESH_CONTROLLER_TOKEN_FILE"
MiB = 1 << 20


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its errors
    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


# Each setting's default is written once, on its field, and its flag is generated from it (shared/options_cli.py).
# host, port, monitor_port and producer_expiry_s are `unset`: their flags default to None ("not given"), so a
# --config file value can apply (resolved in parse_args), else the field's default does.
@dataclass(frozen=True)
class ControllerConfig:
    host: str = option("--host", f"REST bind address (default: {DEFAULT})", "localhost", unset=True)
    port: int = option("--port", f"REST port (default: {DEFAULT})", 9000, unset=True)  # 0 picks a free one
    # port of the embedded NATS server (LMCache's "monitor" port), when no nats_url
    monitor_port: int = option(
        "--monitor-port", "port of the NATS server the controller embeds when --nats-url is not given; engines "
        f"reach it as controller_url (default: {DEFAULT})", 9001, unset=True)
    # join an existing NATS instead of embedding one
    nats_url: str | None = option(
        "--nats-url", "join this NATS (e.g. nats://host:4222; a cluster's servers comma-separated) instead of "
        "embedding a server", None, type=nats_url_argument)
    controller_id: str = option(  # "" -> controller-<host>-<pid>
        "--controller-id", "name on NATS (default: controller-<host>-<pid>)", "")
    # a producer silent this long is down (3 x the 2 s heartbeat)
    liveness_timeout_s: float = option(
        "--liveness-timeout", f"seconds without a heartbeat before a producer is down (default: {DEFAULT})", 6.0,
        type=_positive(float))
    # pin / unpin / clear: per-worker NATS request timeout
    command_timeout_s: float = option(
        "--command-timeout",
        f"seconds to wait for a worker's answer to pin/unpin/clear/move/prefetch (default: {DEFAULT})",
        5.0, type=_positive(float))
    max_tokens: int = option(  # longer token lists are refused with 413
        "--max-tokens", f"longest token list accepted; longer gets 413 (default: {DEFAULT})", 1_000_000,
        type=_positive(int))
    auth_token: str | None = option(  # bearer token required on the API when set
        "--auth-token", f"require 'Authorization: Bearer <token>' on the API (or set ${TOKEN_ENV}); every endpoint "
        "but /healthz and the OpenAPI pages needs it", None)
    # allow a REST API beyond loopback without a token (WARNING at every start)
    insecure_no_auth: bool = option(
        "--insecure-no-auth", "serve the API without a token although --host is not loopback (logged as a WARNING "
        "at every start); without it such a controller refuses to start", False)
    large_body_bytes: int = option(  # a request body over this many bytes is "large"...
        "--large-body-bytes", f"a request body over this many bytes counts as large (default: {DEFAULT})", MiB,
        type=_positive(int))
    max_large_bodies: int = option(  # ...and at most this many are read, parsed and served at once...
        "--max-large-bodies", "large bodies read, parsed and served at once; each holds its token list until "
        f"answered (default: {DEFAULT})", 2, type=_positive(int))
    large_body_queue: int = option(  # ...while at most this many more wait (unread) for a turn; the rest get 503
        "--large-body-queue", "large bodies that wait, unread, for a turn; one more gets 503 with Retry-After "
        f"(default: {DEFAULT})", 32, type=_non_negative_int)
    # the REST API over TLS only (uvicorn's ssl_certfile / ssl_keyfile)
    tls_cert: Path | None = option(
        "--tls-cert", "serve the REST API over HTTPS only (TLS 1.2+) with this certificate (with --tls-key)", None,
        convert=Path)
    tls_key: Path | None = option("--tls-key", "key file of --tls-cert (mode 0600)", None, convert=Path)
    # where the embedded NATS listens (whatever `host` the REST API uses)
    nats_host: str = option(
        "--nats-host", "address the embedded NATS listens on (default: loopback, whatever --host is); engines on "
        "other hosts need it reachable and their credentials (docs/security.md)", "127.0.0.1")
    nats_auth: NatsAuth | None = None  # credentials for --nats-url (None: those of a KVMesh-started NATS here)
    # engine principal -> sharing domain, as the stores read it (None: beside the credentials, service.py)
    domains_file: Path | None = domains_file_option("controller")
    # /check_finish remembers at most this many pin/unpin/clear event ids...
    event_window_size: int = option(
        "--event-window-size", "how many recent pin/unpin/clear event ids /check_finish remembers (default: "
        f"{DEFAULT})", 100_000, type=_positive(int))
    # ...and, apart (a lookup flood must not evict them), this many lookup ids...
    lookup_window_size: int = option(
        "--lookup-window-size", "how many recent lookup event ids /check_finish remembers, apart from the "
        f"pin/unpin/clear ones (default: {DEFAULT})", 100_000, type=_positive(int))
    event_window_s: float = option(  # ...for at most this long
        "--event-window-secs", f"how long /check_finish remembers an event id (default: {DEFAULT})", 3600.0,
        type=_positive(float))
    # pin/unpin/clear in flight at once; more get 429 (bounds what silent workers pin)
    max_commands: int = option(
        "--max-commands",
        f"pin/unpin/clear/move/prefetch requests in flight at once; more get 429 (default: {DEFAULT})", 64,
        type=_positive(int))
    # /usage asks every producer it reports on for its own figures (one NATS request each), at most this long...
    usage_timeout_s: float = option(
        "--usage-timeout", "seconds /usage waits for a producer's own figures (bytes, pins, hits, evictions); one "
        f"that has not answered by then is reported without them (default: {DEFAULT})", 2.0, type=_positive(float))
    # ...and at most this many /usage requests do so at once; more get 429
    max_usage_requests: int = option(
        "--max-usage-requests", "/usage requests in flight at once (each asks every producer it reports on); more "
        f"get 429 (default: {DEFAULT})", 4, type=_positive(int))
    # registrations of new producers past this are refused (each costs a slot)
    max_producers: int = option(
        "--max-producers", "most producers (engine workers and stores) known at once; a registration of a new one "
        f"past it is refused and counted (default: {DEFAULT})", 4096, type=_positive(int))
    # a producer down this long is forgotten: keys dropped, slot reused
    producer_expiry_s: float = option(
        "--producer-expiry-secs", "seconds a producer stays down before it is forgotten: its keys are dropped and "
        f"its slot reused (default: {DEFAULT}; also --lmcache-worker-timeout)", 600.0, type=_positive(float),
        unset=True)
    # registrations with a chunk_size outside [min, max] are refused...
    min_chunk_size: int = option(
        "--min-chunk-size", f"smallest chunk_size an engine may register with (default: {DEFAULT})", 16,
        type=_positive(int))
    # ...(a tiny chunk makes every lookup hash and probe per few tokens)
    max_chunk_size: int = option(
        "--max-chunk-size", f"largest chunk_size an engine may register with (default: {DEFAULT})", 65536,
        type=_positive(int))
    # distinct (model, kv_format, ranks, chunk_size, ...) sets a lookup hashes for
    max_key_param_sets: int = option(
        "--max-key-param-sets", "most distinct key parameter sets (model, kv_format, world_size, rank, chunk_size, "
        "save_unfull_chunk) a lookup hashes for; a registration adding one past it is refused and counted "
        f"(default: {DEFAULT})", 128, type=_positive(int))
    # Each principal's share of the two tables above (at most half of each, checked by parse_args): one
    # principal's registrations never refuse another's. TP/PP with 64 ranks and a few incarnations fits.
    max_workers_per_principal: int = option(
        "--max-workers-per-principal", "most producers one principal (engine.<instance_id>: its workers, every "
        "rank and incarnation; store.<id>) has registered at once; past it the principal's own down workers are "
        "forgotten, else the registration is refused and counted. At most half of --max-producers (default: "
        f"{DEFAULT})", 256, type=_positive(int))
    max_key_param_sets_per_principal: int = option(
        "--max-key-param-sets-per-principal", "most distinct key parameter sets one principal's workers register "
        "(a TP/PP instance has one per rank); past it as --max-workers-per-principal. At most half of "
        f"--max-key-param-sets (default: {DEFAULT})", 64, type=_positive(int))
    # chunk keys one principal's producers may have indexed (~200 B each)
    max_keys_per_principal: int = option(
        "--max-keys-per-principal", "most chunk keys one principal's producers have indexed together (about 200 "
        f"bytes each); admissions past it are dropped and counted, lookups miss them (default: {DEFAULT})",
        4_000_000, type=_positive(int))
    # full-sync requests a second to one principal's producers heard only by their heartbeats (sync_budget.py)
    sync_requests_per_principal: int = option(
        "--sync-requests-per-principal", "full-sync requests a second (bursts of as many) the controller sends "
        "one principal's producers that heartbeat before it knows them; past it such heartbeats are dropped and "
        f"counted (default: {DEFAULT})", 64, type=_positive(int))
    # The fleet-wide KV event stream (kv_event_stream.py): off unless a port is given
    kv_events_port: int | None = option(
        "--kv-events-port", "publish every tier's KV events (vLLM's KVEventBatch, msgpack over ZMQ PUB, one topic "
        "per holder: docs/config.md) on this port; 0 picks a free one (default: off)", None,
        type=_non_negative_int)
    kv_events_replay_port: int | None = option(
        "--kv-events-replay-port", "serve replays of the KV event stream (vLLM's ROUTER protocol) on this port; "
        "needs --kv-events-port; 0 picks a free one (default: off)", None, type=_non_negative_int)
    kv_events_host: str = option(
        "--kv-events-host", "address the KV event stream listens on; unauthenticated, so beyond loopback only "
        f"with --kv-events-public (default: {DEFAULT})", "127.0.0.1")
    kv_events_public: bool = option(
        "--kv-events-public", "let the KV event stream listen beyond loopback, unauthenticated (it names chunk "
        "hashes, holders and models, and the token ids of chunks engines describe; no salts or secrets); logged "
        "as a WARNING at every start", False)
    kv_events_buffer: int = option(
        "--kv-events-buffer", "messages of the KV event stream kept for replay, each of at most 1024 block "
        f"hashes (~9 KiB) (default: {DEFAULT})", 10_000, type=_positive(int))
    kv_events_chunks: int = option(
        "--kv-events-chunks", "chunk descriptions (parent, token ids: ~4 bytes a token) the KV event stream "
        "remembers from engines' admissions, to publish them again when a store admits the same chunk "
        f"(default: {DEFAULT}; 0: none)", 20_000, type=_non_negative_int)
    sync_retry_s: float = 3.0  # re-ask a producer for a full sync after this long without one
    heartbeat_grace_s: float = 1.0  # a heartbeat's seq claim must be met by batches within this
    tick_interval_s: float = 0.25  # maintenance pass period
    log_level: str | None = option(  # None: $KVMESH_LOG_LEVEL, else info
        "--log-level", "log level (default: $KVMESH_LOG_LEVEL, else info)", None,
        choices=["debug", "info", "warning", "error"])
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

    def kv_events_error(self) -> str | None:
        """Why the KV event stream must not start as configured."""
        if self.kv_events_port is None:
            return ("--kv-events-replay-port needs --kv-events-port" if self.kv_events_replay_port is not None
                    else None)
        if not self.kv_events_public and not is_loopback(self.kv_events_host):
            return (f"the KV event stream would listen on {self.kv_events_host!r} (--kv-events-host), beyond "
                    "loopback, unauthenticated: bind 127.0.0.1 or pass --kv-events-public")
        return None


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache_controller",
        description="KVMesh controller: the LMCache controller REST API (lookup, pin, unpin, clear, "
                    "check_finish, health, query_worker_info) backed by a chunk index built from NATS events.")
    options_cli.add_flags(parser, ControllerConfig)
    parser.add_argument("--auth-token-file", type=Path, default=None,
                        help=f"read the token from this file (its first line; or set ${TOKEN_FILE_ENV}); keeps it "
                             "out of ps and the environment")
    lmcache = parser.add_argument_group("LMCache's controller flags (docs/compatibility.md)")
    lmcache.add_argument("--monitor-ports", type=_monitor_ports, default=None,
                         help="LMCache's JSON of named monitor ports, e.g. '{\"pull\": 9001}': the \"pull\" port is "
                              "the embedded NATS port (as --monitor-port); KVMesh needs no other (\"reply\", "
                              "\"heartbeat\": accepted with a warning). Wins over --monitor-port")
    lmcache.add_argument("--config", type=Path, default=None,
                         help="LMCache's controller config file (YAML): controller_host, controller_port, "
                              "controller_monitor_ports, health_check_interval and lmcache_worker_timeout apply "
                              "as their flags; any other key is named in a warning and ignored. Flags given on "
                              "the command line win")
    lmcache.add_argument("--health-check-interval", type=int, default=None,
                         help="LMCache's worker health check period; accepted with a warning: KVMesh checks "
                              "liveness continuously from heartbeats (--liveness-timeout, --producer-expiry-secs)")
    lmcache.add_argument("--lmcache-worker-timeout", type=_positive(float), default=None,
                         help="LMCache's name for --producer-expiry-secs: seconds a silent worker is kept "
                              "before it is forgotten")
    add_nats_auth_flags(parser)
    return parser


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
    try:
        server_context_of(args.tls_cert, args.tls_key, "--tls-cert", "--tls-key")
    except ConfigError as exc:
        parser.error(str(exc))
    values = options_cli.values(ControllerConfig, args)
    return ControllerConfig(**{
        **values,
        "auth_token": resolve_token(parser, args.auth_token, args.auth_token_file, TOKEN_ENV, TOKEN_FILE_ENV, notices,
                                    "the controller token"),
        "nats_auth": nats_auth_from_args(args), "domains_file": domains_file_of(values["domains_file"], args, os.environ),
        "notices": tuple(notices)})


# -------------------------------------------------------------------------------------------------------
# LMCache's controller settings

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
    return notices
