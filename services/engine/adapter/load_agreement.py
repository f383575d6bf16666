"""The ranks of one vLLM replica agree on how far each of a step's loads brought the tokens' own KV.

With tensor (or pipeline) parallelism every rank loads its own shard of a request's chunks. If one rank's load
stops short (a chunk evicted there between lookup and load, a store that timed out for that rank only), the
step's forward on *every* rank computes over that rank's wrong KV: hidden states are all-reduced across ranks
after each layer. A rank whose own load succeeded would then save its shard of KV computed over wrong context,
and the later recompute could never replace it (the tiers keep the first copy of a key). So before the forward,
every rank takes the minimum over the replica of each load's first wrong token, and cuts its saves there as if
its own load had failed (request_load.py `RequestLoad.fail`).

Every rank of a replica receives the same step metadata and calls `start_load_kv` at the same point, so each
calls `min_over_ranks` the same number of times with lists of the same length: one small all-reduce on vLLM's
gloo (CPU) groups per step that has in-step loads, none otherwise, and none with a single rank.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import torch

log = logging.getLogger(__name__)


class RankAgreement(Protocol):
    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of `values` over every rank of the replica (each rank passes its own)."""


class CollectiveAgreement:
    """`min_over_ranks` by all-reduce over vLLM's CPU groups of this replica (tensor, then pipeline)."""

    def __init__(self, groups: Sequence[Any]) -> None:
        self.groups = list(groups)

    @classmethod
    def of_replica(cls) -> "CollectiveAgreement | None":
        """The agreement of this worker's replica (vLLM's groups are initialised by register_kv_caches); None with
        one rank."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        groups = [g.cpu_group for g in (get_tp_group(), get_pp_group()) if g.world_size > 1]
        return cls(groups) if groups else None

    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        tensor = torch.tensor(list(values), dtype=torch.int64)
        for group in self.groups:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=group)
        return [int(v) for v in tensor.tolist()]


__all__ = ["CollectiveAgreement", "RankAgreement"]
