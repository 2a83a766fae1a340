"""The pieces the tiers share: the byte LRU's victim choice and the codec pool's slicing and waits,
against brute-force models."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.codec_pool import map_slices, plan_slices, wait_threads
from kvtier.tiers.lru import ByteLru

from cancel_checks import assert_cancel_waits_for_the_work


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(1, 9), st.integers(1, 20000))
def test_plan_slices_cover_in_order_within_the_thread_bound(sizes, workers, min_slice):
    ranges = plan_slices(sizes, workers, min_slice)
    assert [i for r in ranges for i in r] == list(range(len(sizes)))  # contiguous, in order, once
    assert all(len(r) > 0 for r in ranges)
    assert len(ranges) <= max(1, workers)
    if len(ranges) > 1:  # split only when every slice is worth its hop
        assert sum(sizes) // min_slice >= len(ranges)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 100), min_size=0, max_size=12),
    st.integers(-50, 800),
    st.sets(st.integers(0, 11)),
)
def test_choose_victims_is_the_oldest_prefix_or_nothing(sizes, excess, keep_indices):
    keys = [bytes([i]) for i in range(len(sizes))]
    lru = ByteLru(zip(keys, sizes))
    keep = {keys[i] for i in keep_indices if i < len(keys)}
    chosen = lru.choose_victims(excess, keep=keep)
    # Model: walk oldest first, skip kept keys, stop once enough is freed.
    model: List = []
    freed = 0
    for key, size in zip(keys, sizes):
        if excess <= 0 or freed >= excess:
            break
        if key in keep:
            continue
        model.append((key, size))
        freed += size
    expected = model if excess <= 0 or freed >= excess else None
    assert chosen == ([] if excess <= 0 else expected)
    assert len(lru) == len(keys) and lru.total_bytes == sum(sizes)  # choosing changes nothing


def test_lru_touch_put_pop_keep_the_total_and_order():
    lru = ByteLru([(b"a", 5), (b"b", 7), (b"c", 1)])
    assert lru.touch(b"a") and not lru.touch(b"z")
    lru.put(b"b", 2)  # replace: youngest now, total adjusted
    assert list(lru) == [b"c", b"a", b"b"] and lru.total_bytes == 8
    assert lru.pop(b"c") == 1 and lru.pop(b"c") is None and lru.total_bytes == 7
    assert lru.reconcile({b"a": 5, b"b": 3, b"x": 1}, capacity=6) == [
        "size differs for 62: index 2, stored 3",
        "stored but not indexed: 78",
        "over capacity: 7 > 6",
    ]


def test_map_slices_keeps_job_order_and_fails_with_the_first_error():
    with ThreadPoolExecutor(3) as pool:
        f = map_slices(pool, lambda part: [x * 2 for x in part], list(range(10)), [100] * 10, workers=3, min_slice_bytes=100)
        assert f.result(5) == [x * 2 for x in range(10)]

        def fail_on_seven(part):
            if 7 in part:
                raise ValueError("seven")
            return part

        f = map_slices(pool, fail_on_seven, list(range(10)), [100] * 10, workers=3, min_slice_bytes=100)
        with pytest.raises(ValueError, match="seven"):
            f.result(5)


def test_map_slices_runs_the_ranges_it_is_given_in_order():
    seen: List[List[int]] = []
    lock = threading.Lock()

    def record(part):
        with lock:
            seen.append(part)
        return [x + 1 for x in part]

    with ThreadPoolExecutor(2) as pool:
        f = map_slices(pool, record, list(range(7)), [1] * 7, workers=2, min_slice_bytes=1,
                       ranges=[range(0, 3), range(3, 4), range(4, 7)])
        assert f.result(5) == [x + 1 for x in range(7)]
    assert sorted(seen) == [[0, 1, 2], [3], [4, 5, 6]]


@pytest.mark.asyncio
async def test_a_cancelled_wait_returns_only_after_the_running_slices_end():
    started, release = threading.Event(), threading.Event()
    finished: List[int] = []

    def slow(part):
        started.set()
        release.wait(5)
        finished.extend(part)
        return part

    with ThreadPoolExecutor(1) as pool:
        f = map_slices(pool, slow, [1, 2], [1 << 20, 1 << 20], workers=2, min_slice_bytes=1 << 20)
        waiter = asyncio.ensure_future(wait_threads(f, abandon_unstarted=True))
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        await assert_cancel_waits_for_the_work(waiter, release.set, held_s=0.05,
                                               left_early="the wait ended while a slice still ran")
        assert finished == [1]  # the second slice had not started: abandoned for good
