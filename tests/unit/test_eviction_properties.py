"""Eviction policies against brute-force oracles, and the host pool's invariants under every policy.

The oracles keep every tracked slot with its ordering key in a plain dict and pick victims by
sorting: slow, obviously right. Hypothesis drives random sequences of insert / touch / remove /
evict (with random pins) through the real policy and the oracle side by side.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.eviction import ARCPolicy, LFUDAPolicy, eviction_policy_names, make_eviction_policy
from kvtier.tiers.host import HostSlabPool
from kvtier.tiers.lru import ByteLfuda, ByteLru, make_byte_index

CAPACITY = 6
# (op, slot, key or n, pinned-mask)
OPS = st.lists(st.tuples(st.sampled_from(["insert", "speculative", "touch", "remove", "evict"]), st.integers(0, CAPACITY - 1),
                         st.integers(0, 9), st.one_of(st.just(0), st.integers(0, (1 << CAPACITY) - 1))),
                  max_size=120)


class LruOracle:
    def __init__(self, capacity: int) -> None:
        self.last: Dict[int, int] = {}
        self.clock = 0

    def access(self, slot: int, key: Optional[int], speculative: bool = False) -> None:
        self.clock += 1  # LRU ignores speculative
        self.last[slot] = self.clock

    def touch(self, slot: int) -> None:
        self.access(slot, None)

    def order(self) -> List[int]:
        return sorted(self.last, key=self.last.__getitem__)

    def forget(self, slot: int, evicted: bool) -> None:
        del self.last[slot]


class LfudaOracle:
    """LFU-DA by its definition: priority = L + count at the last access, L = the last victim's."""

    def __init__(self, capacity: int) -> None:
        self.period = min(LFUDAPolicy.history_factor * capacity, LFUDAPolicy.history_max)
        self.counts: Dict[int, int] = {}
        self.samples = 0
        self.age = 0.0
        self.rank: Dict[int, tuple] = {}  # slot -> (priority, clock)
        self.keys: Dict[int, Optional[int]] = {}
        self.own: Dict[int, int] = {}
        self.clock = 0

    def access(self, slot: int, key: Optional[int], speculative: bool = False) -> None:
        self.keys[slot] = key
        if speculative:  # no access: the count stays (0 for new content)
            count = self.own.get(slot, 0) if key is None else self.counts.get(key, 0)
        elif key is None:
            count = self.own.get(slot, 0) + 1
        else:
            count = self.counts.get(key, 0) + 1
            self.counts[key] = count
            self.samples += 1
            if self.samples == self.period:
                self.samples = 0
                self.counts = {k: c // 2 for k, c in self.counts.items() if c // 2}
        self.own[slot] = count
        self.clock += 1
        self.rank[slot] = (self.age + count, self.clock)

    def touch(self, slot: int) -> None:
        self.access(slot, self.keys[slot])

    def order(self) -> List[int]:
        return sorted(self.rank, key=self.rank.__getitem__)

    def forget(self, slot: int, evicted: bool) -> None:
        if evicted:
            self.age = max(self.age, self.rank[slot][0])
        del self.rank[slot], self.keys[slot], self.own[slot]


ORACLES = {"lru": LruOracle, "lfuda": LfudaOracle}


def _run(name: str, ops, keyless: bool) -> None:
    policy = make_eviction_policy(name, CAPACITY)
    oracle = ORACLES[name](CAPACITY)
    tracked: Set[int] = set()
    for op, slot, arg, mask in ops:
        pinned = {s for s in range(CAPACITY) if mask >> s & 1}
        if op in ("insert", "speculative") and slot not in tracked:
            key = None if keyless else arg
            policy.insert(slot, key, speculative=op == "speculative")
            oracle.access(slot, key, speculative=op == "speculative")
            tracked.add(slot)
        elif op == "touch" and slot in tracked:
            policy.touch(slot)
            oracle.touch(slot)
        elif op == "remove" and slot in tracked:
            policy.remove(slot)
            oracle.forget(slot, evicted=False)
            tracked.discard(slot)
        elif op == "evict":
            n = arg % 4
            candidates = [s for s in oracle.order() if s not in pinned]
            victims = policy.evictable_victims(n, lambda s: s not in pinned)
            if len(candidates) < n:
                assert victims is None  # all or nothing: nothing changed
            else:
                assert victims == candidates[:n]
                for s in victims:
                    oracle.forget(s, evicted=True)
                    tracked.discard(s)
        assert len(policy) == len(tracked) and all(s in policy for s in tracked)
        assert not any(s in policy for s in set(range(CAPACITY)) - tracked)
    if hasattr(policy, "order"):
        assert policy.order() == oracle.order()


@settings(max_examples=300, deadline=None)
@given(OPS, st.booleans())
def test_lfuda_decides_as_its_definition(ops, keyless):
    _run("lfuda", ops, keyless)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_lru_decides_as_its_definition(ops):
    _run("lru", ops, False)


def test_lfuda_halves_its_history_and_remembers_evicted_counts():
    policy = LFUDAPolicy(2)
    policy.insert(0, "a")
    policy.touch(0)
    policy.touch(0)
    assert policy.count("a") == 3
    assert policy.evictable_victims(1, lambda s: True) == [0]
    assert policy.age == 3.0
    policy.insert(1, "a")  # back after eviction: its count goes on, above the age
    assert policy.count("a") == 4
    policy.insert(0, "b")
    assert policy.order() == [0, 1]  # b: 3 + 1 = 4 < a: 3 + 4 = 7
    for _ in range(2 * 40 - 5):  # the 80th access halves every count
        policy.touch(1)
    assert policy.count("a") == (4 + 75) // 2 and policy.count("b") == 0


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(eviction_policy_names()),
       st.lists(st.tuples(st.sampled_from(["store", "pin", "unpin", "touch", "release"]), st.integers(0, 30),
                          st.integers(1, 3)), max_size=80))
