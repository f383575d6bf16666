"""Which hits of a model with KV cache groups the scheduler loads in-step, and what it keeps for them until the
step that loads them is planned.

vLLM 0.32 takes no failed in-step load with several KV cache groups (kv_groups.py), so with groups a hit loads in
the step that schedules it only when its load cannot fail: every chunk (and the state) of it leased in the CPU
tiers of this process's engines, when all its ranks are here (cpu_leases.py), or, when none is, held in every
rank's CPU tier as the scheduler's mirror says, the workers holding what they evict until the mirror saw it
(cpu_mirror.py). Every other load runs between steps. The scheduler half (scheduler_side.py) asks
`InStepLoads.loads_in_step` at each lookup, hands each step's plan to `InStepLoads.planned`, and `forget`s a
finished request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.services.engine.adapter.cpu_leases import lease_spans, leases
from kvmesh.services.engine.adapter.scheduler_lookup import engines
from kvmesh.shared.protocol import LOCAL_CPU

if TYPE_CHECKING:
    from kvmesh.services.engine.adapter.kv_groups import KVGroups
    from kvmesh.services.engine.adapter.request_meta import RequestTracker
    from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup
    from kvmesh.services.engine.adapter.vllm_blocks import VllmBlocks
    from kvmesh.services.engine.config.engine_config import EngineConfig


class InStepLoads:
    """The scheduler's in-step loads with KV cache groups: the requests whose lookup leased their hit, or had it
    promised from the mirror, since the last step's plan."""

    def __init__(self, config: "EngineConfig", groups: "KVGroups | None", block_size: int) -> None:
        self.groups = groups  # vLLM's KV cache groups, None without them (then nothing loads in-step here)
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.workers_hold = config.evicted_hold_share > 0 and config.local_cpu  # as theirs says (one config)
        self._leased: set[str] = set()  # requests whose lookup leased CPU-tier chunks since the last step's plan
        # requests whose in-step load was promised from the mirror since the last plan: the events it had applied
        self._promised: dict[str, dict[int, int]] = {}

    def loads_in_step(self, tracker: "RequestTracker", hit: int, lookup: "SchedulerLookup | None",
                      vllm_blocks: "VllmBlocks | None") -> bool:
        """Whether the request's `hit` can load in-step with KV cache groups (its load cannot fail): every chunk
        (and the state) of it leased in the CPU tiers of this process's engines, when all its ranks are here
        (cpu_leases.py), or, when none is, held in every rank's CPU tier as the mirror says, the workers holding
        what they evict until the mirror saw it (cpu_mirror.py)."""
        local = engines.all()
        tiers = tracker.kv_params.load_tiers
        self._promised.pop(tracker.req_id, None)
        if lookup is None or (tiers is not None and LOCAL_CPU not in tiers) \
                or not self.room(tracker.request.num_tokens, vllm_blocks):
            leases.release(tracker.req_id)
            return False
        keys = [span.key for span in tracker.chain[:-(-hit // self.chunk_size)]]
        if tracker.hit_key is not None:  # the hit ends with a block prefix (block_prefix.py)
            keys[-1] = tracker.hit_key
        state_chain_key = tracker.state_key if self.groups is not None and self.groups.has_state else None
        if not local:  # the workers are in other processes: only where they hold what they evict
            promise = lookup.cpu_promise(keys, state_chain_key) if self.workers_hold else None
            if promise is not None:
                self._promised[tracker.req_id] = promise
            return promise is not None
        if len(local) != lookup.world_size:
            return False
        leased = leases.lease(tracker.req_id, local,
                              lambda engine: lease_spans(engine, keys, hit, state_chain_key, self.block_size))
        if leased:
            self._leased.add(tracker.req_id)
        return leased

    def room(self, num_tokens: int, vllm_blocks: "VllmBlocks | None") -> bool:
        """Whether vLLM's pool (`vllm_blocks`) surely holds the blocks of an in-step load of a `num_tokens`-token
        request. vLLM 0.32's admission check leaves out the block an align-mode Mamba group takes for the state an
        external hit resumes from (MambaManager.get_num_blocks_to_allocate): with the pool one block short,
        allocate_slots raises instead of declining, and schedule() with it. An asynchronous load is admitted with
        the in-flight loads' blocks reserved; in-step loads of a state model go ahead only with room for every
        group's blocks of the whole request twice over (its own and vLLM's prefix-cache blocks it touches) and
        the state block, which vLLM's real need never exceeds."""
        assert self.groups is not None
        if not self.groups.has_state:
            return True
        if vllm_blocks is None:
            return False
        per_group = 2 * -(-num_tokens // self.block_size) + 1
        return vllm_blocks.free_blocks() >= len(self.groups.groups) * per_group

    def planned(self, in_step: set[str], lookup: "SchedulerLookup | None") -> dict[int, int | None] | None:
        """A step's plan is made, loading the requests `in_step` in-step: what the workers may stop holding
        (`KVMeshConnectorMetadata.evictions_seen`, cpu_mirror.py; None without groups or a lookup).
        A lease lives from its lookup to the step that loads it: requests vLLM did not schedule now drop theirs
        (their next lookup leases anew); the worker takes the rest in start_load_kv."""
        for req_id in self._leased - in_step:
            leases.release(req_id)
        self._leased.clear()
        seen = None
        if self.groups is not None and lookup is not None:
            seen = lookup.evictions_seen(
                [promise for req_id, promise in self._promised.items() if req_id in in_step])
        self._promised.clear()
        return seen

    def forget(self, req_id: str) -> None:
        """The request finished: its lease (if any) is released, its promise dropped."""
        leases.release(req_id)
        self._leased.discard(req_id)
        self._promised.pop(req_id, None)
