"""What a failed load leaves wrong in its step (services/engine/adapter/request_load.py `LoadFailures`).

vLLM's prefix cache caches a block as soon as a step schedules it, so a request of the same step can count as
computed a block another request is about to fill over the KV a load failed to bring. vLLM rewinds a request only
for block errors in its computed prefix: every block computed over a failed load must be one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("kvmesh.services.engine.connector")

from kvmesh.services.engine.adapter.request_load import LoadFailures
from kvmesh.services.engine.adapter.request_meta import LoadSpec, ReqMeta

B = 16


def request(req_id: str, block_ids: list[int], load: LoadSpec | None = None) -> ReqMeta:
    return ReqMeta(req_id=req_id, chunk_keys=[], block_ids=block_ids, load=load)


def test_blocks_computed_over_a_failed_load_and_their_sharers_later_blocks_are_load_errors() -> None:
    failures = LoadFailures()
    # r1 loads tokens [16, 32) into block 5 and computes [32, 77) into 6, 7, 8 over it; r2 took r1's block 6
    # from the prefix cache (its tokens [32, 48)) and computes into 9, 10; r3 shares nothing that went wrong
    r1 = request("r1", [1, 5, 6, 7, 8], LoadSpec(end=32, need=32, mask_start=0, skip_prefix=16))
    r2 = request("r2", [1, 2, 6, 9, 10])
    r3 = request("r3", [1, 2, 3, 4])
    assert failures.record(r1, 16, B) == {5}

    failures.cut_sharers([r1, r2, r3], B)

    assert failures.take_block_errors() == {5, 6, 7, 8, 9, 10}
    assert failures.save_limit(r1) == 16 and failures.save_limit(r2) == 32 and failures.save_limit(r3) is None


def test_a_step_without_a_failed_load_reports_no_block() -> None:
    failures = LoadFailures()
    failures.cut_sharers([request("r1", [1, 2, 3])], B)
    assert failures.take_block_errors() == set()


def test_this_steps_errors_bound_the_saves_of_a_request_the_scheduler_knew_had_failed() -> None:
    # r2's earlier failure is known to the scheduler (load_failed: it plans r2's saves from vLLM's recompute), but
    # this step's errors came after that plan: blocks r1's failed load left wrong and r1 never recomputed
    failures = LoadFailures()
    r2 = ReqMeta(req_id="r2", chunk_keys=[], block_ids=[1, 2, 6], load_failed=True)
    failures.still_wrong({6})
    failures.cut_sharers([r2], B)
    assert failures.save_limit(r2) == 32
    assert failures.take_block_errors() == {6}
    assert failures.save_limit(r2) is None  # the next step's plan knows
