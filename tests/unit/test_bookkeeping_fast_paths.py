"""The store and load paths' whole-run checks agree with the chunk-by-chunk checks they stand in
for, and the full-attention shortcut of the store plan with its per-block mask: a fast path may
only say "valid" where the slow one would, with the same device blocks."""

from __future__ import annotations

import asyncio
from typing import List, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.host_book import HostBook
from kvtier.engine.lifecycle import HostState
from kvtier.engine.records import ChunkEntry
from kvtier.engine.validation import (
    check_load_blocks,
    check_store_blocks,
    valid_load_plan_targets,
    valid_store_run,
)
from kvtier.errors import DeviceError
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.policy.retention import retention_store_block_mask, retention_store_chunk_indices

rows = st.lists(st.one_of(st.none(), st.integers(-2, 40)), max_size=24)


@settings(max_examples=400, deadline=None)
@given(row=rows, per_chunk=st.integers(1, 4), first=st.integers(0, 5), count=st.integers(1, 5),
       limit=st.integers(1, 40))
def test_a_valid_store_run_is_one_every_chunk_check_passes_with_the_same_blocks(row, per_chunk, first, count, limit):
    last = first + count - 1
    if not valid_store_run(first, last, per_chunk, row, limit):
        return
    for chunk in range(first, last + 1):
        assert check_store_blocks(0, chunk, per_chunk, row, limit) == row[chunk * per_chunk : (chunk + 1) * per_chunk]


@st.composite
def load_plans(draw):
    per_chunk = draw(st.integers(1, 4))
    chunks = sorted(draw(st.sets(st.integers(0, 6), min_size=1, max_size=5)))
    plan = []
    for chunk in chunks:
        blocks: List[Optional[int]] = [draw(st.one_of(st.none(), st.just(b)))
                                       for b in range(chunk * per_chunk, (chunk + 1) * per_chunk)]
        plan.append((chunk, blocks))
    return plan


@settings(max_examples=400, deadline=None)
@given(row=rows, plan=load_plans(), limit=st.integers(1, 40))
def test_valid_load_plan_targets_are_what_the_chunk_by_chunk_checks_give(row, plan, limit):
    fast = valid_load_plan_targets(row, plan, limit)
    if fast is None:
        return
    seen: dict = {}
    assert [check_load_blocks(0, row, blocks, limit, seen) for _, blocks in plan] == fast


def test_a_doubtful_plan_falls_through_to_the_checks_and_their_errors():
    plan = [(0, [0, 1]), (1, [2, 3])]
    assert valid_load_plan_targets([5, 6, 7, 8], plan, 9) == [[5, 6], [7, 8]]
    assert valid_load_plan_targets([5, 6, 7, 5], plan, 9) is None  # device block 5 given twice
    assert valid_load_plan_targets([5, 6, 7, 9], plan, 9) is None  # past the cache
    seen: dict = {}
    check_load_blocks(0, [5, 6, 7, 9], [0, 1], 9, seen)
    with pytest.raises(DeviceError, match="out of range"):
        check_load_blocks(0, [5, 6, 7, 9], [2, 3], 9, seen)


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([4, 16]), per_chunk=st.integers(1, 4), num_tokens=st.integers(0, 300),
       interval=st.sampled_from([None, 0, 64, 128]), eagle=st.booleans())
def test_full_attention_stores_every_chunk_its_mask_selects(block_size, per_chunk, num_tokens, interval, eagle):
    layout = ModelLayout(groups=(AttentionGroup(block_size, blocks_per_chunk=per_chunk, is_eagle=eagle),),
                         alignment_tokens=64)
    mask = retention_store_block_mask(layout, 0, num_tokens, interval)
    by_mask = [c for c in range(num_tokens // (block_size * per_chunk)) if any(mask[c * per_chunk : (c + 1) * per_chunk])]
    assert retention_store_chunk_indices(layout, 0, num_tokens, interval) == by_mask


@pytest.mark.asyncio
async def test_a_waiter_made_after_the_copy_ended_still_gets_its_outcome():
    entry = ChunkEntry(b"k", 0, 0, HostState.PENDING, 0)
    HostBook.resolve(entry, "copy_error")
    HostBook.resolve(entry, None)  # the first outcome counts
    late = HostBook.waiter(entry)
    assert late.done() and late.result() == "copy_error" and HostBook.waiter(entry) is late
    other = ChunkEntry(b"j", 0, 1, HostState.LOADING, 1)
    early = HostBook.waiter(other)
    assert not early.done()
    HostBook.resolve(other, None)
    await asyncio.sleep(0)
    assert early.result() is None
