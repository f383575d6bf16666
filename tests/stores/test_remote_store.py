"""Remote store behaviour, store in this test's own event loop on a real nats-server: round trips over the stream
and inline NATS, LRU under the cap, pins, partitions combined by the client, admission events, the shared index.

Process-level behaviour (separate engine processes, replicas killed, restarts, slow receivers, garbage,
credentials) is in test_remote_store_process.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
import msgpack
import numpy as np
import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.base import ChunkBuffer, Retention
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.remote_store.options import build_parser, options_from_args
from kvmesh.services.remote_store.service import RemoteStoreService
from kvmesh.shared.options_cli import GB
from kvmesh.shared.store_kit.chunk_index import ChunkIndex, SpaceRefused
from kvmesh.shared.store_kit.store_bounds import StoreBounds
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.partition import partition_of

from support.remote_store import ENGINE, MiB, chunk, nats_url, one_store, start_stores  # noqa: F401 (fixtures)
from support.store_events import admission_batches
from support.waiting import WAIT_S, wait_until_async


async def wipe(nc, store_id: str) -> int:
    """The operator's wipe of one store; the tokens it removed."""
    reply = await bus.request(nc, protocol.Subjects.store(store_id, "wipe", protocol.OPERATOR.path),
                              protocol.WipeRequest(), protocol.CommandReply, WAIT_S)
    assert reply.ok, reply.error
    return reply.num_tokens


def key_in(partition: int, partitions: int) -> bytes:
    while True:
        key = os.urandom(16)
        if partition_of(key, partitions) == partition:
            return key


async def test_round_trip_is_bit_exact_and_control_ops_answer(one_store) -> None:
    service, client = one_store
    chunks = [chunk(n, seed) for seed, n in enumerate([1, 4096, 1 * MiB + 13, 3 * MiB])]
    for meta, data in chunks:
        assert await client.put(meta, ChunkBuffer(memoryview(data)))
    for meta, data in chunks:
        out = np.zeros(meta.nbytes + 100, dtype=np.uint8)  # a bigger buffer than the chunk is fine
        got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
        assert got is not None and got.key == meta.key and got.nbytes == meta.nbytes
        assert got.checksum == chunk_file.checksum(memoryview(data))
        assert np.array_equal(out[: meta.nbytes], data) and not out[meta.nbytes:].any()
    keys = [meta.key for meta, _ in chunks]
    assert await client.contains(keys) == 4
    assert await client.contains(keys[:2] + [os.urandom(16)] + keys[2:]) == 2
    assert await client.get_into(os.urandom(16), ChunkBuffer(memoryview(bytearray(16)))) is None
    small = bytearray(10)  # a buffer too small: a miss, and the buffer is untouched
    assert await client.get_into(keys[2], ChunkBuffer(memoryview(small))) is None and not any(small)
    assert await client.remove([keys[0], os.urandom(16)]) == 1
    assert await client.contains(keys) == 0 and await client.contains(keys[1:]) == 3
    (stats,) = await client.stats()
    assert stats.num_chunks == 3 and stats.used_bytes <= stats.capacity_bytes
    assert stats.details["checksum_failures"] == 0 and stats.details["stream"].startswith("127.0.0.1:")
    assert await client.clear() == 3 * 256 and await client.contains(keys[1:]) == 0


