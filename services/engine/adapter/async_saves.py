"""Saves off the forward's critical path (GPU), and what preemption and request ends must wait for.

On a CUDA vLLM (`saves_off_forward`), `wait_for_save` only queues each save's gather (vLLM's paged cache ->
pinned pool slots) on a CUDA stream, ordered after the forward that wrote the KV, and returns without waiting;
the chunks enter the CPU tier (and the write-behind) once the copy's event has fired, checked in every step's
`get_finished`. The copy reads vLLM's blocks after `wait_for_save` returned, so nothing may write those blocks
before it has read them. Which stream (`AsyncSaves.stream`):
  * a model with one full-attention KV cache group: a dedicated side stream, so the gather overlaps the next
    forward. vLLM frees such a request's blocks only when it ends or is preempted:
      - a request that ends: the scheduler's `request_finished` answers True for a request that had a save
        (vLLM keeps its blocks), and the workers report it in `finished_sending` once its copies are done;
      - a preempted request (vLLM frees its blocks at once, without `request_finished`): `handle_preemptions`,
        run before the next forward, makes the forward's stream wait for the request's copies, so nothing the
        forward writes into the freed blocks can overtake them (no host wait). Such a model has no Mamba layer
        and one KV precision, so vLLM zeroes no reused block and copies none on write before that call.
  * a model with KV cache groups (`on_forward_stream`: a sliding window, a Mamba / GDN state, several
    attention groups): the forward's own stream, right behind the forward. vLLM frees such a request's blocks
    while it still runs, with neither call above: blocks that left the window and retired state pages
    (the previous running page, the prefill checkpoint) at its next schedule, which may hand them to another
    request at once; and on vLLM's V2 model runner the next step zeroes reused blocks (Mamba, mixed
    precision) and runs copy-on-write copies before the connector's `handle_preemptions` is even called. So no
    hook of the next step can order the gather first. On the forward's stream no interleaving can break it:
    nothing reaches the GPU when vLLM frees or reallocates a block (the scheduler only moves block ids), every
    write into a block (the next step's zeroing, copy-on-write copies and forward, the drafter, KVMesh's own
    load scatters) is queued by this worker's one model-runner thread after `wait_for_save` returned (vLLM
    runs a step's execute_model / sample_tokens to their end before the next; with a drafter, `wait_for_save`
    runs after the drafter's forward), on this stream or on one that first waits for it (KVMesh's layer-wise
    loader, which groups do not use), and a CUDA stream runs its work in the order it was queued. The host
    still never waits; the cost is that the gather no longer overlaps the next forward.
On CPU the copy is a memcpy by the cores that run the forward: it stays synchronous in `wait_for_save`, so
nothing is held (a second thread was measured only on a contended machine, see docs/connector.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import StoreJob

log = logging.getLogger(__name__)


def saves_off_forward(vllm_config: Any) -> bool:
    """Whether saves run on a side stream (and blocks are held until their copy ends): a CUDA vLLM. Both the
    scheduler and the workers decide it from the same config, so they agree on which requests are held."""
    device_config = getattr(vllm_config, "device_config", None)
    return str(getattr(device_config, "device_type", "cpu")) == "cuda"


class AsyncSaves:
    """Worker side: the saves whose copies may still run, and the requests whose blocks vLLM holds for them
    (vLLM's worker thread only). `on_forward_stream`: the model has KV cache groups, whose blocks vLLM frees
    while their request runs; its gathers are queued on the forward's stream (module docstring)."""

    def __init__(self, on_forward_stream: bool = False) -> None:
        self.on_forward_stream = on_forward_stream
        self._jobs: dict[str, list["StoreJob"]] = {}
        self._held: set[str] = set()  # request_finished told vLLM to keep their blocks: report them once
        self._finished: set[str] = set()  # held requests vLLM has finished, waiting for their copies
        self._stream: "torch.cuda.Stream | None" = None

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._jobs.values())

    def stream(self, device: torch.device) -> "torch.cuda.Stream | None":
        """The stream the gathers run on (None off CUDA): the forward's own when `on_forward_stream`, else a
        side stream."""
        if device.type != "cuda":
            return None
        if self.on_forward_stream:
            return torch.cuda.current_stream(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def hold(self, req_id: str) -> None:
        """The scheduler planned a save for `req_id`: it keeps the request's blocks after it ends, until it is
        reported in finished_sending (whatever became of the save)."""
        self._held.add(req_id)

    def unhold(self, req_id: str) -> None:
        """The request waits for an asynchronous load (WAITING_FOR_REMOTE_KVS): vLLM keeps its blocks until the
        load is reported, and the scheduler answers False from request_finished; reporting it in
        finished_sending as well would free its blocks twice. Its earlier copies were ordered before its
        preemption's reuse of their blocks."""
        self._held.discard(req_id)
        self._finished.discard(req_id)

    def add(self, req_id: str, job: "StoreJob") -> None:
        self._jobs.setdefault(req_id, []).append(job)

    def admit_done(self) -> None:
        """Admit the chunks of every save whose copies have ended (in each request's order)."""
        for req_id in list(self._jobs):
            jobs = self._jobs[req_id]
            while jobs and jobs[0].done():
                _admit(req_id, jobs.pop(0))
            if not jobs:
                del self._jobs[req_id]

    def order_before_reuse(self, req_ids: Iterable[str], device: torch.device | None) -> int:
        """Preempted requests: work queued on `device`'s current stream from now on (the next forward, which may
        write into their freed blocks) waits for their copies. How many saves it waits for."""
        jobs = [job for req_id in req_ids for job in self._jobs.get(req_id, [])]
        if jobs and device is not None and device.type == "cuda":
            current = torch.cuda.current_stream(device)
            for job in jobs:
                job.order_before(current)
        return len(jobs)

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """The held requests vLLM has finished (now or in an earlier step) whose copies have all ended: their
        blocks may be freed. Reported once each."""
        self._finished |= self._held.intersection(finished_req_ids)
        self.admit_done()
        done = {req_id for req_id in self._finished if req_id not in self._jobs}
        self._finished -= done
        self._held -= done
        return done

    def drain(self) -> None:
        """Shutdown: wait for every copy; admit what ended well."""
        for req_id, jobs in self._jobs.items():
            for job in jobs:
                _admit(req_id, job)
        self._jobs.clear()


def _admit(req_id: str, job: "StoreJob") -> None:
    try:
        job.admit()
    except Exception as exc:  # a failed copy stores nothing; vLLM's request is unaffected
        log.warning("storing KV for request %s failed (%s: %s); skipped", req_id, type(exc).__name__, exc)
        try:
            job.abandon()
        except Exception:  # the wait itself fails (broken CUDA context): leave the slots allocated
            pass
