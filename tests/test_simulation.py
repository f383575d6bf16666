"""Seeded simulations of vLLM driving the connector (tests/sim_harness.py), a fixed set of seeds for CI.

Each seed is a whole schedule (requests that share, extend and diverge, chunked prefill, preemption, aborts,
decode, evictions between lookup and load, TP ranks that diverge; some with NATS and a disk store process,
paused, killed or cut off) checked after every step against the KV oracle. A failure names its seed and
replays with `python tests/fuzz.py --seed N` (`--no-processes` for the CPU-only seeds). `make fuzz` runs new
random seeds.
"""

from __future__ import annotations

import logging
from typing import Iterator

import pytest

pytest.importorskip("kvmesh.services.engine.connector")
from sim_harness import SimConfig, run_seed  # noqa: E402

# CPU tiers only (no processes): fast, the bulk of the schedules
CPU_SEEDS = [1, 2, 4, 5, 7, 8, 9, 10, 11, 12, 13, 15, 16, 17]
# with NATS and a real disk store process (and, per seed, chunk files deleted, CPU tiers emptied, the store
# paused (2, 21), killed (15), NATS stopped (12)); 36 found finding 1 before its fix
DISK_SEEDS = [2, 12, 15, 16, 21, 36]
# seeds that found findings on d1dcce4 (before their fixes, b5db6f2 / 7705a38): finding 1 (a failed load's
# blocks saved by the same step's wait_for_save)
FOUND_SEEDS = [0, 3, 6, 14]


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