async def test_inline_nats_put_and_get(one_store) -> None:
    service, client = one_store
    meta, data = chunk(100_000, 3)
    subject = protocol.Subjects.store(service.options.store_id, "put", ENGINE)
    ack = await bus.request(client.nc, subject, protocol.PutRequest(meta=meta, data=data.tobytes()), protocol.Ack, WAIT_S)
    assert ack.ok
    reply = await bus.request(client.nc, protocol.Subjects.store(service.options.store_id, "get", ENGINE),
                              protocol.GetRequest(key=meta.key), protocol.GetReply, WAIT_S)
    assert reply.found and reply.data == data.tobytes() and reply.meta.checksum == chunk_file.checksum(reply.data)
    # bytes elsewhere (a pool lent to a disk store) are refused with a reason, not a crash
    ack = await bus.request(client.nc, subject, protocol.PutRequest(meta=meta, pool="x"), protocol.Ack, WAIT_S)
    assert not ack.ok and "stream" in ack.error
    # the bytes and the checksum must agree
    bad = protocol.ChunkMeta(**{**meta.__dict__, "key": os.urandom(16), "checksum": 12345})
    ack = await bus.request(client.nc, subject, protocol.PutRequest(meta=bad, data=data.tobytes()), protocol.Ack, WAIT_S)
    assert not ack.ok and "checksum" in ack.error
    assert await client.contains([bad.key]) == 0
    # an inline put's retention is taken as a stream put's is
    kept, kept_data = chunk(100_000, 4)
    request = protocol.PutRequest(meta=kept, data=kept_data.tobytes(), priority=2, lease_secs=60.0)
    assert (await bus.request(client.nc, subject, request, protocol.Ack, WAIT_S)).ok
    assert service.store.index.is_retained(kept.key) and not service.store.index.is_retained(meta.key)


async def test_lru_under_the_cap_and_admission_events(nats_url: str) -> None:
    services, nc = await start_stores(nats_url, "lru", capacity=4 * MiB)
    events = await admission_batches(nc, "lru-0")
    client = RemoteStoreClient(nc, ["lru-0"], ENGINE, request_timeout=WAIT_S)
    try:
        chunks = [chunk(MiB, seed) for seed in range(6)]
        for meta, data in chunks[:4]:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        out = memoryview(bytearray(MiB))
        assert await client.get_into(chunks[0][0].key, ChunkBuffer(out))  # chunk 0 becomes most recent
        for meta, data in chunks[4:]:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        held = [await client.contains([meta.key]) for meta, _ in chunks]
        assert held == [1, 0, 0, 1, 1, 1]  # 1 and 2 were least recently used
        (stats,) = await client.stats()
        assert stats.num_chunks == 4 and stats.used_bytes <= 4 * MiB
        too_big, data = chunk(5 * MiB, 9)
        assert not await client.put(too_big, ChunkBuffer(memoryview(data)))
        await services[0].reporter.flush()

        def reported(field: str) -> set[bytes]:
            return {k for batch in events for k in getattr(batch, field)}

        await wait_until_async(lambda: reported("evicted") >= {chunks[1][0].key, chunks[2][0].key}
                               and {chunks[i][0].key for i in (0, 3, 4, 5)} <= reported("admitted"),
                               what="the admissions and evictions reported")
        seqs = [batch.seq for batch in events]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        admitted = {k for batch in events for k in batch.admitted}
        evicted = {k for batch in events for k in batch.evicted}
        # a batch carries each key's last state: a key admitted and evicted within one batch shows as evicted
        assert {chunks[i][0].key for i in (0, 3, 4, 5)} <= admitted - evicted
        assert evicted == {chunks[1][0].key, chunks[2][0].key}
        assert all(batch.location == protocol.REMOTE and batch.producer_id == "lru-0" for batch in events)
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()


