"""A vLLM 0.32 issue the simulation found (issue 35), outside KVMesh: its prefix cache keys a Mamba block by a
position whose state the block does not hold, and serves it.

Align mode, fine-grained partial hits (hash block h < Mamba block B), a Mamba2 group with a prefill checkpoint
block. A new request R hits m tokens in vLLM's own prefix cache, m not a multiple of B (its Mamba hit is a partial
tail, say m = 40 with B = 16), while the full-attention group hits further, to the next block boundary n (48):

  - `KVCacheManager.get_computed_blocks` sets R's `shared_prefix_boundary` to n (m plus the other group's uncached
    tokens), a junction that sparse retention (vLLM's default `prefix_cache_retention_interval` 0) must keep;
  - the base `add_local_computed_blocks` records the partial tail for copy-on-write and caps R's cached block count
    at its index m // B, so that `cache_blocks` "re-caches the private copy once full" (right for attention, whose
    copy the step fills with tokens m..n); `MambaManager.allocate_new_blocks` puts the copy into that column, and
    the worker copies the state after m into it (`kv_cache_block_copies`);
  - the scheduler does not end R's chunk at n: with the internal prefill checkpoint it neither stops a chunk that
    starts mid-block at the next block boundary, nor (without `enable_mamba_shared_prefix_checkpoint`, EAGLE only)
    at the junction. The step writes only the running state (column cdiv(end, B) - 1) and the checkpoint (column
    cdiv(end, B) - 2); the copy keeps the state after m;
  - `MambaManager.cache_blocks` -> `cache_full_blocks` keys the copy by the n-token hash (`reachable_block_mask`
    keeps the junction's block) and offers it to connectors as the state after n tokens.

A later request sharing R's first n tokens hits n and continues from the state after m: a wrong state, served by
vLLM alone (KVMesh loads nothing there). KVMesh stores a state only where it proves its position from the step
(kv_groups.py), never from vLLM's keys or boundary offers, so it never stores this page as the state after n; what
the wrong request computes from it afterwards is vLLM's wrong output, which no connector can tell from a right one.

`MisKeyAudit` names the issue where it happens, so a schedule that meets it stops with `KnownVllmIssue`, not a
failure of KVMesh: after each step, every block vLLM copied on write in it and keyed, in a state group, by a
request's n-token hash while it holds the oracle's state after fewer tokens of the same sequence; and the first new
request vLLM resumes at n from such a block (still under that key) raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from support.engine import BLOCK


class KnownVllmIssue(AssertionError):
    """vLLM served a request a Mamba block it keyed by a position whose state the block does not hold."""

    def __init__(self, seed: int, kind: str, step: int, detail: str, replay: str) -> None:
        self.seed, self.kind, self.step, self.detail = seed, kind, step, detail
        super().__init__(f"seed {seed} ({kind}), step {step}: vLLM 0.32's Mamba copy-on-write mis-key "
                         f"(tests/support/sim_miskey.py), not KVMesh: {detail}\nreplay: {replay}")


@dataclass(frozen=True)
class MisKeyed:
    block: int
    block_hash: Any  # vLLM's BlockHashWithGroupId
    req_id: str  # the request whose n-token hash it is
    num_tokens: int  # n: the position vLLM keyed it by
    holds: int  # the position whose state it holds (< n)


class MisKeyAudit:
    """The Mamba blocks vLLM keyed by a position whose state they do not hold, and their first use."""

    def __init__(self, scheduler: Any, runners: Sequence[Any], oracle: Any, live: dict[str, Any],
                 hash_block_size: int) -> None:
        self.scheduler = scheduler
        self.runners = runners
        self.oracle = oracle
        self.live = live  # request id -> Live (its vLLM Request and tag)
        self.hash_block_size = hash_block_size
        kind = runners[0].kind
        self.state_layers = [(index, layer.name) for index, layer in enumerate(kind.layers) if layer.has_state]
        self.groups = sorted({runners[0].group_of[name] for _, name in self.state_layers})
        self.miskeyed: dict[int, MisKeyed] = {}

    def _hashes(self, block_id: int) -> list[Any]:
        pool = self.scheduler.kv_cache_manager.block_pool
        block = pool.blocks[block_id]
        found = [block.block_hash] if block.block_hash is not None else []
        return found + list(pool.cached_block_hashes_by_block.get(block_id, ()))

    def _position(self, block_hash: Any) -> tuple[str, int] | None:
        """(request, n) whose n-token prefix hash `block_hash` is, among the live requests."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        plain = get_block_hash(block_hash)
        for req_id, live in self.live.items():
            for i, h in enumerate(live.request.block_hashes):
                if h == plain:
                    return req_id, (i + 1) * self.hash_block_size
        return None

    def after_step(self, output: Any) -> None:
        """After update_from_output (vLLM keyed this step's blocks): record the copies it keyed wrongly."""
        from vllm.v1.core.kv_cache_utils import get_group_id

        for copy in output.kv_cache_block_copies or ():
            block = copy.dst_block_id
            for block_hash in self._hashes(block):
                if get_group_id(block_hash) not in self.groups:
                    continue
                where = self._position(block_hash)
                if where is None:
                    continue
                req_id, n = where
                holds = self._held_position(block, self.live[req_id], n)
                if holds is not None and holds < n:
                    self.miskeyed[block] = MisKeyed(block, block_hash, req_id, n, holds)

    def _held_position(self, block: int, live: Any, n: int) -> int | None:
        """n if the block holds the oracle's state after n tokens of `live`'s sequence in every state layer and
        rank; else the shorter prefix whose state it holds everywhere; else None."""
        expected = self.oracle.expected(live.tag, list(live.request.all_token_ids)[:n])
        pages = [[runner.pages[name].read_state(block) for runner in self.runners] for _, name in self.state_layers]

        def holds(p: int) -> bool:
            return all(page == expected.state_after(index, runner.rank, p)
                       for (index, _), ranks in zip(self.state_layers, pages)
                       for runner, page in zip(self.runners, ranks))

        return next((p for p in range(n, -1, -1) if holds(p)), None)

    def before_forward(self, output: Any) -> str | None:
        """After schedule(): what vLLM did wrong if it resumed a new request from a mis-keyed block; else None."""
        for new in output.scheduled_new_reqs:
            n = new.num_computed_tokens
            if not n:
                continue
            for group in self.groups:
                table = new.block_ids[group]
                column = (n - 1) // BLOCK
                bad = self.miskeyed.get(table[column]) if column < len(table) else None
                if bad is None or bad.num_tokens != n or bad.block_hash not in self._hashes(bad.block):
                    continue
                return (f"request {new.req_id} hit {n} tokens in vLLM's own prefix cache and resumes from Mamba "
                        f"block {bad.block}, which vLLM keyed by the hash of {bad.req_id}'s first {n} tokens but which "
                        f"holds the state after {bad.holds} tokens (the copy-on-write of its partial hit at "
                        f"{bad.holds})")
        return None


__all__ = ["KnownVllmIssue", "MisKeyAudit", "MisKeyed"]
