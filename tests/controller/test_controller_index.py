"""The controller's pure parts, without NATS or HTTP: HolderIndex, ProducerTable (sequence/sync/liveness
state machine), LookupEngine (prefix crediting) and EventLog (check_finish window)."""

from __future__ import annotations

import pytest

from kvmesh.services.controller.holder_index import HolderIndex
from kvmesh.services.controller.lookup import LookupEngine
from kvmesh.services.controller.ops import EventLog
from kvmesh.services.controller.peers import peer_holders
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.shared import protocol
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE
from kvmesh.shared.wire.keys import ChunkHasher, KeyParams, tokens_as_array

MODEL, FMT = "m", "bf16/x"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def engine(worker_id: str, instance_id: str | None = None, *, rank: int = 0, world_size: int = 1,
           chunk_size: int = 4, disk: str | None = None, remotes: tuple[str, ...] = (),
           started_at: float = 1.0) -> protocol.RegisterEngine:
    return protocol.RegisterEngine(worker_id=worker_id, instance_id=instance_id or worker_id, model=MODEL,
                                   kv_format=FMT, world_size=world_size, rank=rank, chunk_size=chunk_size,
                                   save_unfull_chunk=True, disk_store=disk, remote_stores=list(remotes),
                                   started_at=started_at)


def batch(producer: str, seq: int, admitted: list[bytes] = (), evicted: list[bytes] = (),
          location: str = LOCAL_CPU) -> protocol.AdmissionBatch:
    return protocol.AdmissionBatch(producer_id=producer, location=location, seq=seq, admitted=list(admitted),
                                   evicted=list(evicted))


def sync(producer: str, sync_id: str, seq: int, part: int, final: bool, keys: list[bytes]) -> protocol.SyncChunk:
    return protocol.SyncChunk(producer_id=producer, location=LOCAL_CPU, sync_id=sync_id, seq=seq, part=part,
                              final=final, keys=keys)


def in_sync_table(*worker_ids: str, **kwargs: float) -> ProducerTable:
    table = ProducerTable(**kwargs)
    for worker_id in worker_ids:
        table.on_register_engine(engine(worker_id), 0.0)
        table.on_sync_chunk(sync(worker_id, f"s-{worker_id}", 0, 0, True, []), 0.0)
    return table


# ---------------------------------------------------------------------------------------------------------
# HolderIndex


def test_index_bits_counts_and_replace() -> None:
    index = HolderIndex()
    a, b = index.new_slot(), index.new_slot()
    assert index.admit(a, [key(1), key(2), key(2)]) == 2
    index.admit(b, [key(2), key(3)])
    assert index.mask(key(2)) == 0b11 and len(index) == 3
    assert index.evict(a, [key(2), key(9)]) == 1
    assert index.mask(key(2)) == 0b10 and index.count(a) == 1
    assert index.evict(b, [key(2)]) == 1 and index.mask(key(2)) == 0 and len(index) == 2  # no holder: gone
    # replace: exactly these keys, stale ones dropped, other slots untouched
    index.admit(a, [key(4), key(5)])
    assert index.replace(a, {key(5), key(6)}) == 2  # key(1), key(4) were stale
    assert sorted(k for k in index.table if index.mask(k) & 1) == [key(5), key(6)]
    assert index.count(a) == 2 and index.mask(key(3)) == 0b10
    assert index.replace(a, {key(5), key(6)}) == 0  # nothing stale: no sweep
    assert index.clear_slot(a) == 2 and index.count(a) == 0 and len(index) == 1


def test_released_slots_are_reused_lowest_first_with_no_bits_left() -> None:
    index = HolderIndex()
    a, b, c = index.new_slot(), index.new_slot(), index.new_slot()
    index.admit(a, [key(1), key(2)])
    index.admit(c, [key(2)])
    index.release_slot(c)
    index.release_slot(a)
    assert index.num_slots == 1 and index.mask(key(1)) == 0 and index.mask(key(2)) == 0 and len(index) == 0
    assert index.new_slot() == a and index.new_slot() == c and index.new_slot() == 3
    assert index.count(a) == 0 and index.count(c) == 0


# ---------------------------------------------------------------------------------------------------------
# ProducerTable


