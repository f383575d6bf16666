"""Issue 35's finding 2, as far as the CPU can show it: blocks a step's saves read that vLLM hands out again in
the next step (to another request, or to the same one as a fresh block), while the request that saved them runs.

vLLM frees a running request's blocks without request_finished or a preemption: the blocks that leave a sliding
window, and align-mode Mamba state blocks it retires (KV cache manager, `remove_skipped_blocks`, at the next
schedule). The next step may allocate them to another request and write them (its forward, a zeroing, a
copy-on-write). On the CPU a save has read its blocks when wait_for_save returns, so nothing goes wrong here; on
CUDA the save's gather runs on a side stream after wait_for_save, and handle_preemptions orders only preempted
requests' gathers before the next forward: this interleaving is when the next forward may overwrite a block
before the gather has read it. `ReuseAudit` records each occurrence (a schedule that shows it replays on a GPU).
"""

from __future__ import annotations

from typing import Any

from support.engine import BLOCK


class ReuseAudit:
    """Blocks read by the last step's saves, and the next step's writers of them."""

    def __init__(self) -> None:
        self._read: dict[int, tuple[str, int]] = {}  # (group, block) flattened as group * 1_000_000 + block
        self.events: list[str] = []

    @staticmethod
    def _key(group: int, block: int) -> int:
        return group * 1_000_000 + block

    def saves(self, metadata: Any) -> None:
        """The blocks this step's saves read (every group's blocks of the saved tokens, and the state blocks)."""
        self._read = {}
        for req in getattr(metadata, "requests", ()):
            save = req.save
            if save is None:
                continue
            tables = req.group_block_ids if req.group_block_ids is not None else [req.block_ids]
            ends = [save.end, save.prefix_end]
            for group, table in enumerate(tables):
                for index in range(save.mask_start // BLOCK, -(-max(ends) // BLOCK)):
                    if index < len(table) and table[index] >= 0:
                        self._read[self._key(group, table[index])] = (req.req_id, index)

    def next_step(self, output: Any, step: int) -> None:
        """The blocks the next step gives to requests: a saved block another request gets while its saver still
        runs is the interleaving of finding 2."""
        gone = set(output.finished_req_ids) | set(output.preempted_req_ids or ())
        handed: list[tuple[str, int, int]] = []  # (request, group, block) of fresh blocks, which it will write

        def fresh(req_id: str, tables: Any, computed: int) -> None:  # past a prefix hit's shared blocks
            handed.extend((req_id, g, b) for g, ids in enumerate(tables) for b in ids[computed // BLOCK:])

        for new in output.scheduled_new_reqs:
            fresh(new.req_id, new.block_ids, new.num_computed_tokens)
        cached = output.scheduled_cached_reqs
        for req_id, ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            fresh(req_id, ids or (), computed if req_id in cached.resumed_req_ids else 0)
        for req_id, group, block in handed:
            saver = self._read.get(self._key(group, block))
            if saver is not None and saver[0] not in gone:  # (the saver itself too: a fresh block of its own)
                self.events.append(f"step {step}: block {block} (group {group}), read by the last step's save of "
                                   f"{saver[0]} (its logical block {saver[1]}), is given to {req_id} while "
                                   f"{saver[0]} still runs")


__all__ = ["ReuseAudit"]
