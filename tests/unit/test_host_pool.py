"""Host slab pool and its eviction policies: small narrated scenarios with tiny capacities."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.errors import ClosedError, DeviceError
from kvtier.tiers.eviction import (
    ARCPolicy,
    LRUPolicy,
    eviction_policy_names,
    make_eviction_policy,
)
from kvtier.tiers.host import Allocation, HostSlabPool, SlotStateError

SLOT = 64


def make_pool(num_slots: int = 4, eviction: str = "lru") -> HostSlabPool:
    return HostSlabPool(SLOT, num_slots, eviction=eviction)


def fill(pool: HostSlabPool, owners: list, evictable: bool = True) -> list:
    """Allocate one slot per owner tag, like the engine after a store completes."""
    slots = []
    for tag in owners:
        allocation = pool.allocate()
        assert allocation is not None and allocation.evicted == []
        (slot,) = allocation.slots
        pool.set_owner(slot, tag)
        pool.mark_evictable(slot, evictable)
        slots.append(slot)
    return slots


# -- construction -----------------------------------------------------------------------------


def test_slab_is_preallocated_zeroed_and_slots_are_views() -> None:
    pool = make_pool(3)
    assert pool.num_free == 3
    slots = pool.allocate(3).slots
    assert sorted(slots) == [0, 1, 2]
    for slot in slots:
        view = pool.view(slot)
        assert view.dtype == torch.uint8 and view.numel() == SLOT
        assert int(view.count_nonzero()) == 0  # pre-faulted with zeros
    # Writing through a view lands in the slab: no copy in between.
    pool.view(slots[1]).fill_(7)
    assert int(pool.view(slots[1]).sum()) == 7 * SLOT
    assert int(pool.view(slots[0]).sum()) == 0
    assert pool.view(0).data_ptr() + SLOT == pool.view(1).data_ptr()
    assert pool.view(0).data_ptr() % 4096 == 0  # page-aligned slab
    buf = pool.buffer(slots[1])
    assert isinstance(buf, memoryview) and not buf.readonly and bytes(buf[:2]) == b"\x07\x07"
    pool.check()


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="slot_bytes must be a positive int"):
        HostSlabPool(0, 4)
    with pytest.raises(ValueError, match="num_slots must be a positive int"):
        HostSlabPool(SLOT, -1)
    pool = make_pool()
    with pytest.raises(ValueError, match="n must be a positive int"):
        pool.allocate(0)
    with pytest.raises(ValueError, match=r"slot must be an int in \[0, 4\)"):
        pool.pin(4)


def test_unknown_policy_name_lists_valid_names() -> None:
    assert eviction_policy_names() == ("arc", "arc-lfuda", "lfuda", "lru")
    expected = r"unknown eviction policy 'fifo'; valid names: 'arc', 'arc-lfuda', 'lfuda', 'lru'"
    with pytest.raises(ValueError, match=expected):
        HostSlabPool(SLOT, 4, eviction="fifo")
    with pytest.raises(ValueError, match="valid names: 'arc', 'arc-lfuda', 'lfuda', 'lru'"):
        make_eviction_policy("LRU", 4)
    assert isinstance(make_eviction_policy("lru", 2), LRUPolicy)
    assert isinstance(make_eviction_policy("arc", 2), ARCPolicy)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        make_eviction_policy("arc", 0)


def test_cuda_without_gpu_is_a_device_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the missing-GPU path cannot be exercised")
    expected = r"'cuda' requested but torch.cuda.is_available\(\) is False"
    with pytest.raises(DeviceError, match=expected):
        HostSlabPool(SLOT, 4, device_kind="cuda")


# -- exhaustion and release -------------------------------------------------------------------


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_exhaustion_returns_none_fast_and_changes_nothing(eviction: str) -> None:
    pool = make_pool(4, eviction)
    slots = fill(pool, ["a", "b", "c", "d"], evictable=False)  # e.g. still PENDING
    before = pool.statistics()
    started = time.perf_counter()
    for _ in range(1000):
        assert pool.allocate() is None
    per_call = (time.perf_counter() - started) / 1000
    assert per_call < 50e-6, f"a refused allocate took {per_call * 1e6:.1f} us"
    after = pool.statistics()
    assert after["allocation_failures"] == before["allocation_failures"] + 1000
    for key in ("free_slots", "used_slots", "evictions", "evictable_slots", "allocations"):
        assert after[key] == before[key]
    assert [pool.owner(s) for s in slots] == ["a", "b", "c", "d"]
    pool.check()


def test_release_recovers_a_slot() -> None:
    pool = make_pool(2)
    first, second = fill(pool, ["a", "b"], evictable=False)
    assert pool.allocate() is None
    pool.release(first)
    assert pool.num_free == 1
    allocation = pool.allocate()
    assert allocation == Allocation(slots=[first], evicted=[])
    assert pool.owner(first) is None  # a reused slot starts clean
    assert pool.statistics()["releases"] == 1
    pool.check()


def test_all_or_nothing_allocate_reports_evicted_owners() -> None:
    pool = make_pool(4)
    a, b, c, d = fill(pool, ["a", "b", "c", "d"])
    pool.mark_evictable(c, False)
    pool.pin(d)
    # Need 3, only a and b can go: refused, and a and b are still there.
    assert pool.allocate(3) is None
    assert pool.owner(a) == "a" and pool.owner(b) == "b"
    assert pool.num_evictable == 2
    # Need 2: both go, reported with their owners in eviction (LRU) order.
    allocation = pool.allocate(2)
    assert allocation is not None
    assert allocation.evicted == [(a, "a"), (b, "b")]
    assert sorted(allocation.slots) == sorted([a, b])
    assert pool.num_free == 0 and pool.num_evictable == 0
    assert pool.statistics()["evictions"] == 2
    pool.check()


def test_free_slots_are_used_before_evicting() -> None:
    pool = make_pool(3)
    fill(pool, ["a", "b"])
    allocation = pool.allocate(2)  # one free + one victim
    assert allocation is not None and allocation.evicted == [(0, "a")]
    assert sorted(allocation.slots) == [0, 2]
    pool.check()


# -- eviction order ---------------------------------------------------------------------------


def test_lru_evicts_least_recently_touched() -> None:
    pool = make_pool(3, "lru")
    a, b, c = fill(pool, ["a", "b", "c"])
    pool.touch(a)  # order, coldest first: b, c, a
    assert pool.allocate().evicted == [(b, "b")]
    pool.touch(c)  # a, <new>, c
    assert pool.allocate().evicted == [(a, "a")]


def test_lru_evicts_the_once_touched_hot_slot_during_a_scan() -> None:
    # The baseline the ARC test below contrasts with.
    pool = make_pool(4, "lru")
    hot = fill(pool, ["hot"])[0]
    pool.touch(hot)
    pool.touch(hot)
    fill(pool, ["s0", "s1", "s2"])
    allocation = pool.allocate()
    assert allocation.evicted == [(hot, "hot")]


def test_arc_keeps_a_frequent_slot_through_a_scan() -> None:
    pool = make_pool(4, "arc")
    hot = fill(pool, ["hot"])[0]
    pool.touch(hot)  # seen twice: moves to ARC's frequency list T2
    fill(pool, ["s0", "s1", "s2"])
    # A long scan of chunks stored once and never read again: LRU would evict "hot" first.
    evicted_tags = []
    for i in range(3, 20):
        allocation = pool.allocate()
        assert allocation is not None
        evicted_tags += [tag for _, tag in allocation.evicted]
        (slot,) = allocation.slots
        pool.set_owner(slot, f"s{i}")
        pool.mark_evictable(slot)
    assert "hot" not in evicted_tags
    assert evicted_tags == [f"s{i}" for i in range(17)]
    assert pool.owner(hot) == "hot"
    pool.check()


def test_arc_ghost_hit_adapts_target_and_promotes() -> None:
    policy = ARCPolicy(2)
    policy.insert(0, key="a")
    policy.insert(1, key="b")
    policy.touch(1)  # b frequent
    assert policy.evictable_victims(1, lambda s: True) == [0]  # a leaves T1 into ghost B1
    assert policy.lists() == {"t1": [], "t2": [1], "b1": ["a"], "b2": []}
    assert policy.target_t1_size == 0
    # "a" comes back (e.g. loaded from disk): T1 was too small, so p grows and a joins T2.
    policy.insert(0, key="a")
    assert policy.target_t1_size == 1
    assert policy.lists()["t2"] == [1, 0] and policy.lists()["b1"] == []
    # Both in T2 now, T1 empty: the victim is T2's least recent, remembered in B2.
    assert policy.evictable_victims(1, lambda s: True) == [1]
    assert policy.lists()["b2"] == ["b"]
    policy.insert(1, key="b")  # ghost hit in B2: p shrinks back
    assert policy.target_t1_size == 0


class Entry:
    """Like the engine's chunk entries: compared by value, so unhashable."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and other.key == self.key

    __hash__ = None  # type: ignore[assignment]