async def test_pins_survive_eviction_and_wipe_until_unpinned(nats_url: str) -> None:
    services, nc = await start_stores(nats_url, "pins", capacity=4 * MiB)
    client = RemoteStoreClient(nc, ["pins-0"], ENGINE, request_timeout=WAIT_S)
    try:
        chunks = [chunk(MiB, seed, num_tokens=100 + seed) for seed in range(4)]
        for meta, data in chunks:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        keys = [meta.key for meta, _ in chunks]
        tokens = [meta.num_tokens for meta, _ in chunks]
        missing = os.urandom(16)
        # the contiguous held prefix only
        assert await client.pin(keys[:2] + [missing] + keys[2:], tokens[:2] + [7] + tokens[2:]) == 100 + 101
        assert await client.pin(keys[:1], tokens[:1], ttl_secs=60) == 100  # pins nest
        for seed in range(10, 14):  # churn: only the 2 unpinned slots are reused
            meta, data = chunk(MiB, seed)
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        assert await client.contains(keys[:2]) == 2 and await client.contains(keys[2:3]) == 0
        (stats,) = await client.stats()
        assert stats.pinned_chunks == 2 and stats.num_chunks == 4
        # a store full of pins refuses what does not fit, and says so
        churn = [k for k in services[0].store.index.keys() if k not in keys]
        assert len(services[0].store.index.pin(churn)) == 2
        meta, data = chunk(MiB, 20)
        assert not await client.put(meta, ChunkBuffer(memoryview(data)))
        assert len(services[0].store.index.unpin(churn)) == 2
        assert await wipe(nc, "pins-0") == 2 * 256  # the two unpinned churn chunks
        assert await client.contains(keys[:2]) == 2
        assert await client.unpin(keys[:2], tokens[:2]) == 201  # chunk 0 still holds its second pin
        assert await wipe(nc, "pins-0") == 101 and await client.contains(keys[:1]) == 1
        assert await client.unpin(keys[:1], tokens[:1]) == 100
        assert await client.unpin(keys[:1], tokens[:1]) == 0  # nothing left to unpin
        assert await wipe(nc, "pins-0") == 100 and await client.contains(keys) == 0
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()


async def test_client_combines_partitions(nats_url: str) -> None:
    services, nc = await start_stores(nats_url, "parts", partitions=3, capacity=16 * MiB)
    client = RemoteStoreClient(nc, [s.options.store_id for s in services], ENGINE, request_timeout=WAIT_S)
    try:
        # a prefix whose keys alternate between partitions, then a gap in partition 1
        keys = [key_in(p, 3) for p in (0, 1, 2, 0, 1, 2, 1, 0)]
        present = [True] * 6 + [False, True]
        for key, keep in zip(keys, present):
            if keep:
                meta, data = chunk(4096, 1, num_tokens=10, key=key)
                assert await client.put(meta, ChunkBuffer(memoryview(data)))
        for service in services:  # each key went to its own partition only
            assert all(partition_of(k, 3) == service.options.partition for k in service.store.index.keys())
        assert await client.contains(keys) == 6
        assert await client.contains(keys[3:]) == 3
        # pins stop at the combined prefix: key 7 (held, partition 0) must not stay pinned
        assert await client.pin(keys, [10] * len(keys)) == 60
        assert not services[0].store.index.is_pinned(keys[7])
        assert all(services[partition_of(k, 3)].store.index.is_pinned(k) for k in keys[:6])
        assert await client.unpin(keys[:6], [10] * 6) == 60
        assert sum(s.num_chunks for s in await client.stats()) == 7
        # a partition going away turns its keys into misses; the others keep answering
        await services[1].stop()
        assert await client.contains(keys) == 1  # keys[1] is partition 1's
        assert await client.contains([keys[0], keys[2], keys[3]]) == 3
        out = memoryview(bytearray(4096))
        assert await client.get_into(keys[1], ChunkBuffer(out)) is None
        assert await client.get_into(keys[2], ChunkBuffer(out)) is not None
        assert len(await client.stats()) == 2
        meta, data = chunk(4096, 2, key=key_in(1, 3))
        assert not await client.put(meta, ChunkBuffer(memoryview(data)))
    finally:
        await client.close()
        await nc.close()
        for service in services:
            await service.stop()


async def test_a_touch_reaches_each_keys_partition_and_refreshes_its_recency(nats_url: str) -> None:
    """The engine's batched hits (`RemoteStoreClient.touch`): each key goes to its partition, where the chunk
    becomes the most recent, so the next put evicts the other chunk, not the touched older one."""
    services, nc = await start_stores(nats_url, "touch", partitions=2, capacity=2 * MiB)
    client = RemoteStoreClient(nc, [s.options.store_id for s in services], ENGINE, request_timeout=WAIT_S)
    try:
        older, newer, later = ([chunk(MiB, seed, key=key_in(p, 2)) for p in range(2)] for seed in range(3))
        for meta, data in older + newer:  # each partition full: its older chunk first in line for eviction
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        await client.touch([meta.key for meta, _ in older])
        for meta, data in later:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        for p in range(2):
            held = [await client.contains([group[p][0].key]) for group in (older, newer, later)]
            assert held == [1, 0, 1], f"partition {p}: {held}"
    finally:
        await client.close()
        await nc.close()
        for service in services:
            await service.stop()


