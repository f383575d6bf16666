"""shared/ops/supervisor.py on a ManualClock with stand-in processes: the restart backoff doubles after each quick
exit up to its cap, starts over after a service stayed up, and only the exited service is touched."""

from __future__ import annotations

import itertools
import logging
import signal

import pytest

from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.ops.supervisor import Backoff, Supervisor, describe_exit

from support.waiting import ManualClock


class FakeProcess:
    """What the supervisor reads of a Popen: pid, poll(), returncode."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeMesh(LocalMesh):
    """A LocalMesh whose `_spawn` makes FakeProcesses (no NATS, no children)."""

    def _spawn(self, spec: ServiceSpec) -> FakeProcess:  # type: ignore[override]
        self.spawned.append(spec.service_id)
        return FakeProcess(pid=next(self.pids_to_come))


def make_mesh() -> FakeMesh:
    mesh = FakeMesh([ServiceSpec("m.controller", [], "controller", role="controller"),
                     ServiceSpec("m.disk", [], "disk-x")])
    mesh.spawned = []  # type: ignore[attr-defined]
    mesh.pids_to_come = itertools.count(1001)  # type: ignore[attr-defined]
    mesh._processes = [mesh._spawn(spec) for spec in mesh.services]  # as start_services does
    mesh.spawned.clear()  # type: ignore[attr-defined]
    return mesh


def test_backoff_doubles_to_its_cap_and_resets_after_an_uptime() -> None:
    backoff = Backoff(initial=1.0, maximum=30.0, reset_after=60.0)
    delays, previous = [], None
    for _ in range(8):
        previous = backoff.next_delay(previous, uptime=0.5)
        delays.append(previous)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.next_delay(30.0, uptime=60.0) == 1.0


def test_supervisor_restarts_only_the_dead_service_on_the_backoff_schedule(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    mesh = make_mesh()
    supervisor = Supervisor(mesh, Backoff(initial=1.0, maximum=4.0, reset_after=60.0), clock=clock)
    controller = mesh.processes[0]
    assert supervisor.step() == [] and mesh.spawned == []

    restart_times = []
    for _ in range(5):  # the disk store keeps dying right after each start
        mesh.processes[1].returncode = -signal.SIGKILL
        died_at = clock.now
        assert [s.service_id for s in supervisor.step()] == ["disk-x"]
        spawned = len(mesh.spawned)
        while len(mesh.spawned) == spawned:
            clock.advance(0.25)
            assert supervisor.step() == []  # the exit is reported once, not on every step
        restart_times.append(clock.now - died_at)
    assert restart_times == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert mesh.spawned == ["disk-x"] * 5
    assert mesh.processes[0] is controller  # the controller was left alone

    clock.advance(60.0)  # stayed up: the next exit waits the initial delay again
    mesh.processes[1].returncode = 3
    with caplog.at_level(logging.INFO, logger="kvmesh.shared.ops.supervisor"):
        supervisor.step()
        clock.advance(1.0)
        assert [s.service_id for s in supervisor.step()] == []
    assert mesh.spawned == ["disk-x"] * 6
    assert "disk-x (pid 1007) exited with code 3; restarting it in 1 s" in caplog.text
    assert "restarted disk-x (pid 1008)" in caplog.text


def test_without_backoff_an_exit_is_reported_once_and_nothing_restarts() -> None:
    clock = ManualClock()
    mesh = make_mesh()
    supervisor = Supervisor(mesh, None, clock=clock)
    mesh.processes[0].returncode = 1
    assert [s.service_id for s in supervisor.step()] == ["controller"]
    clock.advance(3600)
    assert supervisor.step() == [] and mesh.spawned == []


def test_describe_exit() -> None:
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