def test_contiguous_batches_apply_and_duplicates_are_ignored() -> None:
    table = in_sync_table("w")
    assert not table.on_batch(batch("w", 1, [key(1), key(2)]), 1.0)
    assert not table.on_batch(batch("w", 2, [key(3)], [key(1)]), 1.0)
    assert not table.on_batch(batch("w", 2, [key(9)]), 1.0)  # duplicate: ignored
    assert set(table.index.table) == {key(2), key(3)}
    assert table.producer("w").last_seq == 2 and not table.producer("w").needs_sync


def test_gap_requests_sync_and_sync_rebuilds_with_later_batches_folded_in() -> None:
    table = in_sync_table("w", sync_retry_s=5.0)
    table.on_batch(batch("w", 1, [key(1), key(2)]), 1.0)
    # seq 2 (admit 3, evict 2) is lost; seq 3 arrives: applied, and a sync is asked for once.
    assert table.on_batch(batch("w", 3, [key(4)]), 1.0) is True
    assert table.on_batch(batch("w", 4, [key(5)]), 1.1) is False  # already asked, not yet retried
    assert table.stats.seq_gaps == 1
    # The sync snapshot is at seq 4; seq 5 arrives between its parts and is folded in.
    assert not table.on_sync_chunk(sync("w", "s1", 4, 0, False, [key(1), key(3)]), 2.0)
    assert not table.on_batch(batch("w", 5, [key(6)], [key(1)]), 2.0)
    assert not table.on_sync_chunk(sync("w", "s1", 4, 1, True, [key(4), key(5)]), 2.0)
    assert set(table.index.table) == {key(3), key(4), key(5), key(6)}  # key(2) stale, key(1) evicted by seq 5
    producer = table.producer("w")
    assert producer.last_seq == 5 and not producer.needs_sync and table.stats.stale_keys_dropped == 1
    assert not table.on_batch(batch("w", 6, [key(7)]), 3.0) and key(7) in table.index.table


def test_broken_sync_is_discarded_and_asked_again() -> None:
    table = in_sync_table("w", sync_retry_s=1.0)
    table.on_batch(batch("w", 1, [key(1)]), 1.0)
    table.on_batch(batch("w", 3, [key(3)]), 1.0)  # gap -> asked at t=1.0
    table.on_sync_chunk(sync("w", "s1", 3, 0, False, [key(1)]), 1.5)
    # Part 1 was lost: the sync is dropped and asked for again at once (the earlier request is used up).
    assert table.on_sync_chunk(sync("w", "s1", 3, 2, True, [key(3)]), 1.6) is True
    assert table.producer("w").needs_sync and "s1" not in table.producer("w").syncs
    assert table.tick(2.0) == []  # not again before sync_retry_s...
    assert table.tick(2.7) == ["w"]  # ...then retried by the maintenance pass
    # A later batch lost while a sync streams in also breaks it.
    table.on_sync_chunk(sync("w", "s2", 3, 0, False, [key(1)]), 3.0)
    table.on_batch(batch("w", 5, [key(5)]), 3.0)  # seq 4 never arrives
    table.on_sync_chunk(sync("w", "s2", 3, 1, True, [key(3)]), 3.1)
    assert table.producer("w").needs_sync and table.stats.syncs_broken == 2


def test_heartbeats_unknown_producers_restarts_and_claims() -> None:
    table = ProducerTable(sync_retry_s=5.0, heartbeat_grace_s=0.5)
    hb = protocol.Heartbeat
    assert table.on_heartbeat(hb(producer_id="stranger", last_seq=7), 0.0) is True  # unknown: sync
    table.on_register_engine(engine("w"), 0.0)
    table.on_sync_chunk(sync("w", "s", 2, 0, True, [key(1)]), 0.0)
    assert not table.on_heartbeat(hb(producer_id="w", last_seq=2), 1.0)
    # A claim of seq 3 is judged after the grace period: met in time, nothing happens...
    assert not table.on_heartbeat(hb(producer_id="w", last_seq=3), 1.0)
    table.on_batch(batch("w", 3, [key(3)]), 1.2)
    assert "w" not in table.tick(2.0)
    # ...not met: a sync.
    table.on_heartbeat(hb(producer_id="w", last_seq=4), 2.0)
    assert table.tick(2.2) == []
    assert table.tick(2.6) == ["w"]
    table.on_sync_chunk(sync("w", "s2", 4, 0, True, [key(1), key(3)]), 2.7)
    # A heartbeat below our seq: the producer restarted.
    assert table.on_heartbeat(hb(producer_id="w", last_seq=0), 9.0) is True
    # So does a batch numbered 1 again.
    table.on_sync_chunk(sync("w", "s3", 0, 0, True, []), 9.1)
    table.on_batch(batch("w", 1, [key(1)]), 9.2)
    table.on_batch(batch("w", 2, [key(2)]), 9.3)
    assert table.on_batch(batch("w", 1, [key(8)]), 20.0) is True


