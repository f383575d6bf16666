"""The mesh on one machine: an embedded NATS server plus service processes, started and stopped together.

The one place KVMesh starts a NATS server: `kvmesh up` (controller + disk store + remote store), the engine
when a config names no NATS (only `vllm serve` is started, and the engine brings up NATS and a disk store in
its own process tree), and the controller started without a NATS URL (it embeds one on `--monitor-port`).
Each service is the same `python -m kvmesh.services.<name>` that runs standalone: embedding is wiring.
Children get a parent-death signal, so nothing outlives the process that started the mesh.

The NATS it starts requires credentials, with permissions per principal (shared/messaging/nats_permissions.py): a fresh
credentials directory `local_mesh_dir(port)` (shared/messaging/credentials.py) holds a user for the controller, the
operator and each store; each service gets its own file through $KVMESH_NATS_CREDENTIALS (never on its command
line); engines on this host add their own (`credentials.provision`). The directory outlives the mesh, so a
mesh restarted on the same port takes back the same users (delete it to rotate them); a mesh on a port it
picks itself is new, and starts with an empty directory.

With `tls`, the mesh's directory also holds a CA and a certificate per service (`TlsMaterial`, shared/tls.py):
NATS requires TLS of its clients (each service gets the CA through $KVMESH_NATS_TLS_CA), the remote stores' stream
ports and the controller's REST API take TLS only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.shared import protocol

from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import MeshCredentials, local_mesh_dir
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent, free_port
from kvmesh.shared.messaging.nats_auth import CREDENTIALS_ENV, TLS_ENV_VARS, nats_auth_from_args
from kvmesh.shared.tls import TLS_DIR, TlsFiles, TlsMaterial, default_hosts

log = logging.getLogger(__name__)


@dataclass
class ServiceSpec:
    """One service process: module name, its command-line flags, the id it answers health for and its role
    ("store": a store whose id is `service_id`, or "controller")."""

    module: str  # e.g. "kvmesh.services.disk_store"
    args: list[str]
    service_id: str
    role: str = "store"
    # (its certificate's service name, the flag of the certificate, the flag of the key): how a TLS mesh makes
    # its own port TLS only; None: it has no port of its own to secure
    tls_flags: tuple[str, str, str] | None = None

    @property
    def principal(self) -> protocol.Principal:
        return protocol.Principal(self.role, self.service_id if self.role == "store" else "")

    @property
    def health_path(self) -> str:
        """Where it answers health: a store's producer path, or the controller's."""
        return protocol.store_path(self.service_id) if self.role == "store" else self.principal.path


@dataclass
class LocalMesh:
    """Start NATS (unless `nats_url` is given) and the services; `stop()` ends them all.

    `start()` does both; `start_nats()` then `start_services()` lets a caller learn the NATS URL before the
    services are up (the engine's embedded mesh).
    """

    services: list[ServiceSpec]
    nats_url: str | None = None
    nats_port: int | None = None
    nats_host: str = "127.0.0.1"
    log_dir: Path | None = None
    credentials: MeshCredentials | None = None  # of the NATS we started (None: `nats_url` was given)
    tls: bool = False  # TLS for NATS, the remote stores' streams and the controller's API (a NATS we start)
    tls_hosts: list[str] = field(default_factory=list)  # names the certificates give beyond `default_hosts()`
    tls_files: dict[str, TlsFiles] = field(default_factory=dict)  # service -> its TLS files, once started
    _nats: EmbeddedNats | None = None
    _processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, ready_timeout: float = 30.0) -> "LocalMesh":
        self.start_nats()
        try:
            self.start_services(ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_nats(self) -> str:
        """Start the embedded NATS (once; nothing when `nats_url` was given); the URL services connect to."""
        if self.nats_url is None:
            port = self.nats_port or free_port(self.nats_host)
            if self.nats_port is None:  # a new mesh: what an earlier one on this port left is not its own
                shutil.rmtree(local_mesh_dir(port), ignore_errors=True)
            # Kept across restarts of a mesh on a given port, so engines that outlive it reconnect with what they have.
            self.credentials = MeshCredentials(local_mesh_dir(port))
            self.credentials.ensure(protocol.CONTROLLER.path, protocol.OPERATOR.path,
                                    *(spec.principal.path for spec in self.services))
            if self.tls:
                self.tls_files = TlsMaterial(self.credentials.root / TLS_DIR).ensure(
                    hosts=default_hosts() + [self.nats_host, *self.tls_hosts])
            self._nats = EmbeddedNats(port=port, host=self.nats_host, credentials=self.credentials,
                                      tls=self.tls_files.get("nats")).start()
            self.nats_url = self._nats.url
        return self.nats_url

    def auth(self, principal: protocol.Principal) -> bus.NatsAuth | None:
        """Credentials of `principal` on the NATS we started (added if it had none); for a given NATS, those
        of this process's environment ($KVMESH_NATS_*)."""
        if self.credentials is None:
            return nats_auth_from_args(argparse.Namespace())
        assert self._nats is not None
        auth = self.credentials.admit(principal.path)
        return dataclasses.replace(auth, tls_ca=str(self.tls_files["nats"].ca)) if self.tls_files else auth

    def start_services(self, ready_timeout: float = 30.0) -> None:
        """Spawn the service processes and wait until each answers health (on failure they are stopped again;
        NATS keeps running)."""
        try:
            for spec in self.services:
                self._processes.append(self._spawn(spec))
            self._wait_healthy(ready_timeout)
        except BaseException:
            self._stop_services()
            raise

    @property
    def pids(self) -> list[int]:
        """The NATS server's and the services' process ids."""
        nats = [self._nats.process.pid] if self._nats is not None and self._nats.process is not None else []
        return nats + [process.pid for process in self._processes]

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The service processes, in the order of `services` (a restarted service's entry is replaced)."""
        return list(self._processes)

    def respawn(self, index: int) -> subprocess.Popen[bytes]:
        """Start `services[index]` again in place of its exited process (shared/ops/supervisor.py decides when)."""
        assert self._processes[index].poll() is not None, "respawn of a service that is still running"
        self._processes[index] = self._spawn(self.services[index])
        return self._processes[index]

    def _spawn(self, spec: ServiceSpec) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", spec.module, "--nats-url", str(self.nats_url), *spec.args,
                   *self._tls_args(spec)]
        output = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.log_dir / f"{spec.service_id}.log", "ab")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if self.credentials is not None:
            env[CREDENTIALS_ENV] = str(self.credentials.file(spec.principal.path))
        if self.tls_files:
            env[TLS_ENV_VARS["tls_ca"]] = str(self.tls_files["nats"].ca)
        log.info("starting %s: %s", spec.service_id, " ".join(command))
        try:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=output, env=env,
                                    preexec_fn=_die_with_parent)
        finally:
            if output is not None:
                output.close()  # the child has its own copy; a restarted service must not leak one per start

    def _tls_args(self, spec: ServiceSpec) -> list[str]:
        """The flags that make `spec`'s own ports TLS only: the controller's API, a remote store's stream."""
        if not self.tls_files or spec.tls_flags is None:
            return []
        service, cert_flag, key_flag = spec.tls_flags
        files = self.tls_files[service]
        return [cert_flag, str(files.cert), key_flag, str(files.key)]

    def _wait_healthy(self, timeout: float) -> None:
        """Block until every service answers health over NATS (or one exits, or time runs out)."""
        pending = {spec.health_path for spec in self.services}
        deadline = time.monotonic() + timeout

        async def poll() -> None:
            nc = await bus.connect(str(self.nats_url), name="kvmesh-up", auth=self.auth(protocol.OPERATOR),
                                   allow_reconnect=False)
            try:
                while pending and time.monotonic() < deadline:
                    for spec, process in zip(self.services, self._processes):
                        if process.poll() is not None:
                            raise MeshUnavailable(f"{spec.service_id} exited with code {process.returncode} "
                                                  f"during start-up (module {spec.module})")
                    for path in list(pending):
                        try:
                            await bus.request(nc, protocol.Subjects.health(path), protocol.HealthRequest(),
                                              protocol.HealthReply, timeout=0.5)
                            pending.discard(path)
                        except MeshUnavailable:
                            await asyncio.sleep(0.05)
            finally:
                await nc.close()

        asyncio.run(poll())
        if pending:
            raise MeshUnavailable(f"services not healthy within {timeout:.0f}s: {', '.join(sorted(pending))}")

    def stop(self, timeout: float = 4.0) -> None:
        """SIGTERM every service, wait up to `timeout`, SIGKILL stragglers, then stop NATS."""
        self._stop_services(timeout)
        if self._nats is not None:
            self._nats.stop()
            self._nats = None

    def _stop_services(self, timeout: float = 4.0) -> None:
        processes, self._processes = self._processes, []
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop on SIGTERM; killing it", process.pid)
                process.kill()
                process.wait()

    def __enter__(self) -> "LocalMesh":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
