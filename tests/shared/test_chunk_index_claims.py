"""Claims in the shared ChunkIndex (shared/store_kit/chunk_index.py): who put a chunk, a clear that takes back only the
caller's claims, pinned chunks that outlive their claims, puts in flight, the operator's wipe, and the claim
table a store persists. The stores' own tests drive the same through NATS (test_disk_store.py,
test_remote_store.py)."""

from __future__ import annotations

import pytest

from kvmesh.shared.store_kit.chunk_claims import ClaimTable
from kvmesh.shared.store_kit.chunk_index import ChunkIndex, ForeignChunk

A = "engine.tenant-a.w0"
B = "engine.tenant-b.w0"
PA, PB = "engine.tenant-a", "engine.tenant-b"  # their principals (pins and removals count per principal)


class _Entry:
    def __init__(self, num_tokens: int = 256, charge: int = 10) -> None:
        self.charge, self.num_tokens = charge, num_tokens


def key(i: int) -> bytes:
    return bytes([i]) * 16


def index_with(puts: list[tuple[int, str]], capacity: int = 1000) -> tuple[ChunkIndex[_Entry], list[bytes]]:
    """An index holding the chunks of `puts` (chunk number, caller), each committed; and its eviction log."""
    evicted: list[bytes] = []
    index: ChunkIndex[_Entry] = ChunkIndex(capacity, on_evict=evicted.append)
    for i, caller in puts:
        if not index.claim(key(i), caller):
            index.reserve(key(i), _Entry(100 + i), caller)
            assert index.commit(key(i))
    return index, evicted


def test_a_clear_takes_back_only_the_callers_claims() -> None:
    index, evicted = index_with([(1, A), (2, A), (2, B), (3, B)])
    assert index.claimed_by(key(2)) == [A, B] and index.claim_counts() == {A: 2, B: 2}
    cleared = index.clear(A)
    # A's view lost 1 and 2; only 1 is gone from the store (2 is B's too)
    assert cleared.num_tokens == 101 + 102 and [k for k, _ in cleared.forgotten] == [key(1)]
    assert evicted == [key(1)] and index.keys() == [key(2), key(3)]
    assert index.claimed_by(key(2)) == [B] and index.claim_counts() == {B: 2}
    assert index.clear(A).released == []  # nothing of A's left: a second clear is a no-op
    cleared = index.clear(B)
    assert cleared.num_tokens == 102 + 103 and len(index) == 0 and evicted == [key(1), key(2), key(3)]
    assert index.claim_counts() == {}


def test_pinned_chunks_outlive_their_claims_until_the_last_pin_goes() -> None:
    index, evicted = index_with([(1, A), (2, A)])
    index.pin([key(1)])
    index.pin([key(1)])  # pins nest
    cleared = index.clear(A)
    assert cleared.num_tokens == 101 + 102  # both left A's view ...
    assert [k for k, _ in cleared.forgotten] == [key(2)] and key(1) in index  # ... 1 stays for its pins
    assert index.unpin([key(1)]) == [key(1)] and index.forget_orphans() == [] and key(1) in index
    assert index.unpin([key(1)]) == [key(1)]
    assert [k for k, _ in index.forget_orphans()] == [key(1)] and evicted == [key(2), key(1)]
    # a pinned chunk that another put claims again is no orphan any more
    index, _ = index_with([(3, A)])
    index.pin([key(3)])
    index.clear(A)
    assert index.claim(key(3), B) and index.unpin([key(3)]) == [key(3)]
    assert index.forget_orphans() == [] and index.claimed_by(key(3)) == [B]


def test_chunks_without_a_claim_stay_until_wiped_and_a_wipe_spares_pins() -> None:
    index, evicted = index_with([(1, A), (2, B)])
    index.reserve(key(3), _Entry(103))  # a put without a caller (as a chunk found on disk from before claims)
    assert index.commit(key(3)) and index.claimed_by(key(3)) == []
    index.clear(A)
    index.clear(B)
    assert index.keys() == [key(3)]
    index.pin([key(3)], owner=PA)
    assert index.wipe() == [] and key(3) in index  # pinned by an owner: kept
    index.unpin([key(3)], owner=PA)
    assert [k for k, _ in index.wipe()] == [key(3)] and len(index) == 0