def test_arc_ghost_hit_through_the_pool_uses_the_content_key() -> None:
    pool = make_pool(2, "arc")
    first = Entry(b"a")
    (slot_a,) = pool.allocate().slots
    pool.set_owner(slot_a, first, key=first.key)
    pool.mark_evictable(slot_a)
    (slot_b,) = pool.allocate().slots
    pool.set_owner(slot_b, Entry(b"b"))  # unhashable tag, no key: no ghost history, no error
    pool.mark_evictable(slot_b)
    allocation = pool.allocate()
    assert allocation.evicted == [(slot_a, first)]
    assert pool.policy.lists()["b1"] == [b"a"]
    # Chunk "a" comes back in a new entry object: the content key finds the ghost.
    pool.set_owner(allocation.slots[0], Entry(b"a"), key=b"a")
    assert pool.policy.target_t1_size == 1
    assert pool.policy.lists()["t2"] == [allocation.slots[0]]
    pool.check()


def test_arc_falls_back_to_the_other_list_when_preferred_is_pinned() -> None:
    policy = ARCPolicy(3)
    for slot in range(3):
        policy.insert(slot, key=slot)
    policy.touch(2)  # T1 = [0, 1], T2 = [2]
    # T1 is preferred (|T1| > p = 0) but both of its slots are pinned: T2 gives the victim.
    assert policy.evictable_victims(1, lambda s: s == 2) == [2]
    assert policy.evictable_victims(3, lambda s: True) is None  # only 2 tracked: no change
    assert len(policy) == 2


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_pinned_slots_are_never_evicted(eviction: str) -> None:
    pool = make_pool(4, eviction)
    slots = fill(pool, ["a", "b", "c", "d"])
    pinned = slots[0]
    pool.pin(pinned)
    pool.pin(pinned)  # two readers
    seen = []
    for i in range(12):
        allocation = pool.allocate()
        assert allocation is not None
        seen += [slot for slot, _ in allocation.evicted]
        pool.set_owner(allocation.slots[0], f"n{i}")
        pool.mark_evictable(allocation.slots[0])
        pool.touch(allocation.slots[0])
    assert pinned not in seen
    pool.unpin(pinned)
    assert pinned not in [s for s, _ in pool.allocate(3).evicted]  # still one pin left
    pool.unpin(pinned)
    allocation = pool.allocate(1)
    assert allocation.evicted == [(pinned, "a")]
    pool.check()