def test_reregistration_with_new_start_time_resets_the_sequence() -> None:
    table = in_sync_table("w")
    table.on_batch(batch("w", 1, [key(1)]), 1.0)
    table.on_register_engine(engine("w", started_at=2.0), 2.0)
    producer = table.producer("w")
    assert producer.last_seq is None and producer.needs_sync
    table.on_sync_chunk(sync("w", "new", 0, 0, True, []), 2.1)  # the restarted worker lost its CPU tier
    assert len(table.index) == 0 and not producer.needs_sync


def test_liveness_marks_down_and_back() -> None:
    table = in_sync_table("w", liveness_timeout_s=6.0)
    version = table.version
    assert table.tick(5.0) == [] and table.producer("w").alive
    table.tick(6.5)
    assert not table.producer("w").alive and table.alive_mask == 0 and table.version > version
    table.on_heartbeat(protocol.Heartbeat(producer_id="w", last_seq=0), 7.0)
    assert table.producer("w").alive and table.alive_mask == 1


# ---------------------------------------------------------------------------------------------------------
# LookupEngine


def hold(table: ProducerTable, producer_id: str, tokens: list[int], chunks: list[int], *, rank: int = 0,
         world_size: int = 1, chunk_size: int = 4) -> None:
    keys = ChunkHasher(KeyParams(MODEL, FMT, world_size, rank), chunk_size).keys(tokens)
    table.index.admit(table.producer(producer_id).slot, [keys[i] for i in chunks])


def test_lookup_prefix_locations_ties_and_liveness() -> None:
    tokens = list(range(10))  # chunks of 4, 4, 2
    table = ProducerTable()
    for store_id, location in [("disk", LOCAL_DISK), ("r0", REMOTE), ("r1", REMOTE)]:
        table.on_register_store(protocol.RegisterStore(store_id=store_id, location=location), 0.0)
    table.on_register_engine(engine("a", disk="disk", remotes=("r0", "r1")), 0.0)
    table.on_register_engine(engine("b"), 0.0)
    table.on_register_engine(engine("c", disk="disk"), 0.0)
    lookup = LookupEngine(table)
    assert lookup.lookup(tokens) == {}
    hold(table, "a", tokens, [0, 1, 2])
    hold(table, "b", tokens, [1, 2])  # no chunk 0: nothing
    hold(table, "disk", tokens, [0, 1, 2])
    assert lookup.lookup(tokens) == {"a": (LOCAL_CPU, 10), "c": (LOCAL_DISK, 10)}  # a: tie -> CPU
    hold(table, "r0", tokens, [0, 2])
    hold(table, "r1", tokens, [1])
    table.index.evict(table.producer("a").slot, list(table.index.table))
    assert lookup.lookup(tokens)["a"] == (LOCAL_DISK, 10)  # disk ties remote: the faster wins
    table.index.clear_slot(table.producer("disk").slot)
    assert lookup.lookup(tokens) == {"a": (REMOTE, 10)}
    # r1 down: a's remote prefix stops at chunk 0.
    table.producer("r1").last_seen = -100.0
    table.tick(0.0)
    assert lookup.lookup(tokens) == {"a": (REMOTE, 4)}
    assert lookup.lookup(tokens_as_array(tokens)) == {"a": (REMOTE, 4)}