def test_puts_in_flight_carry_claims_and_a_clear_discards_only_unclaimed_ones() -> None:
    index: ChunkIndex[_Entry] = ChunkIndex(1000)
    index.reserve(key(1), _Entry(101), A)
    index.reserve(key(2), _Entry(102), A)
    assert index.claim(key(2), B)  # B puts the same chunk while A's bytes are still arriving
    index.reserve(key(3), _Entry(103), B)
    cleared = index.clear(A)
    assert cleared.num_tokens == 101 + 102 and [e.num_tokens for e in cleared.discarded] == [101]
    assert not index.commit(key(1)) and index.commit(key(2)) and index.commit(key(3))  # 1 discarded on landing
    assert index.keys() == [key(2), key(3)] and index.claimed_by(key(2)) == [B]
    # a discarded put revived by a new put carries only the new caller's claim
    index.reserve(key(4), _Entry(104), A)
    index.clear(A)
    assert index.revive(key(4)) and index.claim(key(4), B) and index.commit(key(4))
    assert index.claimed_by(key(4)) == [B]
    # an aborted put gives its claims back
    index.reserve(key(5), _Entry(105), A)
    index.abort(key(5))
    assert A not in index.claim_counts()


def test_caller_ids_are_recycled_so_masks_stay_small() -> None:
    index: ChunkIndex[_Entry] = ChunkIndex(10**6)
    for generation in range(100):  # engines come and go: each clears before the next arrives
        caller = f"engine.gen{generation}.w0"
        for i in range(3):
            if not index.claim(key(i), caller):
                index.reserve(key(i), _Entry(), caller)
                index.commit(key(i))
        index.clear(f"engine.gen{generation - 1}.w0")
        assert max(index.claim_table().masks.values()) < 4  # never more than two live callers: two bits
    assert len(index.claim_counts()) == 1


def test_the_claim_table_restores_onto_the_held_chunks() -> None:
    index, _ = index_with([(1, A), (2, A), (2, B), (3, B), (4, A)])
    index.pin([key(4)])
    index.clear(A)  # 4 is pinned: an orphan now
    table = index.claim_table()
    assert table.masks.keys() == {key(2), key(3)} and table.orphans == [key(4)]
    # A fresh index (a restart) holding 2, 3, 4 and a chunk the table does not know, where other callers took
    # B's saved id before the table came back: the table maps paths, not ids
    assert table.callers.index(B) == 1
    fresh, evicted = index_with([(6, "engine.c.w0"), (7, "engine.d.w0")])
    for i in (2, 3, 4, 5):
        fresh.load(key(i), _Entry(100 + i))
    fresh.pin([key(4)])
    assert fresh.restore_claims(ClaimTable(table.callers, table.masks, table.orphans)) == 2
    assert fresh.claimed_by(key(2)) == [B] and fresh.claimed_by(key(5)) == []
    assert [e.num_tokens for e in fresh.clear(B).released] == [102, 103]
    assert fresh.unpin([key(4)]) == [key(4)] and [k for k, _ in fresh.forget_orphans()] == [key(4)]
    assert sorted(fresh.keys()) == [key(5), key(6), key(7)]  # 5 never had a claim: kept


# ---- issue 24: owned pins, removal of one's own claims, sharing domains -----------------------------------------

def test_an_unpin_drops_only_the_owners_pins() -> None:
    index, _ = index_with([(1, A), (2, A)])
    assert index.pin([key(1), key(2)], owner=PA) == [key(1), key(2)]
    assert index.unpin([key(1), key(2)], owner=PB) == []  # B holds none of these pins
    assert index.is_pinned(key(1)) and index.pin_owners(key(1)) == {PA: 1}
    index.pin([key(1)], owner=PB)
    assert index.unpin([key(1)], owner=PB) == [key(1)] and index.unpin([key(1)], owner=PB) == []
    assert index.pin_owners(key(1)) == {PA: 1} and index.is_pinned(key(1))
    assert index.unpin([key(1), key(2)], owner=PA) == [key(1), key(2)] and index.pinned_count == 0