async def test_store_refuses_keys_of_other_partitions(nats_url: str) -> None:
    services, nc = await start_stores(nats_url, "wrongpart", partitions=2)
    swapped = [services[1].options.store_id, services[0].options.store_id]
    client = RemoteStoreClient(nc, swapped, ENGINE, request_timeout=WAIT_S)
    try:
        meta, data = chunk(4096, 1, key=key_in(0, 2))
        assert not await client.put(meta, ChunkBuffer(memoryview(data)))  # refused by partition 1, with a reason
        assert await client.contains([meta.key]) == 0
    finally:
        await client.close()
        await nc.close()
        for service in services:
            await service.stop()


TENANT_A = protocol.Principal.engine("tenant-a").producer("tenant-a")
TENANT_B = protocol.Principal.engine("tenant-b").producer("tenant-b")


async def test_stream_puts_are_claimed_by_their_caller_and_claims_persist(nats_url: str, tmp_path) -> None:
    """Puts on a stream count for the caller that asked for its ticket; a clear takes back only that caller's
    chunks; with persist_dir the claims come back after a restart."""
    options = dict(persist_dir=tmp_path / "persist", fsync=False)
    services, nc = await start_stores(nats_url, "claims", **options)
    a = RemoteStoreClient(nc, ["claims-0"], TENANT_A, request_timeout=WAIT_S)
    b = RemoteStoreClient(nc, ["claims-0"], TENANT_B, request_timeout=WAIT_S)
    try:
        chunks = [chunk(4096, seed, num_tokens=100 + seed) for seed in range(4)]
        for i, client in ((1, a), (2, a), (2, b), (3, b)):  # 2 is put by both: its bytes once, two claims
            meta, data = chunks[i]
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        keys = [meta.key for meta, _ in chunks]
        assert services[0].store.index.claimed_by(keys[2]) == [TENANT_A, TENANT_B]
        assert await a.clear() == 101 + 102  # A's view lost 1 and 2 ...
        assert [await b.contains([k]) for k in keys[1:]] == [0, 1, 1]  # ... only 1 left the store
        await services[0].stop()  # saves the claims beside the chunk files
        await a.close()
        await b.close()
        services, store_nc = await start_stores(nats_url, "claims", **options)
        await store_nc.close()
        assert [await b.contains([k]) for k in keys[1:]] == [0, 1, 1]
        assert await a.clear() == 0
        assert await b.clear() == 102 + 103 and await b.contains(keys[2:3]) == 0
        (stats,) = await b.stats()
        assert stats.num_chunks == 0 and stats.details["claimants"] == 0
    finally:
        await a.close()
        await b.close()
        await nc.close()
        await services[0].stop()


async def test_a_put_in_flight_is_discarded_by_its_callers_clear_unless_another_claims_it(one_store) -> None:
    service, client = one_store
    a = RemoteStoreClient(client.nc, client.store_ids, TENANT_A, request_timeout=WAIT_S)
    store = service.store
    only_a, shared = chunk(4096, 1, num_tokens=101), chunk(4096, 2, num_tokens=102)
    # the bytes of both are still arriving (a stream put between begin_put and commit_put)
    arriving = [await store.begin_put(meta, TENANT_A) for meta, _ in (only_a, shared)]
    assert await store.begin_put(shared[0], TENANT_B) is None  # B's put of the same chunk: a claim, no bytes
    assert await a.clear() == 101 + 102
    for pending, (_, data) in zip(arriving, (only_a, shared)):
        assert pending is not None
        pending.data()[:] = data
        store.commit_put(pending)
    assert await client.contains([only_a[0].key]) == 0 and await client.contains([shared[0].key]) == 1
    assert store.index.claimed_by(shared[0].key) == [TENANT_B]
    await a.close()