def test_the_host_pool_never_exceeds_capacity_evicts_no_pin_and_reports_every_eviction(name, ops):
    slots = 4
    pool = HostSlabPool(64, slots, eviction=name)
    owner_of: Dict[int, int] = {}  # slot -> chunk id the test stored there
    pins: Dict[int, int] = {}
    for op, chunk, n in ops:
        if op == "store":
            allocation = pool.allocate(n)
            if allocation is None:
                evictable = [s for s in owner_of if not pins.get(s)]
                assert n > slots - len(owner_of) + len(evictable)  # refused only when it cannot fit
                continue
            for slot, tag in allocation.evicted:
                assert not pins.get(slot), "a pinned slot was evicted"
                assert owner_of.pop(slot) == tag  # every eviction reported, with its owner
            for slot in allocation.slots:
                assert slot not in owner_of
                pool.set_owner(slot, chunk, key=chunk)
                pool.mark_evictable(slot, True)
                owner_of[slot] = chunk
        elif owner_of:
            slot = sorted(owner_of)[chunk % len(owner_of)]
            if op == "pin":
                pool.pin(slot)
                pins[slot] = pins.get(slot, 0) + 1
            elif op == "unpin" and pins.get(slot):
                pool.unpin(slot)
                pins[slot] -= 1
            elif op == "touch":
                pool.touch(slot)
            elif op == "release" and not pins.get(slot):
                pool.release(slot)
                del owner_of[slot]
        assert len(owner_of) <= slots and pool.num_free == slots - len(owner_of)
        pool.check()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "touch", "pop", "evict"]), st.integers(0, 7), st.integers(1, 30),
                          st.integers(0, 255)), max_size=100))