def test_a_clear_drops_only_the_stores_no_other_instance_uses() -> None:
    tokens = list(range(8))
    table = ProducerTable()
    for store_id, location in [("shared-disk", LOCAL_DISK), ("own-disk", LOCAL_DISK), ("remote", REMOTE)]:
        table.on_register_store(protocol.RegisterStore(store_id=store_id, location=location), 0.0)
    table.on_register_engine(engine("a", disk="shared-disk", remotes=("remote",)), 0.0)
    table.on_register_engine(engine("b", disk="shared-disk"), 0.0)
    table.on_register_engine(engine("c", disk="own-disk", remotes=("remote",)), 0.0)
    for producer_id in ("a", "shared-disk", "own-disk", "remote"):
        hold(table, producer_id, tokens, [0, 1])
    lookup = LookupEngine(table)
    # a's clear took back a's claims in the shared disk store only: b's view of it must not blink.
    assert table.mark_cleared("a", ["a", "shared-disk", "remote"], 0.0) == ["a"]
    assert lookup.lookup(tokens) == {"a": (LOCAL_DISK, 8), "b": (LOCAL_DISK, 8), "c": (LOCAL_DISK, 8)}
    # c alone uses own-disk: dropped at once (a confirming sync restores what it still holds).
    assert table.mark_cleared("c", ["own-disk"], 0.0) == ["own-disk"]
    assert lookup.lookup(tokens)["c"] == (REMOTE, 8)


def test_lookup_tensor_parallel_min_over_ranks_and_missing_rank() -> None:
    tokens = list(range(12))
    table = ProducerTable()
    table.on_register_engine(engine("tp.r0", "tp", rank=0, world_size=2), 0.0)
    lookup = LookupEngine(table)
    hold(table, "tp.r0", tokens, [0, 1, 2], world_size=2)
    assert lookup.lookup(tokens) == {}  # rank 1 not registered: the instance cannot serve
    table.on_register_engine(engine("tp.r1", "tp", rank=1, world_size=2), 0.0)
    hold(table, "tp.r1", tokens, [0, 1], rank=1, world_size=2)
    assert lookup.lookup(tokens) == {"tp": (LOCAL_CPU, 8)}


def test_lookup_of_a_model_with_recurrent_state_ends_at_a_chunk_whose_state_is_held_there() -> None:
    """A Mamba / GDN hybrid (its chunk format names a state group) resumes only where a state is held: the
    prefix at each location ends at the last held chunk whose state that location holds too, per rank."""
    fmt = f"{FMT}/gM1,F1"
    tokens = list(range(14))  # chunks of 4: 4, 8, 12, and a partial one (no state after it)
    table = ProducerTable()
    table.on_register_store(protocol.RegisterStore(store_id="disk", location=LOCAL_DISK), 0.0)
    for rank in range(2):
        reg = engine(f"h.r{rank}", "h", rank=rank, world_size=2, disk="disk")
        table.on_register_engine(protocol.RegisterEngine(**{**reg.__dict__, "kv_format": fmt}), 0.0)
    lookup = LookupEngine(table)
    hashers = [ChunkHasher(KeyParams(MODEL, fmt, 2, rank), 4) for rank in range(2)]
    state_keys = [[span.key for span in hasher.state_spans(hasher.chain(tokens), 2)] for hasher in hashers]
    assert all(len(keys) == 3 and not set(keys) & set(hasher.keys(tokens))
               for keys, hasher in zip(state_keys, hashers))

    def hold_with_states(producer_id: str, rank: int, chunks: list[int], states: list[int]) -> None:
        keys = hashers[rank].keys(tokens)
        table.index.admit(table.producer(producer_id).slot, [keys[i] for i in chunks] +
                          [state_keys[rank][i] for i in states])

    for rank in range(2):
        hold_with_states(f"h.r{rank}", rank, [0, 1, 2, 3], [0, 2] if rank == 0 else [0, 1, 2])
    assert lookup.lookup(tokens) == {"h": (LOCAL_CPU, 12)}  # every chunk and the state after 12 on both ranks
    table.index.evict(table.producer("h.r0").slot, [state_keys[0][2]])
    assert lookup.lookup(tokens) == {"h": (LOCAL_CPU, 4)}  # rank 0 lost the state after 12 and never held 8's
    hold_with_states("disk", 0, [0, 1, 2, 3], [1])
    hold_with_states("disk", 1, [0, 1, 2, 3], [1, 2])
    assert lookup.lookup(tokens) == {"h": (LOCAL_DISK, 8)}
    table.index.clear_slot(table.producer("disk").slot)
    hold_with_states("disk", 0, [0, 1, 2, 3], [])
    hold_with_states("disk", 1, [0, 1, 2, 3], [])
    assert lookup.lookup(tokens) == {"h": (LOCAL_CPU, 4)}  # every chunk on disk, but no state there: of no use


