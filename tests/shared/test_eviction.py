"""Eviction policies (shared/eviction/): each policy's victim order, pins exempt and nested, TTL pins expiring on an
injected clock (no sleeping), refusals that change nothing, the factory, and every policy against a naive model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvmesh.shared.eviction import (POLICY_NAMES, EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy, MRUPolicy,
                                    make_policy)

from support.waiting import ManualClock


def filled(name: str, capacity: int, keys: str, size: int = 10, clock: ManualClock | None = None) -> EvictionPolicy:
    policy = make_policy(name, capacity, clock or ManualClock())
    for key in keys:
        assert policy.victims_for(size) == []
        policy.add(key, size)
    return policy


def snapshot(policy: EvictionPolicy) -> tuple[object, ...]:
    return (len(policy), policy.used_bytes, policy.keys(), sorted(policy.pins()))


# Four keys arrive a, b, c, d; then hits on a, a, c, b. Counts a=3, b=2, c=2, d=1; last use d < a < c < b.
HITS = "aacb"
ORDER = {
    "LRU": ["d", "a", "c", "b"],  # least recent first
    "MRU": ["b", "c", "a", "d"],  # most recent first
    "FIFO": ["a", "b", "c", "d"],  # arrival order, hits ignored
    "LFU": ["d", "c", "b", "a"],  # fewest uses first; c and b tie at 2, c was used less recently
}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_victim_order_after_adds_and_hits(name: str) -> None:
    policy = filled(name, 40, "abcd")
    for key in HITS:
        policy.touch(key)
    assert policy.evictable() == ORDER[name]
    assert policy.victims_for(10) == ORDER[name][:1]
    assert policy.victims_for(25) == ORDER[name][:3]  # 25 more bytes: three 10-byte victims
    assert policy.victims_for(40) == ORDER[name]
    assert policy.victims_for(0) == []  # full but not over: nothing to evict


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_add_new_in_bulk_is_add_of_each(name: str) -> None:
    """A store's start loads its chunks in bulk (`add_new`): the same state, and the same answers after hits."""
    one_by_one = filled(name, 100, "abcd", size=7)
    bulk = make_policy(name, 100, ManualClock())
    bulk.add_new(list("abcd"), [7] * 4)
    assert snapshot(bulk) == snapshot(one_by_one)
    for policy in (one_by_one, bulk):
        for key in HITS:
            policy.touch(key)
    assert snapshot(bulk) == snapshot(one_by_one) and bulk.victims_for(90) == one_by_one.victims_for(90)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_adding_a_held_key_is_a_hit(name: str) -> None:
    touched, added = filled(name, 40, "abcd"), filled(name, 40, "abcd")
    touched.touch("a")
    added.add("a", 10)
    assert added.evictable() == touched.evictable() and added.used_bytes == 40


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_pinned_keys_are_never_victims_and_pins_nest(name: str) -> None:
    policy = filled(name, 40, "abcd")
    for key in HITS:
        policy.touch(key)
    first = ORDER[name][0]
    assert policy.pin(first) and policy.pin(first)  # nested
    assert policy.victims_for(40) is None  # 10 pinned bytes + 40 > 40
    assert policy.victims_for(30) == [k for k in ORDER[name] if k != first]
    assert policy.keys()[0] == first and policy.pinned_count == 1
    assert policy.unpin(first) and policy.is_pinned(first)  # one pin left
    assert first not in policy.victims_for(30)
    assert policy.unpin(first) and not policy.is_pinned(first)
    assert not policy.unpin(first) and not policy.pin("zz")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ttl_pins_expire_on_the_injected_clock(name: str) -> None:
    clock = ManualClock()
    policy = filled(name, 20, "ab", clock=clock)
    assert policy.pin("a", ttl_secs=5.0) and policy.pin("b")  # "b" until unpinned
    assert sorted(policy.pins()) == [("a", 1, 5.0), ("b", 1, None)]
    assert policy.victims_for(10) is None
    clock.advance(4.5)
    assert policy.is_pinned("a") and policy.victims_for(10) is None
    assert [left for key, _, left in policy.pins() if key == "a"] == [0.5]
    clock.advance(0.5)  # expiry reached
    assert not policy.is_pinned("a") and policy.is_pinned("b")
    assert policy.victims_for(10) == ["a"] and [key for key, _, _ in policy.pins()] == ["b"]
    assert not policy.unpin("a")  # nothing left to unpin


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_nested_ttl_pins_keep_the_latest_expiry_and_none_beats_any(name: str) -> None:
    clock = ManualClock()
    policy = filled(name, 30, "abc", clock=clock)
    policy.pin("a", ttl_secs=5.0)
    policy.pin("a", ttl_secs=2.0)  # an earlier expiry does not shorten the pin
    policy.pin("b", ttl_secs=1.0)
    policy.pin("b")  # no TTL: until unpinned
    clock.advance(3.0)
    assert policy.is_pinned("a") and policy.is_pinned("b")
    clock.advance(2.0)
    assert not policy.is_pinned("a") and policy.is_pinned("b")
    assert policy.victims_for(20) is not None and "b" not in policy.victims_for(20)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_refusal_when_pinned_bytes_leave_no_room_changes_nothing(name: str) -> None:
    policy = filled(name, 30, "abc")
    policy.touch("b")
    policy.pin("a")
    policy.pin("c", ttl_secs=60.0)
    before = snapshot(policy)
    assert policy.victims_for(21) is None  # 20 pinned + 21 > 30
    assert policy.victims_for(31) is None  # larger than the whole capacity
    assert snapshot(policy) == before
    assert policy.victims_for(10) == ["b"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_remove_frees_pinned_or_not(name: str) -> None:
    policy = filled(name, 30, "abc")
    policy.pin("b")
    assert policy.remove("a") == 10 and policy.remove("b") == 10 and policy.remove("zz") == 0
    assert policy.used_bytes == 10 and len(policy) == 1 and policy.keys() == ["c"] and policy.pinned_count == 0
    assert policy.victims_for(20) == [] and policy.victims_for(30) == ["c"] and policy.victims_for(31) is None


def test_last_unpin_is_a_new_arrival() -> None:
    lru, fifo, mru = (filled(name, 30, "abc") for name in ("LRU", "FIFO", "MRU"))
    for policy in (lru, fifo, mru):
        policy.pin("a")
        policy.unpin("a")
    assert lru.evictable() == ["b", "c", "a"]  # most recent now
    assert fifo.evictable() == ["b", "c", "a"]  # back of the queue: pinned time does not age a chunk
    assert mru.evictable() == ["a", "c", "b"]


def test_lfu_counts_survive_a_pin_and_hits_while_pinned_count() -> None:
    policy = filled("LFU", 30, "abc")
    policy.touch("b")  # b=2
    policy.pin("a")
    policy.touch("a")
    policy.touch("a")  # a=3 while pinned
    policy.unpin("a")
    assert policy.evictable() == ["c", "b", "a"]
    policy.remove("a")
    policy.add("a", 10)  # added again: starts over at 1, newest among equals
    assert policy.evictable() == ["c", "a", "b"]


def test_factory_names_are_case_insensitive_and_errors_name_the_key() -> None:
    classes = {"lru": LRUPolicy, "Lfu": LFUPolicy, "fifo": FIFOPolicy, " MRU ": MRUPolicy}
    for name, cls in classes.items():
        policy = make_policy(name, 1)
        assert type(policy) is cls and policy.name == name.strip().upper() and policy.capacity_bytes == 1
    assert POLICY_NAMES == ("LRU", "LFU", "FIFO", "MRU")
    with pytest.raises(ValueError, match=r"cache_policy: unknown eviction policy 'ARC' \(known: LRU, LFU, FIFO, MRU\)"):
        make_policy("ARC", 1)


# ---- every policy against a naive model ---------------------------------------------------------------------
@dataclass
class _Model:
    """Reference semantics, computed by sorting: what each policy's victim order must equal."""

    name: str
    tick: int = 0
    arrived: dict[str, int] = field(default_factory=dict)  # unpinned key -> arrival tick
    used: dict[str, int] = field(default_factory=dict)  # unpinned key -> last arrival or hit
    uses: dict[str, int] = field(default_factory=dict)  # held key -> count (LFU)
    pins: dict[str, int] = field(default_factory=dict)

    def _now(self) -> int:
        self.tick += 1
        return self.tick

    def add(self, key: str) -> None:
        if key in self.uses:
            self.touch(key)
            return
        self.uses[key] = 1
        self.arrived[key] = self.used[key] = self._now()

    def touch(self, key: str) -> None:
        if key in self.used:
            self.used[key] = self._now()
            self.uses[key] += 1
        elif key in self.pins:
            self.uses[key] += 1

    def pin(self, key: str) -> None:
        if key in self.uses:
            self.pins[key] = self.pins.get(key, 0) + 1
            self.arrived.pop(key, None)
            self.used.pop(key, None)

    def unpin(self, key: str) -> None:
        if key in self.pins:
            self.pins[key] -= 1
            if not self.pins[key]:
                del self.pins[key]
                self.arrived[key] = self.used[key] = self._now()

    def remove(self, key: str) -> None:
        for table in (self.arrived, self.used, self.uses, self.pins):
            table.pop(key, None)

    def order(self) -> list[str]:
        rank = {"LRU": lambda k: self.used[k], "MRU": lambda k: -self.used[k], "FIFO": lambda k: self.arrived[k],
                "LFU": lambda k: (self.uses[k], self.used[k])}[self.name]
        return sorted(self.used, key=rank)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_random_operations_match_the_model(name: str) -> None:
    rng = random.Random(f"eviction-{name}")
    policy = make_policy(name, 10**9, ManualClock())
    model = _Model(name)
    keys = [f"k{i}" for i in range(12)]
    for _ in range(3000):
        op, key = rng.choice(["add", "add", "touch", "touch", "touch", "pin", "unpin", "remove"]), rng.choice(keys)
        if op == "add":
            policy.add(key, 1)
        else:
            getattr(policy, op)(key)
        getattr(model, op)(key)
        assert policy.evictable() == model.order(), (op, key)
        assert sorted(k for k, _, _ in policy.pins()) == sorted(model.pins)
        assert policy.used_bytes == len(model.uses)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_the_first_eligible_victim_is_found_without_walking_the_whole_order(name: str) -> None:
    """A full CPU tier makes room one victim at a time (LocalCPUBackend.allocate): each search stops at the first
    key it may take, so an admission into a full pool costs the keys passed over, not the keys held."""
    policy = make_policy(name, 10 ** 9)
    for i in range(1000):
        policy.add(i, 1)
    order = policy.evictable()
    asked: list[int] = []

    def eligible(key: int) -> bool:
        asked.append(key)
        return key not in order[:3]  # the first three are busy (their slots held by readers)

    assert policy.first_victim(eligible) == order[3] and asked == order[:4]
    assert policy.first_victim(lambda key: False) is None


# ---- retention: a request's kv_priority and lease ---------------------------------------------------------------
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_leased_key_outlives_unleased_ones_until_its_lease_ends(name: str) -> None:
    clock = ManualClock()
    policy = filled(name, 40, "abcd", clock=clock)
    first = policy.evictable()[0]  # the key the policy would take first
    assert policy.retain(first, "engine.x", 20, lease_secs=30.0)
    assert policy.is_retained(first) and policy.retained_bytes("engine.x") == 10
    others = [key for key in "abcd" if key != first]
    # every unleased key goes first, whatever the policy's order says
    assert policy.victims_for(40) == [*[k for k in policy.evictable() if k != first], first]
    assert policy.evictable()[-1] == first and set(policy.evictable()[:3]) == set(others)
    assert policy.victims_for(30) is not None and first not in policy.victims_for(30)
    clock.advance(29.9)
    assert policy.evictable()[-1] == first
    clock.advance(0.2)  # the lease ended: an ordinary key again (a new arrival), counted for no one
    assert not policy.is_retained(first) and policy.retained_bytes("engine.x") == 0
    assert first in policy.evictable() and len(policy.evictable()) == 4


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_higher_priority_is_kept_longer_and_lasts_while_held(name: str) -> None:
    clock = ManualClock()
    policy = filled(name, 50, "abcde", clock=clock)
    assert policy.retain("a", "engine.x", 50, priority=5)
    assert policy.retain("b", "engine.x", 50, priority=1)
    assert policy.retain("c", "engine.x", 50, priority=1, lease_secs=10.0)
    order = policy.evictable()
    assert set(order[:2]) == {"d", "e"} and order[2:] == ["b", "c", "a"]  # unleased before leased at one priority
    clock.advance(3600)
    assert policy.evictable()[2:] == ["b", "c", "a"]  # priorities stay; c's lease ended, its priority did not
    victims = policy.victims_for(30)
    assert victims is not None and set(victims[:2]) == {"d", "e"} and victims[2] == "b"
    assert not policy.retain("d", "engine.x", 50)  # nothing to keep it for
    assert policy.remove("a") == 10 and policy.retained_bytes("engine.x") == 20


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_one_owner_never_retains_more_than_its_bound(name: str) -> None:
    policy = filled(name, 60, "abcdef")
    assert policy.retain("a", "engine.x", 20, lease_secs=60.0)
    assert policy.retain("b", "engine.x", 20, priority=3)
    assert not policy.retain("c", "engine.x", 20, lease_secs=60.0)  # 30 bytes would pass its 20
    assert not policy.is_retained("c") and policy.retained_bytes("engine.x") == 20
    assert policy.retain("a", "engine.x", 20, priority=2)  # a key it retains already: no more bytes
    assert policy.retain("c", "engine.y", 20, lease_secs=60.0)  # another owner has its own bound
    assert set(policy.evictable()[:3]) == {"d", "e", "f"}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_retention_and_pins_together(name: str) -> None:
    """A pinned key is never a victim; retained and pinned, it returns to the retained keys when its pin goes,
    and its pin expiring after its lease makes it an ordinary key again."""
    clock = ManualClock()
    policy = filled(name, 30, "abc", clock=clock)
    assert policy.pin("a", ttl_secs=20.0)
    assert policy.retain("a", "engine.x", 30, lease_secs=10.0)
    assert "a" not in policy.evictable() and policy.retained_bytes("engine.x") == 10
    assert policy.retain("b", "engine.x", 30, lease_secs=50.0)
    assert policy.pin("b") and policy.unpin("b")
    assert policy.evictable() == ["c", "b"]
    clock.advance(25)  # a's lease ended (10 s), then its pin (20 s)
    assert set(policy.evictable()) == {"a", "b", "c"} and policy.evictable()[-1] == "b"
    assert policy.retained_bytes("engine.x") == 10
    assert len(policy) == 3 and policy.used_bytes == 30


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_random_operations_with_retention_keep_the_invariants(name: str) -> None:
    """Adds, hits, pins, removals, retentions of two owners and time passing, at random: every unpinned
    unretained key comes before every retained one in the victim order, and each owner's retained bytes are
    exactly its retained keys' and never over its bound."""
    rng = random.Random(f"retention-{name}")
    clock = ManualClock()
    policy = make_policy(name, 10**9, clock)
    keys = [f"k{i}" for i in range(16)]
    bound = 50
    owners: dict[str, str] = {}  # retained key -> owner, as the test gave them
    for _ in range(3000):
        op, key = rng.choice(["add", "add", "touch", "pin", "unpin", "remove", "retain", "retain", "tick"]), \
            rng.choice(keys)
        if op == "add":
            policy.add(key, 10)
        elif op == "retain":
            owner = rng.choice(["engine.a", "engine.b"])
            if policy.retain(key, owner, bound, rng.choice([0, 0, 1, 3]), rng.choice([None, 5.0, 50.0])):
                owners.setdefault(key, owner)
        elif op == "tick":
            clock.advance(rng.choice([1.0, 10.0]))
        else:
            getattr(policy, op)(key)
        order = policy.evictable()
        retained = [policy.is_retained(k) for k in order]
        assert retained == sorted(retained), (op, key)  # no retained key before an unretained one
        for key_ in list(owners):
            if not policy.is_retained(key_):
                del owners[key_]
        for owner in ("engine.a", "engine.b"):
            held = 10 * sum(1 for o in owners.values() if o == owner)
            assert policy.retained_bytes(owner) == held <= bound, (op, key, owner)
        assert policy.used_bytes == 10 * len(policy) and len(set(policy.keys())) == len(policy)
