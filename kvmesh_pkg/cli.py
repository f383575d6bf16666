"""The `kvmesh` command: run the whole mesh on one machine, or one service against a NATS URL.

    kvmesh up                   embedded NATS + controller + disk store + remote store; a service that exits is
                                restarted (with backoff); Ctrl-C/SIGTERM stops all; --tls: TLS across hosts
    kvmesh controller ...       the controller (also `lmcache_controller --host --port --monitor-port`)
    kvmesh disk-store ...       the disk store of this host
    kvmesh remote-store ...     one remote-store partition
    kvmesh pd-proxy --prefill URL --decode URL   the OpenAI API in front of prefill and decode vLLMs (PD)
    kvmesh health --nats-url U  every service's health over NATS
    kvmesh credentials --dir D PRINCIPAL...   NATS users for a mesh whose NATS KVMesh does not start (compose);
                                with --tls, a CA and a certificate per service too; --route: a NATS cluster
    kvmesh wipe --store ID      as the operator: forget every unpinned chunk of a store, whoever put it (an
                                engine's /clear only takes back its own chunks)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from nats.aio.client import Client as NatsClient

from kvmesh.shared import protocol

from kvmesh.services.controller.config import TOKEN_ENV, TOKEN_FILE_ENV, is_loopback
from kvmesh.shared.errors import ConfigError, KVMeshError, MeshUnavailable
from kvmesh.shared.eviction import POLICY_NAMES
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import (MeshCredentials, controller_token_file, credentials_for, local_mesh_dir,
                                                 runtime_dir)
from kvmesh.shared.messaging.embedded_nats import nats_cluster_settings, nats_tls_settings, server_settings
from kvmesh.shared.messaging.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.messaging.nats_url import DEFAULT_PORT, DEFAULT_URL, argument as nats_url_argument
from kvmesh.shared.messaging.sharing_domains import check_domain_name
from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.ops.service import configure_logging, ping_all
from kvmesh.shared.ops.store_commands import DISK_STORE, REMOTE_STORE, disk_store, remote_stores
from kvmesh.shared.ops.supervisor import Backoff, Supervisor
from kvmesh.shared.options_cli import GB
from kvmesh.shared.protocol import CONTROLLER, OPERATOR, Subjects, disk_store_id
from kvmesh.shared.tls import TLS_DIR, TlsMaterial, default_hosts

log = logging.getLogger("kvmesh")

SERVICE_MODULES = {
    "controller": "kvmesh.services.controller",
    "disk-store": DISK_STORE,
    "remote-store": REMOTE_STORE,
    "pd-proxy": "kvmesh.services.pd_proxy",
}


def controller_token(args: argparse.Namespace) -> Path | None:
    """The token file `kvmesh up` makes for a controller reachable beyond loopback (in the mesh's credentials
    directory; kept across runs); None on loopback (the quickstarts' curl needs none), with --insecure-no-auth, or
    when $KVMESH_CONTROLLER_TOKEN / $KVMESH_CONTROLLER_TOKEN_FILE already give the controller one."""
    if is_loopback(args.host) or args.insecure_no_auth or os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_FILE_ENV):
        return None
    directory = runtime_dir() / f"controller-{args.port}" if args.nats_url else local_mesh_dir(args.nats_port)
    try:
        return controller_token_file(directory)
    except ConfigError as exc:
        raise SystemExit(f"kvmesh up: cannot make the controller's token: {exc}") from None


def mesh_services(args: argparse.Namespace, token_file: Path | None = None) -> list[ServiceSpec]:
    controller_args = ["--host", args.host, "--port", str(args.port)]
    if token_file is not None:
        controller_args += ["--auth-token-file", str(token_file)]
    if args.insecure_no_auth:
        controller_args.append("--insecure-no-auth")
    if args.liveness_timeout is not None:
        controller_args += ["--liveness-timeout", str(args.liveness_timeout)]
    for flag, value in (("--kv-events-port", args.kv_events_port),
                        ("--kv-events-replay-port", args.kv_events_replay_port),
                        ("--kv-events-chunks", args.kv_events_chunks)):
        if value is not None:
            controller_args += [flag, str(value)]
    services = [ServiceSpec("kvmesh.services.controller", controller_args, "controller", role="controller",
                            tls_flags=("controller", "--tls-cert", "--tls-key"))]
    if not args.no_disk:
        services.append(disk_store(Path(args.disk_dir), round(args.disk_size * GB), disk_store_id(),
                                   args.cache_policy))
    if not args.no_remote:
        services += remote_stores(round(args.remote_size * GB), args.remote_partitions, args.cache_policy)
    return services


def cmd_up(args: argparse.Namespace) -> int:
    if not 0 < args.restart_backoff <= args.restart_backoff_max:  # a zero delay would restart in a tight loop
        raise SystemExit("kvmesh up: needs 0 < --restart-backoff <= --restart-backoff-max")
    if args.kv_events_chunks is not None and args.kv_events_chunks < 0:  # else the controller exits, restarted
        raise SystemExit("kvmesh up: --kv-events-chunks must be >= 0")
    token_file = controller_token(args)
    if args.tls and args.nats_url:
        raise SystemExit("kvmesh up: --tls makes the certificates of the NATS it starts; with --nats-url, give the "
                         "services that NATS's CA in $KVMESH_NATS_TLS_CA")
    mesh = LocalMesh(mesh_services(args, token_file), nats_url=args.nats_url, nats_port=args.nats_port,
                     log_dir=Path(args.log_dir) if args.log_dir else None, tls=args.tls,
                     tls_hosts=[args.host] if not is_loopback(args.host) else [])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    mesh.start()
    scheme = "https" if args.tls else "http"
    print(json.dumps({"nats_url": mesh.nats_url, "controller": f"{scheme}://{args.host}:{args.port}",
                      "controller_token_file": str(token_file) if token_file else None,
                      "tls_ca": str(mesh.tls_files["nats"].ca) if mesh.tls_files else None,
                      "services": [s.service_id for s in mesh.services]}), flush=True)
    log.info("mesh up: NATS %s, controller %s://%s:%d; Ctrl-C stops it", mesh.nats_url, scheme, args.host, args.port)
    if token_file is not None:
        log.info("the controller's REST API needs its token: curl -H \"Authorization: Bearer $(cat %s)\" ...",
                 token_file)
    backoff = Backoff(initial=args.restart_backoff, maximum=args.restart_backoff_max)
    supervisor = Supervisor(mesh, None if args.no_restart else backoff)
    try:
        # Restarts happen only in this loop, before mesh.stop(): nothing starts during shutdown, and a process
        # restarted just before it is in mesh.processes, so stop() ends it too.
        while not stop.wait(0.2):
            if supervisor.step() and args.no_restart:
                log.error("stopping the mesh (--no-restart)")
                stop.set()
    finally:
        mesh.stop()
    log.info("mesh stopped")
    return 0


async def connect_operator(args: argparse.Namespace, name: str) -> NatsClient:
    """A connection as the operator: credentials from the flags / $KVMESH_NATS_*, else from the KVMesh-started
    NATS on this host."""
    url = bus.normalize_url(args.nats_url)
    auth = credentials_for(url, OPERATOR, nats_auth_from_args(args))
    return await bus.connect(url, name=name, auth=auth, allow_reconnect=False)


def cmd_health(args: argparse.Namespace) -> int:
    async def collect() -> list[dict]:
        nc = await connect_operator(args, "kvmesh-health")
        try:
            return [r.__dict__ for r in await ping_all(nc, wait=args.wait)]
        finally:
            await nc.close()

    replies = asyncio.run(collect())
    print(json.dumps(replies, indent=2, default=str))
    return 0 if len(replies) >= args.expect else 1


def cmd_credentials(args: argparse.Namespace) -> int:
    """Credentials for the named principals (and the operator and controller) in a directory; with --listen, the
    NATS server config that uses them too."""
    principals = [CONTROLLER.path, OPERATOR.path, *args.principals]
    if args.route and not args.listen:
        raise SystemExit("kvmesh credentials: --route goes in the server config: give --listen too")
    try:
        mesh = MeshCredentials(Path(args.dir))
    except ConfigError as exc:
        raise SystemExit(f"kvmesh credentials: {exc}") from None
    if args.domain is not None:
        try:
            check_domain_name(args.domain)
        except ValueError as exc:
            raise SystemExit(f"kvmesh credentials: --domain: {exc}") from None
    try:
        # --domain moves the named engines (only those) into it; without it each keeps the domain it had
        if mesh.ensure(*principals, domain=args.domain) and mesh.reload_server():
            log.info("the NATS server running with %s loaded the new users", mesh.root)
    except MeshUnavailable as exc:
        raise SystemExit(f"kvmesh credentials: {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"kvmesh credentials: {exc}; principals are engine.<instance_id>, store.<store_id>, "
                         "controller, operator") from None
    files = {path: str(mesh.file(path)) for path in principals}
    tls_settings = ""
    nats_tls = None
    if args.tls:
        material = TlsMaterial(mesh.root / TLS_DIR).ensure(hosts=default_hosts() + (args.tls_host or []))
        files["tls-ca"] = str(next(iter(material.values())).ca)
        files.update({f"tls-{service}": str(tls.cert) for service, tls in material.items()})
        nats_tls = material["nats"]
        tls_settings = nats_tls_settings(nats_tls)
    if args.route:  # with --tls the routes too are TLS only, both ends verified
        tls_settings += nats_cluster_settings(args.cluster_name, args.cluster_listen, args.route, nats_tls)
    if args.listen:
        files["nats-server"] = str(mesh.server_config(args.listen, server_settings() + tls_settings))
    print(json.dumps(files, indent=2))
    return 0


def cmd_wipe(args: argparse.Namespace) -> int:
    """Send `wipe` to each named store as the operator; print one JSON line per store: what it removed (chunks
    and tokens; pinned chunks stay) or why not. Exit 1 if a store refused or did not answer."""

    async def wipe_one(nc: NatsClient, store_id: str) -> dict[str, object]:
        subject = Subjects.store(store_id, "wipe", OPERATOR.path)
        try:
            reply = await bus.request(nc, subject, protocol.WipeRequest(), protocol.CommandReply, args.timeout)
            if not reply.ok:
                return {"store": store_id, "ok": False, "error": reply.error}
            stats = await bus.request(nc, Subjects.store(store_id, "stats", OPERATOR.path),
                                      protocol.StatsRequest(), protocol.StatsReply, args.timeout)
        except MeshUnavailable as exc:
            return {"store": store_id, "ok": False, "error": str(exc)}
        return {"store": store_id, "ok": True, "removed_chunks": reply.num_chunks,
                "removed_tokens": reply.num_tokens, "kept_pinned_chunks": stats.num_chunks}

    async def wipe_all() -> list[dict[str, object]]:
        nc = await connect_operator(args, "kvmesh-wipe")
        try:
            return [await wipe_one(nc, store_id) for store_id in args.store]
        finally:
            await nc.close()

    try:
        results = asyncio.run(wipe_all())
    except KVMeshError as exc:  # NATS unreachable or credentials rejected, a bad credential flag
        print(f"kvmesh wipe: {exc}", file=sys.stderr)
        return 2
    for result in results:
        print(json.dumps(result), flush=True)
    return 0 if all(result["ok"] for result in results) else 1


def run_service(name: str, argv: list[str]) -> int:
    """Run one service's own main in this process (the same module `kvmesh up` spawns)."""
    import importlib
    module = importlib.import_module(SERVICE_MODULES[name] + ".__main__")
    module.main(argv)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run NATS, the controller and the stores on this machine")
    up.add_argument("--nats-url", type=nats_url_argument, help="use this NATS (a cluster's servers comma-separated) instead of embedding one")
    up.add_argument("--nats-port", type=int, default=DEFAULT_PORT,
                    help=f"port of the embedded NATS (default {DEFAULT_PORT})")
    up.add_argument("--host", default="localhost",
                    help="controller REST host; beyond loopback, kvmesh up gives the controller a token (a 0600 file "
                         "in the mesh's credentials directory, printed at start)")
    up.add_argument("--insecure-no-auth", action="store_true",
                    help="no token for a controller beyond loopback (its WARNING at every start)")
    up.add_argument("--port", type=int, default=9000, help="controller REST port")
    up.add_argument("--liveness-timeout", type=float, default=None,
                    help="passed to the controller: seconds without a heartbeat before a producer is down")
    up.add_argument("--kv-events-port", type=int, default=None,
                    help="passed to the controller: publish every tier's KV events on this loopback port")
    up.add_argument("--kv-events-replay-port", type=int, default=None,
                    help="passed to the controller: serve replays of the KV event stream on this loopback port")
    up.add_argument("--kv-events-chunks", type=int, default=None,
                    help="passed to the controller: chunk descriptions its KV event stream remembers, so that a "
                         "store's admission of a described chunk is published with its tokens (default: the "
                         "controller's 20000; 0: none)")
    up.add_argument("--disk-dir", default="local/kvmesh_disk", help="disk store directory")
    up.add_argument("--disk-size", type=float, default=5.0, help="disk store size cap, GB")
    up.add_argument("--remote-size", type=float, default=4.0, help="remote store memory cap per partition, GB")
    up.add_argument("--remote-partitions", type=int, default=1, help="remote store replicas (key partitions)")
    up.add_argument("--cache-policy", type=str.upper, choices=POLICY_NAMES, default="LRU",
                    help="eviction order of the disk and remote stores (default LRU)")
    up.add_argument("--no-disk", action="store_true", help="do not run a disk store")
    up.add_argument("--no-remote", action="store_true", help="do not run a remote store")
    up.add_argument("--log-dir", help="write each service's output to <dir>/<service>.log")
    up.add_argument("--restart-backoff", type=float, default=Backoff.initial,
                    help="seconds before restarting a service that exited; doubles after each quick exit")
    up.add_argument("--restart-backoff-max", type=float, default=Backoff.maximum,
                    help="cap of the restart delay, seconds")
    up.add_argument("--no-restart", action="store_true", help="stop the whole mesh when a service exits")
    up.add_argument("--tls", action="store_true",
                    help="TLS across hosts: a CA and per-service certificates in the mesh's credentials directory "
                         "(tls/, kept across runs); NATS, the remote stores' streams and the controller's API take "
                         "TLS only (clients: the printed tls_ca)")
    health = sub.add_parser("health", help="ask every service on a NATS for its health; each ping-all reply is "
                                           "confirmed on the replier's own health subject and shown as what its "
                                           "path is (an engine that claims to be a store shows as an engine)")
    health.add_argument("--nats-url", type=nats_url_argument, default=DEFAULT_URL)
    health.add_argument("--wait", type=float, default=0.5,
                        help="seconds to collect ping-all replies; confirming them takes at most max(wait, 1) more")
    health.add_argument("--expect", type=int, default=1, help="exit 1 unless at least this many answer")
    add_nats_auth_flags(health)
    credentials = sub.add_parser(
        "credentials", help="make NATS credentials for a mesh (one 0600 file per principal) and a server config")
    credentials.add_argument("--dir", required=True, help="the credentials directory (created 0700)")
    credentials.add_argument("--listen", help="also write nats-server.conf listening here (e.g. 0.0.0.0:4222)")
    credentials.add_argument(
        "--domain", default=None, metavar="DOMAIN",
        help="put the named engine principals in this sharing domain (default: 'default', or the one they are "
             "in): stores show an engine only its domain's chunks; recorded in domains.json, which each store "
             "reads beside its own credentials file, and in each engine's file with the domain's secret")
    credentials.add_argument(
        "--tls", action="store_true",
        help=f"also make a CA and a certificate (with key) per service in <dir>/{TLS_DIR}/, kept across runs; with "
             "--listen the NATS server requires TLS (clients: tls:// URLs and --nats-tls-ca <dir>/tls/ca.pem)")
    credentials.add_argument("--tls-host", action="append", metavar="HOST",
                             help="a host name or address the certificates also name (repeat; they always name "
                                  "localhost, loopback and this host's name)")
    credentials.add_argument(
        "--route", action="append", metavar="HOST:PORT",
        help="a node of the NATS cluster this server joins (repeat for every node, itself included: NATS drops a "
             "route to itself, so all the nodes share one config; give each its name with nats-server --name): "
             "the config gets a cluster {} block; with --tls its routes are TLS only, both ends verified")
    credentials.add_argument("--cluster-name", default="kvmesh", help="the NATS cluster's name (with --route)")
    credentials.add_argument("--cluster-listen", default="0.0.0.0:6222", metavar="HOST:PORT",
                             help="where each server takes routes (with --route; default 0.0.0.0:6222)")
    credentials.add_argument("principals", nargs="*", metavar="PRINCIPAL",
                             help="engine.<instance_id> or store.<store_id> (controller and operator always)")
    wipe = sub.add_parser(
        "wipe", help="as the operator, forget every unpinned chunk of a store, whoever put it",
        description="Forget every unpinned chunk of a store (and every put in flight), whoever put it, as the "
                    "operator: the only caller a store takes `wipe` from. An engine's clear (the controller's "
                    "/clear) removes only that engine's own chunks. Prints one JSON line per store.")
    wipe.add_argument("--store", action="append", required=True, metavar="STORE_ID",
                      help="the store to wipe, e.g. disk-<host> or remote-0 (repeat for several)")
    wipe.add_argument("--nats-url", type=nats_url_argument, default=DEFAULT_URL)
    wipe.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each store's answer")
    add_nats_auth_flags(wipe)
    for name in SERVICE_MODULES:
        sub.add_parser(name, help=f"run the {name} (flags: kvmesh {name} --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    if argv and argv[0] in SERVICE_MODULES:
        sys.exit(run_service(argv[0], argv[1:]))
    args = build_parser().parse_args(argv)
    commands = {"up": cmd_up, "health": cmd_health, "credentials": cmd_credentials, "wipe": cmd_wipe}
    sys.exit(commands[args.command](args))


if __name__ == "__main__":
    main()