class _Entry:
    def __init__(self, charge: int, num_tokens: int = 1) -> None:
        self.charge, self.num_tokens = charge, num_tokens


def test_chunk_index_puts_in_flight_removals_and_supersession() -> None:
    admitted: list[bytes] = []
    evicted: list[bytes] = []
    index: ChunkIndex[_Entry] = ChunkIndex(100, admitted.append, evicted.append)
    a, b, c = (bytes([i]) * 16 for i in range(3))
    ea = _Entry(60)
    assert index.reserve(a, ea) == [] and index.reserved_bytes == 60
    assert index.contains_prefix([a]) == 0 and index.is_known(a)
    with pytest.raises(SpaceRefused):
        index.reserve(b, _Entry(50))  # in flight bytes count: 60 + 50 > 100
    assert index.commit(a, ea) and admitted == [a] and index.used_bytes == 60
    eb = _Entry(50)
    assert [k for k, _ in index.reserve(b, eb)] == [a] and evicted == [a]  # LRU victim
    index.remove(b)  # removed while in flight: discarded when it lands
    eb2 = _Entry(50)
    index.reserve(b, eb2)  # a new put of the same key supersedes the discarded one
    assert not index.commit(b, eb) and index.commit(b, eb2) and b in index
    assert index.reserved_bytes == 0 and index.used_bytes == 50
    index.pin([b], owner="engine.test")
    with pytest.raises(SpaceRefused):
        index.reserve(c, _Entry(60))
    assert index.wipe() == [] and b in index  # pinned (by an owner) survives a wipe
    assert index.unpin([b], owner="engine.test") == [b] and [k for k, _ in index.wipe()] == [b]


@pytest.mark.parametrize(("policy", "victim"), [("LRU", 1), ("FIFO", 0), ("MRU", 0), ("LFU", 1)])
def test_chunk_index_evicts_in_its_policys_order(policy: str, victim: int) -> None:
    index: ChunkIndex[_Entry] = ChunkIndex(30, policy=policy.lower())
    keys = [bytes([i]) * 16 for i in range(4)]
    for key in keys[:3]:
        assert index.reserve(key, _Entry(10)) == [] and index.commit(key)
    assert index.touch(keys[0]) is not None  # a hit on the oldest chunk
    assert [k for k, _ in index.reserve(keys[3], _Entry(10))] == [keys[victim]]
    assert index.policy_name == policy
    with pytest.raises(ValueError, match="cache_policy"):
        ChunkIndex(30, policy="ARC")


async def test_cache_policy_flag_reaches_the_store(nats_url: str) -> None:
    """`--cache-policy FIFO` on the command line: a read does not save the oldest chunk (LRU would keep it:
    test_lru_under_the_cap_and_admission_events)."""
    args = build_parser().parse_args(["--nats-url", nats_url, "--max-size-gb", str(3 * MiB / GB), "--store-id",
                                      "fifo-0", "--stream-host", "127.0.0.1", "--cache-policy", "fifo"])
    service = RemoteStoreService(dataclasses.replace(options_from_args(args), heartbeat_interval=60.0))
    await service.start()
    nc = await bus.connect(nats_url, "test-fifo")
    client = RemoteStoreClient(nc, ["fifo-0"], ENGINE, request_timeout=WAIT_S)
    try:
        chunks = [chunk(MiB, seed) for seed in range(4)]
        for meta, data in chunks[:3]:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        assert await client.get_into(chunks[0][0].key, ChunkBuffer(memoryview(bytearray(MiB))))
        meta, data = chunks[3]
        assert await client.put(meta, ChunkBuffer(memoryview(data)))
        assert [await client.contains([meta.key]) for meta, _ in chunks] == [0, 1, 1, 1]
        (stats,) = await client.stats()
        assert stats.details["cache_policy"] == "FIFO" and stats.capacity_bytes == 3 * MiB
    finally:
        await client.close()
        await nc.close()
        await service.stop()