def test_unowned_pins_are_the_operators_a_wipe_drops_them() -> None:
    index, _ = index_with([(1, A), (2, A)])
    index.pin([key(1)])  # unowned: as pins persisted before owners
    index.pin([key(2)], owner=PA)
    assert index.unpin([key(1)], owner=PA) == []
    assert [k for k, _ in index.wipe()] == [key(1)] and index.keys() == [key(2)]


def test_a_remove_takes_back_only_the_principals_claims() -> None:
    index, evicted = index_with([(1, A), (1, "engine.tenant-a.w1"), (1, B), (2, A)])
    released = index.release(key(1), PB)
    assert len(released.released) == 1 and released.forgotten == [] and key(1) in index
    assert index.claimed_by(key(1)) == [A, "engine.tenant-a.w1"]
    assert index.release(key(1), PB).released == []  # nothing of B's left: answers nothing
    released = index.release(key(1), PA)  # every worker of A: the last claims, so the chunk goes
    assert len(released.released) == 1 and [k for k, _ in released.forgotten] == [key(1)] and evicted == [key(1)]
    index.pin([key(2)], owner=PB)  # pinned: it outlives A's claim until the pin goes
    assert index.release(key(2), PA).forgotten == [] and key(2) in index
    index.unpin([key(2)], owner=PB)
    assert [k for k, _ in index.forget_orphans()] == [key(2)]


def test_a_remove_of_a_put_in_flight_discards_it_only_with_its_last_claim() -> None:
    index: ChunkIndex[_Entry] = ChunkIndex(1000)
    index.reserve(key(1), _Entry(), A)
    assert index.claim(key(1), B)
    assert index.release(key(1), PA).discarded == [] and index.in_flight(key(1)) is not None
    assert len(index.release(key(1), PB).discarded) == 1 and index.in_flight(key(1)) is None


def test_another_domains_chunk_is_absent_and_cannot_be_replaced() -> None:
    index: ChunkIndex[_Entry] = ChunkIndex(1000)
    index.reserve(key(1), _Entry(101), A, domain="tenant-a")
    with pytest.raises(ForeignChunk, match="another sharing domain"):  # in flight: B cannot land in it
        index.claim(key(1), B, domain="tenant-b")
    assert index.commit(key(1)) and index.domain_of(key(1)) == "tenant-a"
    with pytest.raises(ForeignChunk):
        index.claim(key(1), B)  # the default domain is another domain too
    assert index.claimed_by(key(1)) == [A]
    assert index.contains_prefix([key(1)], "tenant-b") == 0 and index.contains_prefix([key(1)], "tenant-a") == 1
    assert index.touch(key(1), "tenant-b") is None and index.visible(key(1), "tenant-b") is None
    assert index.pin([key(1)], owner=PB, domain="tenant-b") == [] and not index.is_pinned(key(1))
    assert index.pin([key(1)], owner=PA, domain="tenant-a") == [key(1)]
    assert index.unpin([key(1)], owner=PA, domain="tenant-b") == []
    table = index.claim_table()
    assert table.domains == {key(1): "tenant-a"}
    copy: ChunkIndex[_Entry] = ChunkIndex(1000)
    copy.load(key(1), _Entry(101))
    copy.restore_claims(table)
    assert copy.domain_of(key(1)) == "tenant-a" and copy.contains_prefix([key(1)]) == 0
    index.unpin([key(1)], owner=PA, domain="tenant-a")
    index.release(key(1), PA)
    assert key(1) not in index and index.claim_table().domains == {}
    assert not index.claim(key(1), B, domain="tenant-b")  # gone: any domain may put it anew


def test_a_discarded_put_of_another_domain_is_not_revived() -> None:
    index: ChunkIndex[_Entry] = ChunkIndex(1000)
    index.reserve(key(1), _Entry(), A, domain="tenant-a")
    index.release(key(1), PA)  # discarded, but its bytes may still land
    with pytest.raises(ForeignChunk):
        index.revive(key(1), "tenant-b")
    assert index.revive(key(1), "tenant-a")
