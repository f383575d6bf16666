"""The cache engine without NATS: store/retrieve bit-exactness, masks, lookup prefixes, LRU, pins, a tiny pool."""

from __future__ import annotations

import time

import pytest
import torch

from kvmesh.services.engine.assembly import build_engine, engine_for_caches
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.tiers.base import NO_RETENTION, Retention
from kvmesh.shared.eviction import POLICY_NAMES, Clock
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK
from kvmesh.shared.wire.keys import KeyParams

from support.engine import BLOCK, CHUNK, PagedKV, engine_config, random_tokens
from support.waiting import ManualClock, finishes

PARAMS = KeyParams(model="test-model", kv_format="")


def make_engine(kv: PagedKV, clock: Clock = time.monotonic, **overrides: object) -> CacheEngine:
    return build_engine(engine_config(**overrides), PARAMS, kv.layout, use_mesh=False, clock=clock)


@pytest.fixture
def kv() -> PagedKV:
    return PagedKV()


@pytest.mark.parametrize("num_tokens", [32, 100, 127, 160, 5])
def test_store_then_retrieve_is_bit_exact(kv: PagedKV, num_tokens: int) -> None:
    with make_engine(kv) as engine:
        tokens = random_tokens(num_tokens, seed=num_tokens)
        src = kv.slots(num_tokens)
        expected = kv.token_kv(src)
        token_api.store(engine, tokens, **kv.kv(src))
        assert token_api.lookup(engine, tokens) == num_tokens  # the partial last chunk counts (save_unfull_chunk)
        dst = kv.slots(num_tokens, exclude=src)
        before_other = kv.buffer.clone()
        got = token_api.retrieve(engine, tokens, **kv.kv(dst))
        assert got.dtype == torch.bool and got.shape == (num_tokens,) and bool(got.all())
        assert torch.equal(kv.token_kv(dst), expected)
        # nothing outside the destination blocks changed
        touched = set((dst // kv.block_size).tolist())
        for block in range(kv.num_blocks):
            if block not in touched:
                assert torch.equal(kv.buffer[:, block], before_other[:, block])


def test_retrieve_unknown_tokens_is_a_miss(kv: PagedKV) -> None:
    with make_engine(kv) as engine:
        tokens = random_tokens(64, seed=1)
        got = token_api.retrieve(engine, tokens, **kv.kv(kv.slots(64)))
        assert not bool(got.any())
        assert token_api.lookup(engine, tokens) == 0


def test_masks_follow_seed_003(kv: PagedKV) -> None:
    with make_engine(kv) as engine:
        tokens = random_tokens(128, seed=2)
        src = kv.slots(128)
        expected = kv.token_kv(src)
        mask = torch.ones(128, dtype=torch.bool)
        mask[:CHUNK] = False
        token_api.store(engine, tokens, mask, **kv.kv(src))
        assert token_api.lookup(engine, tokens) == 0  # chunk 0 was masked out, so there is no cached prefix
        token_api.store(engine, tokens, **kv.kv(src))  # now the whole sequence (chunks 1.. are not copied again)
        assert token_api.lookup(engine, tokens) == 128

        dst = kv.slots(128, exclude=src)
        mask2 = torch.ones(128, dtype=torch.bool)
        mask2[:2 * CHUNK] = False
        got = token_api.retrieve(engine, tokens, mask2, **kv.kv(dst))
        assert not bool(got[:2 * CHUNK].any()) and bool(got[2 * CHUNK:].all())
        assert torch.equal(kv.token_kv(dst[2 * CHUNK:]), expected[:, :, 2 * CHUNK:])

        bad = torch.ones(128, dtype=torch.bool)
        bad[:10] = False  # not a multiple of chunk_size
        with pytest.raises(ValueError, match="multiple of chunk_size"):
            token_api.store(engine, tokens, bad, **kv.kv(src))
        with pytest.raises(ValueError, match="prefix"):
            token_api.retrieve(engine, tokens, torch.tensor([True, False] * 64), **kv.kv(dst))


def test_skip_prefix_leaves_tokens_vllm_holds(kv: PagedKV) -> None:
    with make_engine(kv) as engine:
        tokens = random_tokens(96, seed=3)
        src = kv.slots(96)
        expected = kv.token_kv(src)
        token_api.store(engine, tokens, **kv.kv(src))
        dst = kv.slots(96, exclude=src)
        kv.buffer.view(-1)[:] = 0  # wipe everything; the skipped tokens must stay zero
        got = token_api.retrieve(engine, tokens, **kv.kv(dst), skip_prefix=40)  # inside a block and inside chunk 1
        assert bool(got.all())
        loaded = kv.token_kv(dst)
        assert torch.equal(loaded[:, :, 40:], expected[:, :, 40:])
        assert not bool(loaded[:, :, :40].any())


def test_lookup_is_the_contiguous_prefix(kv: PagedKV) -> None:
    with make_engine(kv) as engine:
        tokens = random_tokens(160, seed=4)
        src = kv.slots(160)
        token_api.store(engine, tokens, **kv.kv(src))
        assert token_api.lookup(engine, tokens) == 160
        assert token_api.lookup(engine, tokens[:70]) == 64  # only whole stored chunks of this shorter prefix
        assert token_api.lookup(engine, tokens, search_range=["Hot"]) == 160
        assert token_api.lookup(engine, tokens, search_range=[LOCAL_DISK]) == 0
        keys = engine.hasher.keys(tokens)
        assert engine.cpu.remove(keys[2])
        assert token_api.lookup(engine, tokens) == 2 * CHUNK  # chunks 3 and 4 are held but not part of the prefix
        got = token_api.retrieve(engine, tokens, **kv.kv(kv.slots(160, exclude=src)))
        assert int(got.sum()) == 2 * CHUNK and bool(got[:2 * CHUNK].all())
        with pytest.raises(ValueError, match="unknown location"):
            token_api.lookup(engine, tokens, search_range=["Nowhere"])


def test_a_chunk_already_held_is_not_copied_again(kv: PagedKV, monkeypatch: pytest.MonkeyPatch) -> None:
    with make_engine(kv) as engine:
        gathers = []
        original = engine.copier.gather
        monkeypatch.setattr(engine.copier, "gather", lambda *a, **k: (gathers.append(1), original(*a, **k)))
        tokens = random_tokens(128, seed=5)
        src = kv.slots(128)
        token_api.store(engine, tokens, **kv.kv(src))
        assert len(gathers) == 4
        token_api.store(engine, tokens, **kv.kv(src))
        token_api.store(engine, tokens[:64], **kv.kv(src[:64]))
        assert len(gathers) == 4


def test_save_unfull_chunk_false_drops_the_tail(kv: PagedKV) -> None:
    with make_engine(kv, save_unfull_chunk=False) as engine:
        tokens = random_tokens(100, seed=6)
        token_api.store(engine, tokens, **kv.kv(kv.slots(100)))
        assert token_api.lookup(engine, tokens) == 96
        got = token_api.retrieve(engine, tokens, **kv.kv(kv.slots(100)))
        assert int(got.sum()) == 96


def test_negative_slots_are_not_stored(kv: PagedKV) -> None:
    with make_engine(kv) as engine:
        tokens = random_tokens(128, seed=7)
        src = kv.slots(128)
        src[70:] = -1  # vLLM has no slot for these tokens
        token_api.store(engine, tokens, **kv.kv(src))
        assert token_api.lookup(engine, tokens) == 64


def test_lru_evicts_oldest_and_spares_pins(kv: PagedKV) -> None:
    with make_engine(kv, cpu_chunks=4) as engine:
        a, b, c = (random_tokens(64, seed=s) for s in (10, 11, 12))
        token_api.store(engine, a, **kv.kv(kv.slots(64)))
        token_api.store(engine, b, **kv.kv(kv.slots(64)))
        assert token_api.pin(engine, a) == 64
        token_api.store(engine, c, **kv.kv(kv.slots(64)))  # pool full: b (oldest unpinned) goes, pinned a stays
        assert [token_api.lookup(engine, t) for t in (a, c, b)] == [64, 64, 0]

        # recency: reading c makes ... c most recent; storing b again evicts nothing pinned
        assert token_api.unpin(engine, a) == 64
        token_api.retrieve(engine, a, **kv.kv(kv.slots(64)))  # a is now the most recently used
        token_api.store(engine, b, **kv.kv(kv.slots(64)))  # evicts c, the least recently used
        assert [token_api.lookup(engine, t) for t in (a, b, c)] == [64, 64, 0]

        assert token_api.pin(engine, b) == 64
        assert token_api.clear(engine, LOCAL_CPU) == 128  # the instance's own CPU tier: a and pinned b both go
        assert token_api.lookup(engine, a) == 0 and token_api.lookup(engine, b) == 0
        assert token_api.pin(engine, random_tokens(64, seed=99)) == 0  # nothing held: nothing pinned


def test_pin_ttl_expires(kv: PagedKV) -> None:
    clock = ManualClock()
    with make_engine(kv, clock, cpu_chunks=2) as engine:
        a, b = random_tokens(64, seed=20), random_tokens(64, seed=21)
        token_api.store(engine, a, **kv.kv(kv.slots(64)))
        assert token_api.pin(engine, a, ttl_secs=60) == 64
        token_api.store(engine, b, **kv.kv(kv.slots(64)))
        assert token_api.lookup(engine, b) == 0 and token_api.lookup(engine, a) == 64  # pinned: b could not get in
        clock.advance(59)
        token_api.store(engine, b, **kv.kv(kv.slots(64)))
        assert token_api.lookup(engine, b) == 0 and token_api.lookup(engine, a) == 64  # still pinned
        clock.advance(2)  # past the TTL
        token_api.store(engine, b, **kv.kv(kv.slots(64)))
        assert token_api.lookup(engine, b) == 64 and token_api.lookup(engine, a) == 0


def test_a_tiny_pool_never_deadlocks(kv: PagedKV) -> None:
    with make_engine(kv, cpu_chunks=2) as engine:
        a = random_tokens(64, seed=30)
        src = kv.slots(64)
        token_api.store(engine, a, **kv.kv(src))
        assert token_api.pin(engine, a) == 64
        long = random_tokens(160, seed=31)
        # no free slot and nothing evictable: skipped at once (a store that waited for a slot would never return)
        finishes(lambda: token_api.store(engine, long, **kv.kv(kv.slots(160))), what="a store into a full, pinned pool")
        assert token_api.lookup(engine, long) == 0
        token_api.unpin(engine, a)
        token_api.store(engine, long, **kv.kv(kv.slots(160)))  # only two chunks fit: the rest is skipped
        assert token_api.lookup(engine, long) == 2 * CHUNK

        # a retrieve holding chunks while the tier is full still finishes, with a shorter hit
        got = token_api.retrieve(engine, long, **kv.kv(kv.slots(160)))
        assert int(got.sum()) == 2 * CHUNK

    with make_engine(kv, cpu_chunks=0) as engine:  # not even one chunk fits
        token_api.store(engine, a, **kv.kv(src))
        assert token_api.lookup(engine, a) == 0
        assert not bool(token_api.retrieve(engine, a, **kv.kv(src)).any())


def test_refcounts_keep_bytes_being_read(kv: PagedKV) -> None:
    with make_engine(kv, cpu_chunks=2) as engine:
        a, b = random_tokens(32, seed=40), random_tokens(64, seed=41)
        src = kv.slots(32)
        expected = kv.token_kv(src)
        token_api.store(engine, a, **kv.kv(src))
        ref = engine.cpu.acquire(engine.hasher.keys(a)[0])  # a reader holds chunk a
        assert ref is not None
        assert token_api.clear(engine) == 32  # a leaves the tier ...
        token_api.store(engine, b, **kv.kv(kv.slots(64)))  # needs both slots: a's is still read, so only one chunk fits
        assert token_api.lookup(engine, b) == CHUNK and token_api.lookup(engine, a) == 0
        chunk = ref.slot.view(kv.layout.dtype, kv.layout.chunk_shape(32))
        from kvmesh.services.engine.core.paged_torch import scatter
        dst = kv.slots(32, exclude=src)
        scatter(chunk, kv.caches, kv.layout, dst)
        assert torch.equal(kv.token_kv(dst), expected)  # ... but its bytes survived until released
        ref.release()
        assert engine.pool.num_free == 1


def test_local_cpu_false_without_lower_tiers_stores_nothing(kv: PagedKV) -> None:
    with make_engine(kv, local_cpu=False) as engine:
        tokens = random_tokens(64, seed=50)
        token_api.store(engine, tokens, **kv.kv(kv.slots(64)))
        assert token_api.lookup(engine, tokens) == 0


def test_closed_engine_refuses_calls(kv: PagedKV) -> None:
    engine = make_engine(kv)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        token_api.lookup(engine, random_tokens(32, seed=0))


def test_an_engine_for_vllms_caches_takes_their_layout(kv: PagedKV) -> None:
    engine = engine_for_caches(engine_config(), PARAMS, kv.caches, kv.block_size, "CPU_ATTN", cpu_isa="vec",
                               use_mesh=False)
    try:
        layout = engine.layout
        assert layout.per_block and engine.key_params.kv_format == layout.chunk_format()
        tokens = random_tokens(64, seed=60)
        token_api.store(engine, tokens, **kv.kv(kv.slots(64)))
        assert token_api.lookup(engine, tokens) == 64
    finally:
        engine.close()


def test_the_pool_is_reserved_for_real_and_a_pool_memory_cannot_back_is_a_clean_refusal(
        kv: PagedKV, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import errno
    import os

    from kvmesh.services.engine.tiers.memory_pool import MemoryPool

    reserved: list[tuple[int, int]] = []
    fallocate = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, size: (reserved.append((offset, size)),
                                                                        fallocate(fd, offset, size)))
    pool = MemoryPool(4 * 8192, 8192)
    try:
        assert reserved == [(0, 4 * 8192)] and pool.num_free == 4
    finally:
        pool.close()

    def no_memory(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_memory)
    with caplog.at_level("ERROR"), make_engine(kv) as engine:  # serves, caches nothing, says why
        assert engine.pool.num_slots == 0
        tokens = random_tokens(2 * CHUNK, seed=63)
        token_api.store(engine, tokens, **kv.kv(kv.slots(2 * CHUNK)))
        assert token_api.lookup(engine, tokens) == 0
    assert any("does not fit" in r.getMessage() and "max_local_cpu_size" in r.getMessage() for r in caplog.records)


def test_pool_is_a_sealed_memfd_that_leaves_nothing_in_dev_shm() -> None:
    import fcntl
    import os

    from kvmesh.services.engine.tiers.memory_pool import MemoryPool

    before = set(os.listdir("/dev/shm"))
    pool = MemoryPool(4 * 8192, 8192)
    try:
        segment = pool.segment
        assert segment is not None and segment.fd is not None and segment.size == 4 * 8192
        assert set(os.listdir("/dev/shm")) == before  # no name anywhere: nothing to leave behind after a crash
        seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(segment.fd, 0)  # nobody can shrink it under a store that maps it
        slot = pool.allocate()
        assert slot is not None and pool.num_free == 3
        buffer = slot.chunk_buffer(100)
        assert buffer.pool is segment and buffer.pool_offset == slot.offset and len(buffer.view) == 100
        buffer.view[:4] = b"kvkv"
        assert bytes(segment.buf[slot.offset:slot.offset + 4]) == b"kvkv"
        del buffer
        slot.ref()
        slot.release()
        slot.release()
        assert pool.num_free == 4
        with pytest.raises(RuntimeError, match="released more often"):
            slot.release()
    finally:
        pool.close()
    assert pool.segment is None and segment.fd is None

    plain = MemoryPool(2 * 8192, 8192, use_shm=False)
    try:
        assert plain.segment is None and plain.num_slots == 2
        assert plain.allocate().chunk_buffer().pool is None
    finally:
        plain.close()


# ---- error paths: pool slots go back only after the copies queued on them (checked on CPU, where the wait is the
# same call that synchronises the CUDA stream on a GPU) ---------------------------------------------------------
def _record_waits_and_releases(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from kvmesh.services.engine.core import chunk_load
    from kvmesh.services.engine.tiers import memory_pool

    events: list[str] = []
    wait, release = chunk_load.synchronize, memory_pool.Slot.release
    monkeypatch.setattr(chunk_load, "synchronize", lambda caches: (events.append("wait"), wait(caches)))
    monkeypatch.setattr(memory_pool.Slot, "release", lambda slot: (events.append("release"), release(slot)))
    return events


def _fail_on_call(monkeypatch: pytest.MonkeyPatch, copier: object, name: str, failing_call: int) -> None:
    original, calls = getattr(copier, name), []

    def copy(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == failing_call:
            raise torch.cuda.OutOfMemoryError("injected: out of memory mid-copy")
        original(*args, **kwargs)

    monkeypatch.setattr(copier, name, copy)


def _fail_after_first_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's chunks are scattered together (paged_torch.scatter_chunks): the first one's copies are queued,
    then the copy fails."""
    from kvmesh.services.engine.core import paged_torch

    write = paged_torch._write_blocks

    def fail(chunks: list, caches: list[torch.Tensor], layout: object, layers: range | None = None) -> None:
        write(chunks[:1], caches, layout, layers)
        raise torch.cuda.OutOfMemoryError("injected: out of memory mid-copy")

    monkeypatch.setattr(paged_torch, "_write_blocks", fail)


def test_a_store_failing_mid_way_waits_for_its_copies_before_the_slots_go_back(
        kv: PagedKV, monkeypatch: pytest.MonkeyPatch) -> None:
    with make_engine(kv) as engine:
        free_before = engine.pool.num_free
        _fail_on_call(monkeypatch, engine.copier, "gather", failing_call=3)  # two gathers queued, then a failure
        events = _record_waits_and_releases(monkeypatch)
        tokens = random_tokens(4 * CHUNK, seed=60)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            token_api.store(engine, tokens, **kv.kv(kv.slots(4 * CHUNK)))
        # three slots were taken (the third's gather failed): all go back, and only after the wait
        assert events == ["wait", "release", "release", "release"]
        assert engine.pool.num_free == free_before and token_api.lookup(engine, tokens) == 0


def test_a_retrieve_failing_mid_way_waits_for_its_copies_before_the_chunks_go_back(
        kv: PagedKV, monkeypatch: pytest.MonkeyPatch) -> None:
    with make_engine(kv) as engine:
        tokens = random_tokens(4 * CHUNK, seed=61)
        token_api.store(engine, tokens, **kv.kv(kv.slots(4 * CHUNK)))
        _fail_after_first_chunk(monkeypatch)
        events = _record_waits_and_releases(monkeypatch)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            token_api.retrieve(engine, tokens, **kv.kv(kv.slots(4 * CHUNK)))
        # every reference the retrieve took goes back (the tier keeps its own), after the wait
        assert events[0] == "wait" and events[1:] == ["release"] * 4
        assert token_api.lookup(engine, tokens) == 4 * CHUNK


def test_slots_stay_allocated_when_even_the_wait_fails(kv: PagedKV, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmesh.services.engine.core import chunk_load

    with make_engine(kv) as engine:
        free_before = engine.pool.num_free
        _fail_on_call(monkeypatch, engine.copier, "gather", failing_call=2)

        def broken_stream(caches: object) -> None:
            raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(chunk_load, "synchronize", broken_stream)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            token_api.store(engine, random_tokens(2 * CHUNK, seed=62), **kv.kv(kv.slots(2 * CHUNK)))
        assert engine.pool.num_free == free_before - 2, "slots a copy may still write stay out of the pool"


# The tests' own paged KV (support/engine.py): slot mappings shaped like vLLM's block tables.
def test_slot_mappings_are_block_structured() -> None:
    kv = PagedKV()
    slots = kv.slots(70)
    assert slots.numel() == 70 and len(set(slots.tolist())) == 70
    assert torch.equal(slots[::BLOCK] % BLOCK, torch.zeros(5, dtype=torch.int64))
    other = kv.slots(70, exclude=slots)
    assert not set(other.tolist()) & set(slots.tolist())


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_leased_saves_outlive_unleased_ones_within_the_retained_share(kv: PagedKV, policy: str) -> None:
    """A request's lease (tiers/base.py `Retention`) keeps its chunks in the CPU tier over unleased ones under
    every policy, until the lease ends; together leased chunks hold at most `retained_cpu_share` of the tier
    (4 of 8 chunks here), past which a chunk is held as any other."""
    clock = ManualClock()
    with make_engine(kv, clock, cpu_chunks=8, cache_policy=policy, retained_cpu_share=0.5) as engine:
        hasher, cpu = engine.ready()[1], engine.ready()[2]

        def save(tokens: torch.Tensor, retention: Retention = NO_RETENTION) -> None:
            engine.save(hasher.spans(tokens), **kv.kv(kv.slots(len(tokens))), retention=retention)

        leased, leased2 = random_tokens(3 * CHUNK, seed=30), random_tokens(2 * CHUNK, seed=31)
        save(leased, Retention(lease_until=time.time() + 3600))
        save(leased2, Retention(priority=2))  # its second chunk would pass the share: held as any other
        assert cpu.retain_refused == 1
        for seed in range(40, 48):  # 16 unleased chunks through a tier of 8
            save(random_tokens(2 * CHUNK, seed=seed))
        assert token_api.lookup(engine, leased) == 3 * CHUNK
        # its retained first chunk; MRU takes the newest chunks first, so its second, older one stays too
        assert token_api.lookup(engine, leased2) == (2 * CHUNK if policy == "MRU" else CHUNK)
        clock.advance(3601)  # the lease ended; the priority lasts
        assert not any(cpu.is_retained(span.key) for span in hasher.spans(leased))
        assert cpu.is_retained(hasher.spans(leased2)[0].key)
        for seed in range(50, 58):
            save(random_tokens(2 * CHUNK, seed=seed))
        if policy != "MRU":  # (MRU: the newest go first, the chunks stored after it among them)
            assert token_api.lookup(engine, leased) == 0
        assert token_api.lookup(engine, leased2) >= CHUNK


def test_store_tiers_without_the_cpu_tier_keep_nothing_there(kv: PagedKV) -> None:
    with make_engine(kv, cpu_chunks=8) as engine:
        hasher = engine.ready()[1]
        tokens = random_tokens(2 * CHUNK, seed=60)
        engine.save(hasher.spans(tokens), **kv.kv(kv.slots(2 * CHUNK)), store_to=frozenset({LOCAL_DISK}))
        assert token_api.lookup(engine, tokens) == 0
        engine.save(hasher.spans(tokens), **kv.kv(kv.slots(2 * CHUNK)), store_to=frozenset({LOCAL_CPU}))
        assert token_api.lookup(engine, tokens) == 2 * CHUNK