def test_the_index_keeps_the_order_engine_workers_admitted_each_key_in() -> None:
    """Admission order (who serves a P2P hit): kept for ordered slots only, as the index applied the admissions;
    a slot that evicts and admits again goes last, a full sync keeps the places of what it still holds, a
    released slot leaves every order."""
    index = HolderIndex()
    first, second, store, third = (index.new_slot() for _ in range(4))
    for slot in (first, second, third):
        index.set_ordered(slot, True)
    index.admit(second, [key(1)])
    index.admit(store, [key(1), key(2)])  # a store: never in the order
    index.admit(first, [key(1), key(2)])
    index.admit(third, [key(2), key(1)])
    assert index.order(key(1)) == (second, first, third) and index.order(key(2)) == (first, third)
    assert index.first_of(key(1), 1 << first | 1 << third) == first
    assert index.first_of(key(2), 1 << store) is None
    index.evict(second, [key(1)])
    index.admit(second, [key(1)])
    assert index.order(key(1)) == (first, third, second)
    index.replace(first, {key(1), key(3)})  # key 2 went stale, key 1 keeps its place
    assert index.order(key(1)) == (first, third, second) and index.order(key(2)) == (third,)
    index.release_slot(first)
    assert index.order(key(1)) == (third, second) and index.order(key(3)) == ()
    index.clear_slot(third)
    assert index.order(key(1)) == (second,) and index._order == {}  # a single holder needs no entry


def test_a_peer_lookup_names_each_keys_first_admitter_among_live_p2p_workers_of_the_askers_domain() -> None:
    """Never the worker holding the most keys, never the lowest slot: per key, the live P2P worker of another
    instance in the asker's domain (the domains map's, passed in by the feed) that admitted it first, in runs."""
    tokens = list(range(16))  # four chunks of 4
    keys = ChunkHasher(KeyParams(MODEL, FMT), 4).keys(tokens)
    table = ProducerTable()

    def worker(name: str, p2p: bool = True, domain: str = "default") -> str:
        table.on_register_engine(protocol.RegisterEngine(**{**engine(name).__dict__, "p2p": p2p}), 0.0,
                                 domain=domain)
        return name

    def holds(name: str, chunks: list[int]) -> None:
        table.index.admit(table.producer(name).slot, [keys[i] for i in chunks])

    def ask(exclude: tuple[str, ...] = (), producer: str = "") -> protocol.PeerLookupReply:
        return peer_holders(table, table.producer("asker"),
                            protocol.PeerLookup("asker", keys, exclude=list(exclude), producer=producer))

    for name in ("asker", "liar", "a", "closed", "other-domain"):  # the liar has the lowest slot of the peers
        worker(name, p2p=name != "closed", domain="tenant-b" if name == "other-domain" else "default")
    holds("closed", [0, 1, 2, 3])  # first, but serves no peer
    holds("other-domain", [0, 1, 2, 3])  # first, but in another domain
    holds("asker", [0, 1, 2, 3])  # its own chunks never count
    holds("a", [0, 1])
    holds("liar", [0, 1, 2, 3])  # more keys, lower slot: the record of the keys nobody admitted before it only
    assert ask() == protocol.PeerLookupReply("a", "a", 2, ["liar"], ["liar"], [2])
    assert ask().runs() == [("a", "a", 2), ("liar", "liar", 2)]
    assert ask(exclude=("a",)) == protocol.PeerLookupReply("liar", "liar", 4)
    assert ask(producer="a").producer_live and not ask(producer="closed").producer_live
    assert not ask(producer="ghost").producer_live and not ask(producer="a", exclude=("a",)).producer_live
    table.index.evict(table.producer("a").slot, [keys[0]])
    table.index.admit(table.producer("a").slot, [keys[0]])  # admitted again: after the liar
    assert ask() == protocol.PeerLookupReply("liar", "liar", 1, ["a", "liar"], ["a", "liar"], [1, 2])
    table.producer("liar").last_seen = -100.0  # silent past the liveness timeout
    table.tick(0.0)
    assert ask() == protocol.PeerLookupReply("a", "a", 2)
    assert peer_holders(table, table.producer("asker"), protocol.PeerLookup("asker", [key(99)])) == \
        protocol.PeerLookupReply()