def test_all_pinned_means_none() -> None:
    pool = make_pool(2)
    for slot in fill(pool, ["a", "b"]):
        pool.pin(slot)
    assert pool.num_evictable == 0
    assert pool.allocate() is None
    pool.check()


# -- misuse -----------------------------------------------------------------------------------


def test_release_and_unpin_misuse_raise_with_message() -> None:
    pool = make_pool(2)
    (slot,) = fill(pool, ["a"])
    pool.pin(slot)
    with pytest.raises(SlotStateError, match=r"cannot release slot 0: pinned 1 time\(s\)"):
        pool.release(slot)
    pool.unpin(slot)
    with pytest.raises(SlotStateError, match="cannot unpin slot 0: it is not pinned"):
        pool.unpin(slot)
    pool.release(slot)
    with pytest.raises(SlotStateError, match="cannot release slot 0: it is free"):
        pool.release(slot)
    with pytest.raises(SlotStateError, match="cannot pin slot 0: it is free"):
        pool.pin(slot)
    with pytest.raises(SlotStateError, match="cannot view slot 1: it is free"):
        pool.view(1)
    pool.check()


def test_closed_pool_refuses_allocation() -> None:
    pool = make_pool(2)
    view = pool.allocate().slots
    pool.close()
    pool.close()  # idempotent
    assert pool.closed
    with pytest.raises(ClosedError):
        pool.allocate()
    with pytest.raises(ClosedError):
        pool.view(view[0])


