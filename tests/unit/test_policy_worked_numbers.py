"""The worked numbers of DESIGN.md ("Worked numbers"), one by one.

Each test narrates one small scenario with exact sets and values; if any of these moves, lookup,
load, allocation and store pruning have drifted apart.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Tuple

import pytest

from kvtier.policy import (
    AttentionGroup,
    ChunkState,
    ModelLayout,
    load_window_size_in_chunks,
    longest_hit,
    num_skipped_tokens,
    reachable_store_block_mask,
    retained_chunk_range,
    retained_interval,
    sliding_window_size_in_chunks,
)

READY = ChunkState.READY
MISSING = ChunkState.MISSING
PENDING = ChunkState.PENDING
LOADING = ChunkState.LOADING


def chunks_of(group: AttentionGroup, boundary: int) -> Set[int]:
    first, last = retained_chunk_range(group, boundary)
    return set(range(first, last + 1))


def masked(mask: List[bool]) -> Set[int]:
    return {index for index, bit in enumerate(mask) if bit}


class StateTable:
    """A state function over explicit per-group tables that records every query."""

    def __init__(self, tables: Dict[int, Dict[int, ChunkState]]):
        self.tables = tables
        self.queries: List[Tuple[int, int]] = []

    def __call__(self, group_index: int, chunk_index: int) -> ChunkState:
        self.queries.append((group_index, chunk_index))
        return self.tables.get(group_index, {}).get(chunk_index, MISSING)

    def queried(self, group_index: int) -> Set[int]:
        return {c for g, c in self.queries if g == group_index}


def ready(chunks: Iterable[int]) -> Dict[int, ChunkState]:
    return {c: READY for c in chunks}


# --- Seed example: 64-token hit, SWA b = 16, p = 1, W = 32 ------------------------------------


def test_seed_example_r3_allocation_restores_chunks_1_2_3():
    group = AttentionGroup(block_size=16, sliding_window=32, extra_retained_tokens=3)
    assert group.tokens_per_chunk == 16
    assert retained_interval(group, 64) == (30, 64)
    assert num_skipped_tokens(group, 64) == 30
    # 30 skipped tokens: exactly one whole 16-token block is never restored (a null block).
    assert num_skipped_tokens(group, 64) // group.block_size == 1
    assert chunks_of(group, 64) == {1, 2, 3}
    assert sliding_window_size_in_chunks(group) == 3  # max(cdiv(32, 16), cdiv(34, 16)) = max(2, 3)
    assert load_window_size_in_chunks(group, 64) == 3  # aligned end: the load window is SW


def test_seed_example_r3_lookup_checks_chunks_1_2_3_and_hits_64():
    group = AttentionGroup(block_size=16, sliding_window=32, extra_retained_tokens=3)
    layout = ModelLayout((group,))
    state = StateTable({0: ready({1, 2, 3})})  # chunk 0 was never stored: it is skipped
    assert longest_hit(layout, 64, state) == 64
    assert state.queried(0) == {1, 2, 3}
    # Chunk 1 holds the 2 retained tokens 30, 31: without it the hit at 64 is gone, and every
    # shorter H needs chunk 0 or 1 too.
    state = StateTable({0: ready({2, 3})})
    assert longest_hit(layout, 64, state) == 0


def test_seed_example_r1_one_retained_token_asks_for_no_extra_chunk():
    group = AttentionGroup(block_size=16, sliding_window=32, extra_retained_tokens=1)
    assert sliding_window_size_in_chunks(group) == 2  # max(cdiv(32, 16), cdiv(32, 16))
    assert retained_interval(group, 64) == (32, 64)
    assert num_skipped_tokens(group, 64) == 32
    assert chunks_of(group, 64) == {2, 3}
    layout = ModelLayout((group,))
    state = StateTable({0: ready({2, 3})})
    assert longest_hit(layout, 64, state) == 64
    assert state.queried(0) == {2, 3}


def test_seed_example_r0_window_is_the_plain_window():
    group = AttentionGroup(block_size=16, sliding_window=32)
    assert retained_interval(group, 64) == (33, 64)
    assert num_skipped_tokens(group, 64) == 33
    assert sliding_window_size_in_chunks(group) == 2
    assert chunks_of(group, 64) == {2, 3}


# --- Alignment skip: FA b = 16; SWA b = 4, W = 8, p = 1; 33-token prompt -------------------------


def alignment_layout(extra: int) -> ModelLayout:
    return ModelLayout(
        (
            AttentionGroup(block_size=16),
            AttentionGroup(block_size=4, sliding_window=8, extra_retained_tokens=extra),
        )
    )


@pytest.mark.parametrize(
    "extra, swa_blocks",
    [
        (0, {2, 3, 6, 7}),
        (1, {2, 3, 6, 7}),
        # R = 2 is not in DESIGN.md; with W - 1 + R = 9 the interval at 16 is [7, 16): block 1 too.
        (2, {1, 2, 3, 5, 6, 7}),
        (3, {1, 2, 3, 5, 6, 7}),
    ],
)
def test_alignment_skip_store_mask(extra, swa_blocks):
    layout = alignment_layout(extra)
    assert layout.alignment_tokens == 16
    assert layout.hit_granularity_tokens == 4
    fa_mask = reachable_store_block_mask(layout, 0, 33)
    swa_mask = reachable_store_block_mask(layout, 1, 33)
    assert fa_mask == [True, True]  # 33 // 16 complete FA blocks, all stored
    assert len(swa_mask) == 8  # 33 // 4 complete SWA blocks
    assert masked(swa_mask) == swa_blocks


@pytest.mark.parametrize("extra, expected", [(0, 2), (1, 2), (2, 3), (3, 3), (4, 3)])
def test_alignment_skip_sw_is_3_iff_r_above_1(extra, expected):
    group = alignment_layout(extra).groups[1]
    assert sliding_window_size_in_chunks(group) == expected
    assert sliding_window_size_in_chunks(group) == (3 if extra > 1 else 2)


def test_alignment_skip_fa_group_has_no_sliding_window():
    group = alignment_layout(0).groups[0]
    assert sliding_window_size_in_chunks(group) is None
    assert load_window_size_in_chunks(group, 33) is None
    assert num_skipped_tokens(group, 33) == 0
    assert retained_interval(group, 32) == (0, 32)


@pytest.mark.parametrize(
    "extra, swa_retained",
    [(0, {6, 7}), (1, {6, 7}), (3, {5, 6, 7})],
)
def test_alignment_skip_consumer_of_prompt_plus_one_hits_32(extra, swa_retained):
    layout = alignment_layout(extra)
    stored_fa = masked(reachable_store_block_mask(layout, 0, 33))
    stored_swa = masked(reachable_store_block_mask(layout, 1, 33))
    # The consumer's request is the 33-token prompt plus one token: at most 33 tokens can be hit.
    state = StateTable({0: ready(stored_fa), 1: ready(stored_swa)})
    assert longest_hit(layout, 33, state) == 32
    assert chunks_of(layout.groups[0], 32) == {0, 1}
    assert chunks_of(layout.groups[1], 32) == swa_retained
    assert swa_retained <= stored_swa  # what the consumer loads is exactly what was stored
    # The hit is decided from the retained chunks only: nothing before the window is asked for.
    assert state.queried(1) == swa_retained
    assert state.queried(0) == {0, 1}


def test_alignment_skip_r3_hit_needs_block_5():
    layout = alignment_layout(3)
    state = StateTable({0: ready({0, 1}), 1: ready({1, 2, 3, 6, 7})})  # block 5 lost
    # 32 needs SWA {5, 6, 7}; 28 needs {4, 5, 6}; 24 ... 20 need 4 or 5; 16 needs {1, 2, 3}.
    assert longest_hit(layout, 33, state) == 16


# --- Unaligned hit: SWA b = 64, p = 4 (T = 256), W = 128, R = 0, H = 3904 -----------------------


def test_unaligned_hit_load_window_and_chunks():
    group = AttentionGroup(block_size=64, blocks_per_chunk=4, sliding_window=128)
    assert group.tokens_per_chunk == 256
    assert (-3904) % 256 == 192  # rho
    assert sliding_window_size_in_chunks(group) == 1
    assert load_window_size_in_chunks(group, 3904) == 2  # cdiv(127 + 192, 256)
    assert retained_interval(group, 3904) == (3777, 3904)
    assert chunks_of(group, 3904) == {14, 15}
    assert num_skipped_tokens(group, 3904) == 3777
    # Allocation needs the tokens from 3777 on: they start inside chunk 14 (3584..3839).
    assert num_skipped_tokens(group, 3904) // group.tokens_per_chunk == 14


def test_unaligned_hit_lookup_reads_chunks_14_15():
    group = AttentionGroup(block_size=64, blocks_per_chunk=4, sliding_window=128)
    layout = ModelLayout((group,))
    assert layout.hit_granularity_tokens == 64
    state = StateTable({0: ready({14, 15})})
    assert longest_hit(layout, 3904, state) == 3904
    assert state.queried(0) == {14, 15}


# --- Missing and in-flight chunks inside the window ----------------------------------------------


def seed_layout() -> ModelLayout:
    return ModelLayout((AttentionGroup(block_size=16, sliding_window=32, extra_retained_tokens=3),))


def test_missing_chunk_inside_window_shrinks_hit():
    layout = seed_layout()
    # Chunk 3 missing: every H > 48 needs chunk 3. H = 48 needs [14, 48) = chunks {0, 1, 2}.
    state = StateTable({0: ready({0, 1, 2, 4, 5})})
    assert longest_hit(layout, 64, state) == 48
    # Chunk 0 also missing: 48 needs chunk 0, 32 needs {0, 1}, 16 needs {0}: nothing is valid.
    state = StateTable({0: ready({1, 2, 4, 5})})
    assert longest_hit(layout, 64, state) == 0


def test_missing_chunk_with_no_shorter_valid_hit_gives_zero():
    layout = alignment_layout(0)
    state = StateTable({0: ready({1}), 1: ready(range(8))})  # FA chunk 0 missing
    assert longest_hit(layout, 33, state) == 0


def test_missing_chunk_before_window_does_not_matter():
    layout = seed_layout()
    state = StateTable({0: {0: MISSING, 1: READY, 2: READY, 3: READY}})
    assert longest_hit(layout, 64, state) == 64


@pytest.mark.parametrize("in_flight", [PENDING, LOADING])
def test_in_flight_chunk_inside_window_yields_none_then_full_hit(in_flight):
    layout = seed_layout()
    table = {0: READY, 1: READY, 2: in_flight, 3: READY}
    state = StateTable({0: table})
    # H = 16 (chunk 0 only) is valid now, but waiting for chunk 2 gives 64: ask again next step.
    assert longest_hit(layout, 64, state) is None
    table[2] = READY
    assert longest_hit(layout, 64, state) == 64


@pytest.mark.parametrize("in_flight", [PENDING, LOADING])
def test_in_flight_chunk_in_fa_group_yields_none(in_flight):
    layout = alignment_layout(3)
    fa = {0: READY, 1: in_flight}
    state = StateTable({0: fa, 1: ready({1, 2, 3, 5, 6, 7})})
    assert longest_hit(layout, 33, state) is None
    fa[1] = READY
    assert longest_hit(layout, 33, state) == 32


@pytest.mark.parametrize("in_flight", [PENDING, LOADING])
def test_in_flight_chunk_outside_best_window_does_not_block(in_flight):
    layout = seed_layout()
    # Chunk 3 is missing, so 48 is the best even after waiting; chunk 5 in flight lies past it.
    state = StateTable({0: {0: READY, 1: READY, 2: READY, 3: MISSING, 5: in_flight}})
    assert longest_hit(layout, 96, state) == 48


@pytest.mark.parametrize("in_flight", [PENDING, LOADING])
def test_in_flight_chunk_that_could_lengthen_the_hit_yields_none(in_flight):
    layout = seed_layout()
    # 64 needs chunk 3 (missing); 48 needs {0, 1, 2} and would be valid once chunk 1 lands, while
    # only 16 is valid now: None, not 16.
    state = StateTable({0: {0: READY, 1: in_flight, 2: READY, 3: MISSING}})
    assert longest_hit(layout, 64, state) is None
    # With chunk 2 missing too, 32 (= chunks {0, 1}) still waits on chunk 1: None again.
    state = StateTable({0: {0: READY, 1: in_flight, 2: MISSING, 3: MISSING}})
    assert longest_hit(layout, 64, state) is None


@pytest.mark.parametrize("in_flight", [PENDING, LOADING])
def test_in_flight_chunk_behind_a_missing_one_does_not_block(in_flight):
    layout = seed_layout()
    # 64 needs {1, 2, 3}: chunk 2 is missing, so waiting for chunk 3 can never give 64; 32 is valid.
    state = StateTable({0: {0: READY, 1: READY, 2: MISSING, 3: in_flight}})
    assert longest_hit(layout, 64, state) == 32


def test_zero_max_tokens_and_below_granularity():
    layout = alignment_layout(0)
    tables = {0: ready(range(4)), 1: ready(range(16))}
    state = StateTable(tables)
    assert longest_hit(layout, 0, state) == 0
    assert longest_hit(layout, 3, state) == 0  # below the 4-token hit granularity
    assert state.queries == []  # H = 0 is always valid and needs no chunk
    state = StateTable(tables)
    assert longest_hit(layout, 7, state) == 4
    assert set(state.queries) == {(0, 0), (1, 0)}


def test_eagle_group_needs_its_trailing_block():
    group = AttentionGroup(block_size=16, sliding_window=32, is_eagle=True)
    assert retained_interval(group, 64) == (33, 80)
    assert chunks_of(group, 64) == {2, 3, 4}
    layout = ModelLayout((group,))
    # Chunk 4 (the block past the boundary) missing: 48 needs [17, 64) = chunks {1, 2, 3}.
    assert longest_hit(layout, 64, StateTable({0: ready({1, 2, 3})})) == 48
    assert longest_hit(layout, 64, StateTable({0: ready({2, 3, 4})})) == 64
    # Without chunk 1 either, 48 is gone too and 16 needs [0, 32) = chunks {0, 1}: no hit.
    assert longest_hit(layout, 64, StateTable({0: ready({2, 3})})) == 0