def test_lookup_save_unfull_chunk_false_ignores_partial_tail() -> None:
    tokens = list(range(10))
    table = ProducerTable()
    reg = engine("w")
    table.on_register_engine(protocol.RegisterEngine(**{**reg.__dict__, "save_unfull_chunk": False}), 0.0)
    hold(table, "w", tokens, [0, 1, 2])  # chunk 2 (partial) is named but never looked up
    assert LookupEngine(table).lookup(tokens) == {"w": (LOCAL_CPU, 8)}


# ---------------------------------------------------------------------------------------------------------
# EventLog


def test_event_log_window_by_count_and_age() -> None:
    now = [0.0]
    log = EventLog(max_events=3, max_age_s=10.0, clock=lambda: now[0])
    ids = [log.new("pin") for _ in range(4)]
    assert log.get(ids[0]) is None and len(log) == 3  # the oldest fell out
    log.finish(ids[1], 12)
    log.fail(ids[2], "instance x timed out")
    assert (log.get(ids[1]).status, log.get(ids[1]).num_tokens) == ("finished", 12)
    assert (log.get(ids[2]).status, log.get(ids[2]).error) == ("failed", "instance x timed out")
    assert log.get(ids[3]).status == "pending"
    now[0] = 11.0
    assert log.get(ids[3]) is None  # too old
    log.new("lookup", status="finished")
    assert len(log) == 1
    with pytest.raises(ValueError):
        EventLog(max_events=0)


# ---------------------------------------------------------------------------------------------------------
# /lookup body parsing: the numpy fast path must agree with the exact (msgspec) rules


def test_lookup_body_fast_path_agrees_with_exact_rules() -> None:
    import json

    import numpy as np
    from fastapi.responses import Response

    from kvmesh.services.controller.api.lookup_body import decode_lookup, fast_tokens
    from kvmesh.services.controller.api.schemas import MAX_TOKEN_ID
    from kvmesh.services.controller.lookup import KeyRequest

    accepted = {
        b'{"tokens": [1, 2, 3]}': [1, 2, 3], b'{"tokens":[0]}': [0], b'{"tokens": []}': [],
        b'{"tokens" : [ ] , "x": 1}': [], b'{"tokens":[\n 7,\t8 ]}': [7, 8],
        json.dumps({"tokens": [MAX_TOKEN_ID]}).encode(): [MAX_TOKEN_ID],
        b'{"tokens": [1.0, 2]}': [1, 2], b'{"tokens": [2e0]}': [2],  # exact path: integral floats
        b'{"x": [-1], "tokens": [5]}': [5],
    }
    for body, expected in accepted.items():
        decoded = decode_lookup(body)
        assert not isinstance(decoded, Response), (body, decoded.body)
        tokens, key_request = decoded
        assert list(np.asarray(tokens)) == expected, body
        assert key_request == KeyRequest()
    fast = fast_tokens(b'{"tokens": [1, 2, 3]}')
    assert fast is not None and isinstance(fast[0], np.ndarray)
    assert fast_tokens(b'{"tokens": [1.0]}') is None  # left to the exact path
    # the optional key inputs, on both paths
    for body in (b'{"tokens": [1], "cache_salt": "s1", "lora_name": "a"}',
                 b'{"tokens": [1.0], "cache_salt": "s1", "lora_name": "a"}'):
        decoded = decode_lookup(body)
        assert not isinstance(decoded, Response)
        assert decoded[1] == KeyRequest("s1", "a"), body
    rejected = [b'{"tokens": [1, -2]}', b'{"tokens": [1.5]}', b'{"tokens": ["1"]}', b'{"tokens": [true]}',
                b'{"tokens": [[1]]}', b'{"tokens": "12"}', b'{"tokens": 12}', b'{"tokens": null}',
                json.dumps({"tokens": [MAX_TOKEN_ID + 1]}).encode(), b'{"tokens": [99999999999999999999999]}',
                b'{"tokens": [1,,2]}', b'{"tokens": [01]}', b'{"tokens": [1 2]}', b'{"tokens": [1, 2]',
                b'{}', b'[]', b'', b'\x00', b'{"tokens": [1e400]}', b'{"tokens": [1], "cache_salt": ""}',
                b'{"tokens": [1], "cache_salt": 5}', b'{"tokens": [1], "lora_name": ["a"]}',
                b'{"tokens": [1], "cache_salt": "' + b"s" * 129 + b'"}']
    for body in rejected:
        response = decode_lookup(body)
        assert isinstance(response, Response) and response.status_code == 422, body
    bad_index = json.loads(decode_lookup(b'{"tokens": [1, 2, -3]}').body)["detail"][0]
    assert bad_index["loc"] == ["body", "tokens", 2]