def test_statistics_counts() -> None:
    pool = make_pool(2, "arc")
    fill(pool, ["a", "b"])
    pool.pin(0)
    pool.allocate()
    stats = pool.statistics()
    assert stats["slots"] == 2 and stats["capacity_bytes"] == 2 * SLOT
    assert stats["used_slots"] == 2 and stats["free_slots"] == 0
    assert stats["pinned_slots"] == 1 and stats["evictions"] == 1
    assert stats["allocations"] == 3 and stats["page_locked"] == 0


def test_slots_of_segment_sized_chunks_start_on_page_boundaries() -> None:
    """Slots of at least PAGE_ALIGNED_SLOT_MIN_BYTES start on a page boundary whatever their size
    (direct I/O straight from and into them); smaller slots are packed; views are exactly
    slot_bytes and never overlap."""
    from kvtier.tiers.host import PAGE_ALIGNED_SLOT_MIN_BYTES, slot_stride

    for slot_bytes in (100, 4096, PAGE_ALIGNED_SLOT_MIN_BYTES - 1, PAGE_ALIGNED_SLOT_MIN_BYTES, 100_000, 1 << 20):
        pool = HostSlabPool(slot_bytes, 5)
        views = [pool.view(s) for s in pool.allocate(5).slots]
        starts = sorted(v.data_ptr() for v in views)
        assert all(v.numel() == slot_bytes for v in views)
        assert all(b - a == slot_stride(slot_bytes) for a, b in zip(starts, starts[1:]))
        assert slot_stride(slot_bytes) >= slot_bytes
        if slot_bytes >= PAGE_ALIGNED_SLOT_MIN_BYTES:
            assert all(p % 4096 == 0 for p in starts)
            assert slot_stride(slot_bytes) - slot_bytes < 4096
        else:
            assert slot_stride(slot_bytes) == slot_bytes
        for v in views:
            v.fill_(7)
        assert all(int(v.sum()) == 7 * slot_bytes for v in views)
        pool.close()