async def test_puts_without_a_checksum_or_with_bytes_that_fail_it_are_refused_and_never_admitted(
        nats_url: str, tmp_path) -> None:
    persist = tmp_path / "persist"
    services, nc = await start_stores(nats_url, "integ", capacity=2 * MiB, persist_dir=persist, fsync=False)
    events = await admission_batches(nc, "integ-0")
    client = RemoteStoreClient(nc, ["integ-0"], ENGINE, request_timeout=WAIT_S)
    subject = protocol.Subjects.store("integ-0", "put", ENGINE)
    try:
        held = [chunk(MiB, seed) for seed in range(2)]  # the store is full: a new chunk would evict one
        for meta, data in held:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        meta, data = chunk(MiB, 7)
        unchecked = protocol.ChunkMeta(**{**meta.__dict__, "checksum": 0})
        lying = protocol.ChunkMeta(**{**meta.__dict__, "checksum": meta.checksum ^ 1})
        for bad, reason in ((unchecked, "no checksum"), (lying, "do not match their checksum")):
            ack = await bus.request(nc, subject, protocol.PutRequest(meta=bad, data=data.tobytes()), protocol.Ack,
                                    WAIT_S)
            assert not ack.ok and reason in ack.error  # inline, on NATS: verified before any room is made
        assert [await client.contains([m.key]) for m, _ in held] == [1, 1]
        assert not await client.put(unchecked, ChunkBuffer(memoryview(data)))  # on the stream: refused at once
        assert [await client.contains([m.key]) for m, _ in held] == [1, 1]
        assert not await client.put(lying, ChunkBuffer(memoryview(data)))  # room was made before the bytes came
        assert await client.contains([meta.key]) == 0
        (stats,) = await client.stats()
        assert stats.details["checksum_failures"] == 2
        # the controller never hears of them: a later good put's admission arrives, theirs never did
        good, good_data = chunk(MiB, 8)
        assert await client.put(good, ChunkBuffer(memoryview(good_data)))
        await services[0].reporter.flush()
        await wait_until_async(lambda: any(good.key in b.admitted for b in events), what="the good put's admission")
        assert not any(meta.key in b.admitted for b in events)
        # a persisted file that claims checksum 0 is dropped when the store loads its directory
        await wait_until_async(lambda: chunk_file.chunk_path(persist, good.key).exists(), what="the file written")
        await services[0].stop()
        path = chunk_file.chunk_path(persist, good.key)
        path.write_bytes(chunk_file.encode_header(protocol.ChunkMeta(**{**good.__dict__, "checksum": 0}))
                         + good_data.tobytes())
        services, store_nc = await start_stores(nats_url, "integ", capacity=2 * MiB, persist_dir=persist, fsync=False)
        await store_nc.close()
        assert await client.contains([good.key]) == 0 and await client.contains([held[1][0].key]) == 1
        assert not path.exists()
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()


async def test_a_leased_stream_put_outlives_unleased_ones_within_its_principals_share(nats_url: str) -> None:
    """A put's retention (`PutRequest.priority` / `lease_secs`, the storing request's kv_priority and lease) keeps
    the chunk over unretained ones, each engine principal within `--retained-share` (2 of 4 chunks here)."""
    services, nc = await start_stores(nats_url, "keep", capacity=4 * MiB, bounds=StoreBounds(retained_share=0.5))
    tenant_a = protocol.Principal.engine("tenant-a").producer("w0")
    tenant_b = protocol.Principal.engine("tenant-b").producer("w0")
    a = RemoteStoreClient(nc, ["keep-0"], tenant_a, request_timeout=WAIT_S)
    b = RemoteStoreClient(nc, ["keep-0"], tenant_b, request_timeout=WAIT_S)
    try:
        lease = Retention(lease_until=time.time() + 600)
        kept = [chunk(MiB, seed) for seed in range(3)]
        for meta, data in kept:  # A's third would pass its share: held as any other
            assert await a.put(meta, ChunkBuffer(memoryview(data)), lease)
        index = services[0].store.index
        assert index.retains_refused == 1 and index.retained_bytes("engine.tenant-a") <= 2 * MiB + 2 * 4096
        pushed = [chunk(MiB, seed) for seed in range(10, 16)]
        for meta, data in pushed:  # B's unleased puts push out everything unretained
            assert await b.put(meta, ChunkBuffer(memoryview(data)))
        assert [await a.contains([meta.key]) for meta, _ in kept] == [1, 1, 0]
        assert [await b.contains([meta.key]) for meta, _ in pushed] == [0, 0, 0, 0, 1, 1]
    finally:
        await a.close()
        await b.close()
        await nc.close()
        await services[0].stop()