async def test_lookup_route_and_hot_path_share_one_handler() -> None:
    """POST /lookup is served by the Gate (ASGI hot path); its FastAPI route must answer identically."""
    import httpx

    from kvmesh.services.controller.api import create_app
    from kvmesh.services.controller.config import ControllerConfig
    from kvmesh.services.controller.core import ControllerCore

    core = ControllerCore(ControllerConfig(max_tokens=5))
    core.table.on_register_engine(engine("w", chunk_size=2), 0.0)
    hold(core.table, "w", [1, 2, 3], [0, 1], chunk_size=2)
    bodies = [b'{"tokens": [1, 2, 3]}', b'{"tokens": [1.0, 2]}', b'{"tokens": [-1]}', b"nope", b'{"tokens": [1,2,3,4,5,6]}']
    answers = []
    for fast_path in (True, False):
        app = create_app(core, lookup_fast_path=fast_path)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            answers.append([(r.status_code, {k: v for k, v in r.json().items() if k != "event_id"})
                            for r in [await client.post("/lookup", content=b) for b in bodies]])
    assert answers[0] == answers[1]
    assert [status for status, _ in answers[0]] == [200, 200, 422, 422, 413]
    assert answers[0][0][1] == {"layout_info": {"w": ["LocalCPUBackend", 3]}}


# ---------------------------------------------------------------------------------------------------------
# Instance ids claimed by several workers


def test_one_instance_id_claimed_by_two_workers_is_served_by_the_latest_live_one() -> None:
    table = ProducerTable(liveness_timeout_s=5.0)
    assert table.on_register_engine(engine("inst@1-a", "inst"), 0.0) == []
    assert table.on_register_engine(engine("inst@2-b", "inst"), 1.0) == ["inst@1-a", "inst@2-b"]
    assert table.instances == {"inst": {0: "inst@2-b"}}  # the latest: a restarted engine takes over at once
    assert [p.producer_id for p in table.instance_claims.duplicates_of("inst")] == ["inst@1-a"]
    # A registration again (a controller hello) of the older one does not take the instance id back...
    table.on_register_engine(engine("inst@1-a", "inst"), 2.0)
    assert table.instances["inst"][0] == "inst@2-b"
    # ...but the serving one going silent does, and its return gives it back.
    table.on_heartbeat(protocol.Heartbeat("inst@1-a", 0), 7.0)
    table.tick(7.0)
    assert table.instances["inst"][0] == "inst@1-a" and table.instance_claims.conflicts("inst") == {}
    table.on_heartbeat(protocol.Heartbeat("inst@2-b", 0), 8.0)
    assert table.instances["inst"][0] == "inst@2-b" and table.instance_claims.conflicts("inst") == {0: ["inst@1-a", "inst@2-b"]}
    # Forgotten: the other serves; both gone: the instance id is unknown.
    table.forget(table.producers["inst@2-b"])
    assert table.instances == {"inst": {0: "inst@1-a"}} and table.instance_claims.duplicates_of("inst") == []
    table.forget(table.producers["inst@1-a"])
    assert table.instances == {} and table.instance_claims.claims == {}


def test_a_worker_re_registering_under_another_instance_id_leaves_its_old_claim() -> None:
    table = ProducerTable()
    table.on_register_engine(engine("w@1-a", "old"), 0.0)
    table.on_register_engine(engine("w@1-a", "new"), 1.0)
    assert table.instances == {"new": {0: "w@1-a"}} and "old" not in table.instance_claims.claims
    table.on_register_store(protocol.RegisterStore(store_id="w@1-a", location=LOCAL_DISK), 2.0)
    assert table.instances == {} and table.instance_claims.claims == {}
