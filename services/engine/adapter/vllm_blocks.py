"""What the scheduler half reads from, and tells, vLLM's KV cache manager (`bind_kv_cache_manager`).

With KV cache groups each step's block tables are read from it: they are what the step's forward uses, with the
blocks a sliding window freed as the null block (kv_groups.py). Blocks whose load failed leave its prefix cache
(`uncache_failed`), so no later hit reads KV that no prompt computed.
"""

from __future__ import annotations

from typing import Any, Iterable


class VllmBlocks:
    """vLLM's KV cache manager, as the connector's scheduler half uses it."""

    def __init__(self, kv_cache_manager: Any) -> None:
        self.manager = kv_cache_manager
        self.null = kv_cache_manager.block_pool.null_block.block_id

    def free_blocks(self) -> int:
        """Blocks vLLM's pool can hand out now (free, or cached and idle)."""
        return int(self.manager.block_pool.get_num_free_blocks())

    def tables(self, req_id: str) -> list[list[int]]:
        """The request's block ids per group, null entries -1."""
        return [[-1 if block == self.null else block for block in group]
                for group in self.manager.get_block_ids(req_id)]

    def uncache_failed(self, invalid: set[int], req_ids: Iterable[str]) -> None:
        """Blocks whose load failed, and every later block of a request (of `req_ids`) holding one, leave vLLM's
        prefix cache. Under the "recompute" policy vLLM keeps them cached for the request to recompute; a request
        preempted or aborted before it does frees them still cached, and a later hit (its own resumption, or
        another request's) would read KV that no prompt computed. Only their hashes go: a block still in use
        stays allocated."""
        stale: set[int] = set()
        for req_id in req_ids:
            try:
                blocks = self.manager.get_block_ids(req_id)[0]  # one group: with groups vLLM is told failed requests
            except Exception:  # not known to vLLM's manager (waiting): none of its blocks is cached
                continue
            first = next((i for i, block in enumerate(blocks) if block in invalid), None)
            if first is not None:
                stale.update(blocks[first:])
        if stale:
            self.manager.evict_blocks(stale)