async def test_a_persisting_store_keeps_retention_across_a_restart_bounded(nats_url: str, tmp_path) -> None:
    """With persist_dir the puts' retention is saved beside the chunk files (retention.msgpack): after a restart a
    leased chunk still outlives unleased ones. The file is read back as untrusted: entries out of bounds are
    dropped or clamped (counted), the rest re-taken within each principal's share, never past it."""
    from kvmesh.shared.store_kit.state_file import RETENTION_NAME

    persist = tmp_path / "persist"
    options = dict(persist_dir=persist, fsync=False, capacity=4 * MiB, bounds=StoreBounds(retained_share=0.5))
    services, nc = await start_stores(nats_url, "kept", **options)
    tenant = protocol.Principal.engine("tenant-a").producer("w0")
    client = RemoteStoreClient(nc, ["kept-0"], tenant, request_timeout=WAIT_S)
    try:
        kept = chunk(MiB, 1)
        assert await client.put(kept[0], ChunkBuffer(memoryview(kept[1])), Retention(lease_until=time.time() + 600))
        others = [chunk(MiB, seed) for seed in (2, 3)]
        for meta, data in others:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        await wait_until_async(lambda: services[0].store.persister.pending == 0, what="the chunk files written")
        await services[0].stop()  # saves the retention beside the chunk files
        services, store_nc = await start_stores(nats_url, "kept", **options)
        await store_nc.close()
        assert services[0].store.index.is_retained(kept[0].key)
        pushed = [chunk(MiB, seed) for seed in range(10, 14)]
        for meta, data in pushed:  # four more through a store of four: the leased one stays
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        assert [await client.contains([meta.key]) for meta, _ in (kept, *others)] == [1, 0, 0]
        assert await client.get_into(kept[0].key, ChunkBuffer(memoryview(bytearray(MiB)))) == kept[0]
        await wait_until_async(lambda: services[0].store.persister.pending == 0, what="the chunk files written")
        await services[0].stop()

        # forged: a priority past 10^6, a lease end that is no number, a year-long lease (clamped), and the same
        # owner's chunks past its share of two (its third is held unretained); in file order
        held = [meta.key for meta, _ in pushed[1:]] + [kept[0].key]
        owner = "engine.tenant-a"
        forged = {others[0][0].key: [owner, 10**7, None], held[0]: [owner, 7, None], held[1]: [owner, 0, "soon"],
                  held[2]: [owner, 0, time.time() + 365 * 86400], held[3]: [owner, 5, None]}
        (persist / RETENTION_NAME).write_bytes(msgpack.packb(forged, use_bin_type=True))
        services, store_nc = await start_stores(nats_url, "kept", **options)
        await store_nc.close()
        store = services[0].store
        assert store.counters.retentions_dropped == 3  # two dropped, one clamped
        assert [store.index.is_retained(key) for key in held] == [True, False, True, False]
        assert store.index.retains_refused == 1  # the owner's third: past its share
        lease_end = {key: end for key, _, _, end in store.index.retentions()}[held[2]]
        assert lease_end is not None and lease_end <= time.time() + 30 * 86400
        assert store.index.retained_bytes(owner) <= 2 * MiB + 2 * 4096
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()
