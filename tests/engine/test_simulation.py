"""Seeded simulations of vLLM driving the connector (tests/support/sim_harness.py), a fixed set of seeds for CI.

Each seed is a whole schedule (requests that share, extend and diverge, chunked prefill, preemption, aborts,
decode, evictions between lookup and load, TP ranks that diverge and whose KV depends on each other's; some
with NATS and a disk store process, paused, killed or cut off) checked after every step against the KV oracle. A failure names its seed and
replays with `python tests/engine/fuzz.py --seed N` (`--no-processes` for the CPU-only seeds). `make fuzz` runs new
random seeds.
"""

from __future__ import annotations

import logging
from typing import Iterator

import pytest

pytest.importorskip("kvmesh.services.engine.connector")
from support.sim_harness import SimConfig, SimFailure, run_seed  # noqa: E402

# CPU tiers only (no processes): fast, the bulk of the schedules
CPU_SEEDS = [1, 2, 4, 5, 7, 8, 9, 10, 11, 12, 13, 15, 16, 17]
# with NATS and a real disk store process (and, per seed, chunk files deleted, CPU tiers emptied, the store
# paused (2, 21), killed (15), NATS stopped (12)); 36 found finding 1 before its fix
DISK_SEEDS = [2, 12, 15, 16, 21, 36]
# seeds that found findings on d1dcce4 (before their fixes, b5db6f2 / 7705a38): finding 1 (a failed load's
# blocks saved by the same step's wait_for_save)
FOUND_SEEDS = [0, 3, 6, 14]
# two ranks, one of which lost a chunk of a hit between lookup and load, so every rank's forward after it computed
# over that rank's wrong KV. Without the connector's load agreement (`python tests/engine/fuzz.py --seed N
# --no-agreement`) the rank whose own load succeeded stored its shard of the chunk computed next (invariant 2):
#   18: step 4, rank 1 lost chunk 0 of r2's hit; rank 0 stored tokens [32, 64) wrong
#   57: step 5, rank 0 lost chunk 0 of r1's hit; rank 1 stored tokens [64, 96) wrong
#   28: layer-wise loads; step 50, rank 1 lost chunk 0 of r5's hit; rank 0 stored tokens [32, 64) wrong
CROSS_RANK_SEEDS = [18, 28, 57]


@pytest.fixture(autouse=True)
def quiet_engines() -> Iterator[None]:
    # the engines warn about every injected fault (load errors, evictions): expected here
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_a_seeded_schedule_on_the_cpu_tiers_never_serves_or_stores_wrong_kv(seed: int) -> None:
    run_seed(seed, allow_processes=False)


@pytest.mark.parametrize("seed", DISK_SEEDS)
def test_a_seeded_schedule_with_a_disk_store_never_serves_or_stores_wrong_kv(seed: int) -> None:
    assert SimConfig.draw(seed).disk
    run_seed(seed)


@pytest.mark.parametrize("seed", FOUND_SEEDS)
def test_the_seeds_that_found_wrong_kv_before_its_fix(seed: int) -> None:
    run_seed(seed, allow_processes=False)


@pytest.mark.parametrize("seed", CROSS_RANK_SEEDS)
def test_a_load_that_failed_on_one_rank_is_stored_by_no_rank(seed: int) -> None:
    result = run_seed(seed, allow_processes=False)
    assert result.agreements  # the ranks met in the connector's agreement


def test_the_simulation_sees_a_rank_store_kv_computed_over_another_ranks_failed_load() -> None:
    # the harness's side of the cross-rank seeds: without the agreement it must catch the wrong chunk, or the
    # seeds above would pass for nothing
    with pytest.raises(SimFailure) as failure:
        run_seed(CROSS_RANK_SEEDS[0], allow_processes=False, agreement=False)
    assert failure.value.invariant == 2 and "rank 0's CPU tier" in failure.value.detail