def test_byte_lfuda_chooses_and_ages_as_its_definition(ops):
    index = ByteLfuda(history=25)
    counts: Dict[int, int] = {}
    rank: Dict[int, tuple] = {}
    sizes: Dict[int, int] = {}
    state = {"age": 0.0, "clock": 0, "samples": 0}

    def access(key: int) -> None:
        nonlocal counts
        counts[key] = counts.get(key, 0) + 1
        state["samples"] += 1
        if state["samples"] == 25:
            state["samples"] = 0
            counts = {k: c // 2 for k, c in counts.items() if c // 2}
        state["clock"] += 1

    for op, key, size, mask in ops:
        if op == "put":
            index.put(key, size)
            sizes[key] = size
            c = counts.get(key, 0) + 1
            access(key)
            rank[key] = (state["age"] + c, state["clock"])
        elif op == "touch":
            assert index.touch(key) == (key in sizes)
            if key in sizes:
                c = counts.get(key, 0) + 1
                access(key)
                rank[key] = (state["age"] + c, state["clock"])
        elif op == "pop":
            assert index.pop(key) == sizes.pop(key, None)
            if key in rank:
                state["age"] = max(state["age"], rank.pop(key)[0])
        else:
            keep = {k for k in range(8) if mask >> k & 1}
            order = [k for k in sorted(rank, key=rank.__getitem__) if k not in keep]
            want, freed = [], 0
            for k in order:
                if freed >= size:
                    break
                want.append((k, sizes[k]))
                freed += sizes[k]
            got = index.choose_victims(size, keep)
            assert got == (want if freed >= size else None)  # and it changed nothing:
        assert list(index) == sorted(rank, key=rank.__getitem__)
        assert index.total_bytes == sum(sizes.values()) and len(index) == len(sizes)
        assert index.reconcile(dict(sizes), None) == []


def test_byte_index_names_and_errors():
    assert type(make_byte_index("lru")) is ByteLru and type(make_byte_index("lfuda", [(b"a", 3)])) is ByteLfuda
    with pytest.raises(ValueError, match=r"unknown disk eviction policy 'arc'; valid names: 'arc-lfuda', 'lfuda', 'lru'"):
        make_byte_index("arc")


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_arc_lfuda_decides_as_arc_with_speculative_content_first_in_t1(ops):
    """The oracle is ARC itself, with each speculative insertion moved to T1's cold end by hand."""
    policy, oracle = make_eviction_policy("arc-lfuda", CAPACITY), ARCPolicy(CAPACITY)
    assert policy.uses_speculative and not oracle.uses_speculative
    for op, slot, arg, pinned_mask in ops:
        pinned = {s for s in range(CAPACITY) if pinned_mask >> s & 1}
        if op in ("insert", "speculative") and slot not in oracle:
            policy.insert(slot, key=arg, speculative=op == "speculative")
            oracle.insert(slot, key=arg)
            if op == "speculative" and slot in oracle._t1:
                oracle._t1.move_to_end(slot, last=False)
        elif op == "touch" and slot in oracle:
            policy.touch(slot)
            oracle.touch(slot)
        elif op == "remove" and slot in oracle:
            policy.remove(slot)
            oracle.remove(slot)
        elif op == "evict":
            n = arg % 4
            victims = policy.evictable_victims(n, lambda s: s not in pinned)
            assert victims == oracle.evictable_victims(n, lambda s: s not in pinned)
            assert victims is None or not set(victims) & pinned
        assert policy.lists() == oracle.lists() and policy.target_t1_size == oracle.target_t1_size


def test_arc_lfuda_lets_a_speculative_tail_go_first_and_keeps_it_once_hit():
    policy = make_eviction_policy("arc-lfuda", 4)
    policy.insert(0, key="head")
    policy.insert(1, key="tail", speculative=True)
    policy.insert(2, key="next")
    assert policy.evictable_victims(1, lambda s: True) == [1]  # the newer but speculative tail
    policy.insert(1, key="tail2", speculative=True)
    policy.touch(1)  # a partial-prefix hit read it: T2, kept over the T1 chunks
    assert policy.evictable_victims(2, lambda s: True) == [0, 2]
