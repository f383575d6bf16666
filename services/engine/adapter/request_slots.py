"""Where a request's KV sits in vLLM's paged cache, for the worker's loads (request_load.py) and saves (saves.py):
the slots of its first tokens, and the span and slots of a recurrent state (kv_groups.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmesh.services.engine.adapter.kv_groups import KVGroups
from kvmesh.services.engine.adapter.request_meta import ReqMeta
from kvmesh.shared.wire.keys import ChunkKey, ChunkSpan

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine


class RequestSlots:
    """A worker's block and chunk sizes and, when copies need each group's block table, vLLM's KV cache groups
    (else None)."""

    def __init__(self, block_size: int, chunk_size: int, groups: KVGroups | None) -> None:
        self.block_size, self.chunk_size = block_size, chunk_size
        self.groups = groups

    def tokens(self, req: ReqMeta, num_tokens: int, start: int = 0) -> torch.Tensor:
        """The slots of the request's tokens [start, num_tokens) (with groups one row per group, none for the
        state groups)."""
        if self.groups is not None and req.group_block_ids is not None:
            return self.groups.chunk_slots(req.group_block_ids, num_tokens, start)
        return req.slot_mapping(num_tokens, self.block_size, start)

    def state(self, engine: "CacheEngine", req: ReqMeta, end: int, chain_key: ChunkKey, column: int | None = None,
              window: bool = False) -> tuple[ChunkSpan, torch.Tensor]:
        """This worker's span of the recurrent state after `end` tokens (stored under `chain_key`'s state key),
        and the slots of the state groups' block `column` that holds it (default: where a load of `end` tokens
        writes it): from token 0 on, or with `window` (a save's) from the span's first token on."""
        assert self.groups is not None and req.group_block_ids is not None
        span = engine.state_span(chain_key, end, self.block_size)
        return span, self.groups.state_slots(req.group_block_ids, end, column, span.start if window else 0)
