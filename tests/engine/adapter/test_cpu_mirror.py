"""The scheduler's mirror of a worker's CPU tier, event by event, and the evictions a worker holds until the
mirror saw them (services/engine/adapter/cpu_mirror.py), over a real memory pool and CPU tier."""

from __future__ import annotations

import logging

import pytest

from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents, CpuTierMirror, StepEventLog
from kvmesh.services.engine.tiers.cpu import LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import MemoryPool
from kvmesh.shared import protocol

SLOT = 4096


def put(cpu: LocalCPUBackend, key: bytes) -> None:
    """A chunk whose every byte is its key's first byte."""
    slot = cpu.allocate()
    assert slot is not None
    slot.chunk_buffer(SLOT).view[:] = key[:1] * SLOT
    assert cpu.put(protocol.ChunkMeta(key=key, num_tokens=16, shape=[SLOT], dtype="uint8", fmt="test",
                                      nbytes=SLOT, checksum=1), slot)


def holding_tier(slots: int, hold_slots: int) -> tuple[LocalCPUBackend, StepEventLog]:
    cpu = LocalCPUBackend(MemoryPool(slots * SLOT, SLOT, use_shm=False))
    events = StepEventLog(hold_slots)
    cpu.listen(events)
    cpu.hold_evictions(events)
    return cpu, events


def test_events_are_numbered_and_the_mirror_counts_what_it_applied_in_order() -> None:
    log = StepEventLog()
    log.admit(b"a")
    log.admit(b"b")
    log.evict(b"a")
    first, events = log.take_numbered()
    assert (first, events) == (1, [(True, b"a"), (True, b"b"), (False, b"a")])
    mirror = CpuTierMirror()
    mirror.apply(CpuTierEvents({0: events}, {0: first}))
    assert mirror.seen(0) == 3 and mirror.prefix(0, [b"b", b"a"]) == 1
    log.admit(b"c")
    first, events = log.take_numbered()
    mirror.apply(CpuTierEvents({0: events}, {0: first}))
    assert (first, mirror.seen(0), mirror.seen(1)) == (4, 4, 0)


@pytest.mark.parametrize("first", [None, 3, 1], ids=["unnumbered", "a-gap", "a-replay"])
def test_events_out_of_order_leave_the_rank_untrusted_for_good(first: int | None,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A step's output vLLM never delivered (a gap), events applied twice or not numbered: the mirror cannot
    tell what the worker holds to the event, so nothing is promised from that rank again (one WARNING)."""
    mirror = CpuTierMirror()
    mirror.apply(CpuTierEvents({0: [(True, b"a")], 1: [(True, b"a")]}, {0: 1, 1: 1}))
    with caplog.at_level(logging.WARNING, logger="kvmesh.services.engine.adapter.cpu_mirror"):
        mirror.apply(CpuTierEvents({0: [(True, b"b")]}, {} if first is None else {0: first}))
        mirror.apply(CpuTierEvents({0: [(True, b"c")]}, {0: 3}))
    assert mirror.seen(0) is None and mirror.seen(1) == 1
    assert mirror.prefix(0, [b"a", b"b", b"c"]) == 3  # the keys still count for lookups (a plain load may fail)
    assert len([r for r in caplog.records if "out of order" in r.getMessage()]) == 1


def test_ranks_aggregate_with_their_numbers_and_a_break_in_one_rank_is_kept() -> None:
    merged = CpuTierEvents({0: [(True, b"a")]}, {0: 1}).aggregate(CpuTierEvents({1: [(True, b"x")]}, {1: 7}))
    assert merged.first == {0: 1, 1: 7}
    merged.aggregate(CpuTierEvents({0: [(False, b"a")]}, {0: 2}))  # consecutive: still numbered
    assert merged.first == {0: 1, 1: 7} and merged.events[0] == [(True, b"a"), (False, b"a")]
    merged.aggregate(CpuTierEvents({1: [(True, b"y")]}, {1: 9}))  # 8 is missing
    assert merged.first == {0: 1}


def test_an_evicted_chunk_is_held_readable_until_the_scheduler_saw_its_eviction() -> None:
    cpu, events = holding_tier(slots=4, hold_slots=2)
    put(cpu, b"a-key")
    put(cpu, b"b-key")
    assert cpu.remove(b"a-key")  # event 3
    assert b"a-key" not in cpu and events.held_count() == 1 and cpu.pool.num_free == 2
    ref = cpu.acquire(b"a-key")
    assert ref is not None and bytes(ref.slot.chunk_buffer(SLOT).view) == b"a" * SLOT
    ref.release()
    assert events.seen(2) == 0  # the scheduler saw only the admissions
    again = cpu.acquire(b"a-key")
    assert again is not None
    again.release()
    assert events.seen(3) == 1 and cpu.acquire(b"a-key") is None
    assert cpu.pool.num_free == 3, "the slot went back once the acquired reference was released"


def test_a_chunk_admitted_again_after_its_eviction_is_read_from_the_tier() -> None:
    cpu, events = holding_tier(slots=4, hold_slots=2)
    put(cpu, b"a-key")
    cpu.remove(b"a-key")
    put(cpu, b"a-new")
    assert cpu.remove(b"a-new")
    slot = cpu.allocate()
    assert slot is not None
    slot.chunk_buffer(SLOT).view[:] = b"z" * SLOT
    assert cpu.put(protocol.ChunkMeta(key=b"a-key", num_tokens=16, shape=[SLOT], dtype="uint8", fmt="test",
                                      nbytes=SLOT, checksum=1), slot)
    ref = cpu.acquire(b"a-key")
    assert ref is not None and bytes(ref.slot.chunk_buffer(1).view) == b"z"
    ref.release()
    assert events.seen(None) == 2 and cpu.pool.num_free == 3


def test_evicting_to_make_room_stops_at_the_hold_and_resumes_once_the_scheduler_saw_it() -> None:
    """A full pool: each eviction is held, so evicting frees no slot until the scheduler saw it; the tier
    evicts at most `hold_slots` chunks for it (the save that wanted the slot is dropped) instead of emptying."""
    cpu, events = holding_tier(slots=6, hold_slots=2)
    for i in range(6):
        put(cpu, bytes([i]) + b"-key")
    assert cpu.allocate() is None
    assert len(cpu) == 4 and events.held_count() == 2 and cpu.evictions == 2
    first, taken = events.take_numbered()
    assert taken[-2:] == [(False, b"\x00-key"), (False, b"\x01-key")]
    assert events.seen(first + len(taken) - 1) == 2
    slot = cpu.allocate()
    assert slot is not None and len(cpu) == 4
    slot.release()


def test_a_clear_holds_what_it_removed_and_closing_releases_everything() -> None:
    cpu, events = holding_tier(slots=4, hold_slots=1)
    for i in range(3):
        put(cpu, bytes([i]) + b"-key")
    assert cpu.clear_all() == 48 and len(cpu) == 0
    assert events.held_count() == 3 and cpu.pool.num_free == 1  # a clear is not bounded by the hold
    assert cpu.acquire(b"\x02-key") is not None  # (its reference is left held: close releases the tier's)
    cpu.close()
    assert events.held_count() == 0 and cpu.pool.num_free == 3


def test_a_tier_that_only_stages_holds_nothing() -> None:
    cpu = LocalCPUBackend(MemoryPool(2 * SLOT, SLOT, use_shm=False), keep=False)
    events = StepEventLog(hold_slots=2)
    cpu.hold_evictions(events)
    put(cpu, b"a-key")
    cpu.remove(b"a-key")
    assert events.held_count() == 0 and cpu.pool.num_free == 2