def test_pools_for_budget_split_in_proportion_within_the_budget_with_a_floor() -> None:
    from kvtier.tiers.host import pools_for_budget, slot_stride

    chunk_bytes = [100_000, 4096, 1 << 20]
    budget = 64 << 20
    pools = pools_for_budget(budget, chunk_bytes)
    total = sum(chunk_bytes)
    for pool, nbytes in zip(pools, chunk_bytes):
        assert pool.slot_bytes == nbytes
        assert pool.num_slots == max(4, (budget * nbytes // total) // slot_stride(nbytes))
    # the slabs (slot strides included) stay within the budget, floors aside
    assert sum(p.num_slots * slot_stride(n) for p, n in zip(pools, chunk_bytes) if p.num_slots > 4) <= budget
    assert [p.num_slots for p in pools_for_budget(1, [100, 200])] == [4, 4]
    for p in pools:
        p.close()


def _gpt_oss_like(extra: int = 0):
    """A full-attention group of 512-token chunks and a W=128 group of 16-token chunks."""
    from kvtier.policy import AttentionGroup, ModelLayout

    return ModelLayout((AttentionGroup(16, blocks_per_chunk=32), AttentionGroup(16, sliding_window=128,
                                                                                   extra_retained_tokens=extra)))


def test_host_split_weights_are_the_bytes_each_group_stores_per_token() -> None:
    from kvtier.tiers.host import host_slot_counts, host_split_weights

    chunk_bytes = [32768, 1024]  # the same bytes per token in both groups
    # Dense (every 512-token boundary of the 8192-token sample): full attention stores its 16
    # chunks, the sliding group the 8 blocks of the 127-token window at each of 16 boundaries.
    assert host_split_weights(_gpt_oss_like(), chunk_bytes, None) == [16 * 32768 / 8192, 128 * 1024 / 8192]
    # R = 3 widens the window to 130 tokens: a ninth block per boundary.
    assert host_split_weights(_gpt_oss_like(3), chunk_bytes, None) == [64.0, 16 * 9 * 1024 / 8192]
    # Only the final boundary (interval 0): one window per prompt; every 1024 tokens: eight.
    assert host_split_weights(_gpt_oss_like(), chunk_bytes, 0) == [64.0, 8 * 1024 / 8192]
    assert host_split_weights(_gpt_oss_like(), chunk_bytes, 1024) == [64.0, 64 * 1024 / 8192]
    # So a dense sliding pool gets a fifth of the budget and 8x the full pool's slots, where the
    # split by chunk bytes alone gave both pools the same count.
    budget = 100 * 32768
    assert host_slot_counts(budget, chunk_bytes, host_split_weights(_gpt_oss_like(), chunk_bytes, None)) == [80, 640]
    assert host_slot_counts(budget, chunk_bytes) == [96, 96]
    with pytest.raises(ValueError, match="weights must be one share >= 0 per group"):
        host_slot_counts(budget, chunk_bytes, [1.0])
    with pytest.raises(ValueError, match="weights must be one share >= 0 per group"):
        host_slot_counts(budget, chunk_bytes, [0.0, 0.0])


def test_pools_for_budget_takes_weights() -> None:
    from kvtier.tiers.host import pools_for_budget

    pools = pools_for_budget(100 * 32768, [32768, 1024], weights=[64.0, 16.0])
    try:
        assert [(p.slot_bytes, p.num_slots) for p in pools] == [(32768, 80), (1024, 640)]
    finally:
        for p in pools:
            p.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("retention", [None, 0])
async def test_the_engine_splits_its_host_budget_by_stored_bytes_per_token(retention) -> None:
    from kvtier.engine import EngineConfig, OffloadEngine
    from kvtier.tiers.host import host_slot_counts, host_split_weights
    from kvtier.tools.testing.scenario import make_cpu_device

    layout = _gpt_oss_like()
    device = make_cpu_device(layout)
    sizes = [device.chunk_nbytes(0), device.chunk_nbytes(1)]
    budget = 200 * sizes[0]
    config = EngineConfig(host_capacity_bytes=budget, store_retention_interval_tokens=retention,
                          pressure_poll_interval_s=3600.0)
    async with OffloadEngine(layout, device, config, fingerprint=b"split") as engine:
        counts = [p.num_slots for p in engine.host.pools]
    assert counts == host_slot_counts(budget, sizes, host_split_weights(layout, sizes, retention))
    assert counts[1] > 2 * counts[0] if retention is None else counts[1] < counts[0]


def test_batch_unpin_and_mark_evictable_keep_the_counts_of_one_call_each() -> None:
    # A store's completion: slots pinned for the copy, unpinned and marked evictable in one call each.
    pool, twin = make_pool(4), make_pool(4)
    slots, twin_slots = pool.allocate(3).slots, twin.allocate(3).slots
    for p, ss in ((pool, slots), (twin, twin_slots)):
        for s in ss:
            p.pin(s)
        p.pin(ss[0])  # a second reader of the first slot
    pool.unpin_many(slots)
    pool.mark_evictable_many(slots)
    for s in twin_slots:
        twin.unpin(s)
        twin.mark_evictable(s, True)
    assert pool.statistics() == twin.statistics()
    assert pool.statistics()["pinned_slots"] == 1 and pool.statistics()["evictable_slots"] == 2
    assert [pool.pin_count(s) for s in slots] == [1, 0, 0]
    pool.unpin_many([slots[0]])
    assert pool.statistics()["evictable_slots"] == 3
    # A refused slot raises unpin's own error; the slots before it were unpinned.
    pool.pin(slots[1])
    with pytest.raises(SlotStateError, match="cannot unpin slot .*: it is not pinned"):
        pool.unpin_many([slots[1], slots[2]])
    assert pool.pin_count(slots[1]) == 0
    (free,) = set(range(4)) - set(slots)
    with pytest.raises(SlotStateError, match=f"cannot mark slot {free}: it is free"):
        pool.mark_evictable_many([free])
    pool.check()


@pytest.mark.parametrize("eviction", ["lru", "lfuda", "arc-lfuda"])
def test_batch_claim_keeps_the_owners_pins_and_eviction_order_of_set_owner_then_pin(eviction) -> None:
    # A store takes its fresh slots for the copy in one call: owner, key, speculative flag, one pin.
    pool, twin = make_pool(4, eviction), make_pool(4, eviction)
    slots, twin_slots = pool.allocate(3).slots, twin.allocate(3).slots
    tags = [object(), object(), object()]
    keys = [b"k0", b"k1", b"k2"]
    speculative = [False, True, False]
    for p in (pool, twin):  # a slot pinned by a reader (the claim adds a second pin), one evictable
        ss = slots if p is pool else twin_slots
        p.pin(ss[2])
        p.mark_evictable(ss[1])
    pool.claim_many(zip(slots, tags, keys, speculative))
    for s, tag, key, spec in zip(twin_slots, tags, keys, speculative):
        twin.set_owner(s, tag, key=key, speculative=spec)
        twin.pin(s)
    assert [pool.owner(s) for s in slots] == tags
    assert [pool.pin_count(s) for s in slots] == [1, 1, 2]
    assert pool.statistics() == twin.statistics()
    assert pool.statistics()["pinned_slots"] == 3
    # The policy saw the same insertions: released and refilled, both evict in the same order.
    for p, ss in ((pool, slots), (twin, twin_slots)):
        p.unpin_many(ss)
        p.unpin(ss[2])
        p.mark_evictable_many(ss)
        p.set_owner(p.allocate().slots[0], "newcomer", key=b"k3")
    order = [[tag for _, tag in p.allocate(3).evicted] for p in (pool, twin)]
    assert order[0] == order[1] and len(order[0]) == 3
    # A slot set_owner or pin would refuse raises its error; the items before it were claimed.
    # An item without a key takes set_owner's own path (the tag names the content).
    fresh = make_pool(3, eviction)
    slot, unkeyed = fresh.allocate(2).slots
    (free,) = {0, 1, 2} - {slot, unkeyed}
    with pytest.raises(SlotStateError, match=f"cannot set the owner of slot {free}: it is free"):
        fresh.claim_many([(slot, "a", b"a", False), (unkeyed, "u", None, False), (free, "b", b"b", False)])
    assert [fresh.owner(s) for s in (slot, unkeyed)] == ["a", "u"]
    assert [fresh.pin_count(s) for s in (slot, unkeyed, free)] == [1, 1, 0]
    for p in (pool, twin, fresh):
        p.check()
