"""Keep a LocalMesh's services running: a service process that exits is logged and started again after a backoff.

`kvmesh up` calls `Supervisor.step()` a few times a second. Each exit (exit code or signal) is logged once; the
service is restarted `Backoff.initial` seconds later, doubling after each quick exit up to `Backoff.maximum`, so a
service that cannot start does not spin. A service that stayed up `Backoff.reset_after` seconds starts again
from `initial`. NATS and the other services are not touched. The clock is injectable (tests use ManualClock).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    initial: float = 1.0  # seconds before the first restart
    maximum: float = 30.0  # the delay doubles after each quick exit, up to this
    reset_after: float = 60.0  # up at least this long: the next exit waits `initial` again

    def next_delay(self, previous: float | None, uptime: float) -> float:
        """The wait before restarting a service that exited after `uptime` s; `previous`: the last wait."""
        if previous is None or uptime >= self.reset_after:
            return self.initial
        return min(previous * 2, self.maximum)


def describe_exit(returncode: int) -> str:
    if returncode < 0:  # Popen's way of saying "killed by a signal"
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class _State:
    started_at: float
    delay: float | None = None  # the last backoff used (None: never restarted yet)
    restart_at: float | None = None  # set while the service is down, waiting for its restart


class Supervisor:
    """Watches `mesh`'s service processes (after `mesh.start()`); `step()` logs exits and restarts when due.
    `backoff=None`: exits are only logged (`kvmesh up --no-restart` then stops the mesh)."""

    def __init__(self, mesh: LocalMesh, backoff: Backoff | None = Backoff(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mesh = mesh
        self.backoff = backoff
        self.clock = clock
        now = clock()
        self._states = [_State(started_at=now) for _ in mesh.services]

    def exited(self) -> list[ServiceSpec]:
        """Services that exited since the last call (each exit logged once), with their restart scheduled."""
        now = self.clock()
        found = []
        for spec, process, state in zip(self.mesh.services, self.mesh.processes, self._states):
            if state.restart_at is not None or process.poll() is None:
                continue
            found.append(spec)
            if self.backoff is None:
                state.restart_at = float("inf")  # never: logged once, left down
                log.error("%s (pid %d) %s", spec.service_id, process.pid, describe_exit(process.returncode))
                continue
            state.delay = self.backoff.next_delay(state.delay, now - state.started_at)
            state.restart_at = now + state.delay
            log.error("%s (pid %d) %s; restarting it in %g s", spec.service_id, process.pid,
                      describe_exit(process.returncode), state.delay)
        return found

    def restart_due(self) -> list[ServiceSpec]:
        """Start again every exited service whose backoff has passed; those services."""
        now = self.clock()
        restarted = []
        for index, (spec, state) in enumerate(zip(self.mesh.services, self._states)):
            if state.restart_at is None or now < state.restart_at:
                continue
            process: subprocess.Popen[bytes] = self.mesh.respawn(index)
            state.started_at, state.restart_at = now, None
            log.warning("restarted %s (pid %d)", spec.service_id, process.pid)
            restarted.append(spec)
        return restarted

    def step(self) -> list[ServiceSpec]:
        """Log new exits and restart those due; the services that exited since the last step."""
        found = self.exited()
        self.restart_due()
        return found
