"""Property tests of kvtier.policy against a brute-force oracle written here from the contract text.

The oracle reads only the contract (DESIGN.md, "The coverage contract") and the
dataclasses' fields; it never calls the module's helpers, so a shared mistake cannot hide:

- retained interval: SWA ``[max(0, H - (W - 1 + R)), H)``, FA ``[0, H)``; EAGLE: end ``+ b``.
- a chunk ``c`` (tokens ``[c*T, (c+1)*T)``) *meets* ``[s, e)`` iff ``c*T < e`` and ``(c+1)*T > s``.
- alignment ``A``: the FA chunk size when there is one, else the largest chunk size; hit
  granularity: the smallest block size.
- a hit ``H`` (a positive multiple of the granularity, ``<= max_tokens``) is valid iff every chunk
  meeting its retained interval is READY in every group; ``longest_hit`` is the largest valid ``H``
  (0 when none), or ``None`` iff counting PENDING/LOADING as READY allows a larger one.
- the store mask of a group at ``n`` tokens: a complete block is stored iff it meets the (store
  spec's) retained interval of some reachable boundary (multiples of ``A`` up to ``n`` and the
  group's final complete-block boundary) whose touched chunks all end within ``n``; FA: all.
"""

from __future__ import annotations

from math import gcd
from typing import Callable, Dict, List, Optional, Set, Tuple

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvtier.policy import (
    AttentionGroup,
    ChunkState,
    ModelLayout,
    load_window_size_in_chunks,
    longest_hit,
    num_skipped_tokens,
    reachable_store_block_mask,
    sliding_window_size_in_chunks,
)

READY = ChunkState.READY
MISSING = ChunkState.MISSING
PENDING = ChunkState.PENDING
LOADING = ChunkState.LOADING
READY_NOW = frozenset({READY})
READY_SOON = frozenset({READY, PENDING, LOADING})

MAX_TOKENS = 160


# --- the oracle ----------------------------------------------------------------------------------


def o_chunk_tokens(g: AttentionGroup) -> int:
    return g.block_size * g.blocks_per_chunk


def o_interval(g: AttentionGroup, boundary: int) -> Tuple[int, int]:
    end = boundary + (g.block_size if g.is_eagle else 0)
    if g.sliding_window is None:
        return 0, end
    return max(0, boundary - (g.sliding_window - 1 + g.extra_retained_tokens)), end


def o_store_interval(g: AttentionGroup, boundary: int) -> Tuple[int, int]:
    """The interval of the store spec: window ``W + R``, no extra tokens (MTP widens what is stored)."""
    end = boundary + (g.block_size if g.is_eagle else 0)
    if g.sliding_window is None:
        return 0, end
    return max(0, boundary - (g.sliding_window + g.extra_retained_tokens - 1)), end


def o_meets(lo: int, hi: int, start: int, end: int) -> bool:
    """Do tokens ``[lo, hi)`` and ``[start, end)`` share a token?"""
    return lo < end and hi > start and start < end


def o_chunks_meeting(g: AttentionGroup, start: int, end: int) -> List[int]:
    tokens = o_chunk_tokens(g)
    return [c for c in range(end // tokens + 2) if o_meets(c * tokens, (c + 1) * tokens, start, end)]


def o_alignment(groups) -> int:
    full = {o_chunk_tokens(g) for g in groups if g.sliding_window is None}
    if len(full) == 1:
        return next(iter(full))
    return max(o_chunk_tokens(g) for g in groups)


def o_granularity(groups) -> int:
    return min(g.block_size for g in groups)


def o_longest_hit(groups, max_tokens: int, state: Callable[[int, int], ChunkState]) -> Optional[int]:
    step = o_granularity(groups)

    def best(acceptable) -> int:
        found = 0
        for boundary in range(step, max_tokens + 1, step):
            if all(
                state(gi, c) in acceptable
                for gi, g in enumerate(groups)
                for c in o_chunks_meeting(g, *o_interval(g, boundary))
            ):
                found = boundary
        return found

    now, soon = best(READY_NOW), best(READY_SOON)
    return None if soon > now else now


def o_reachable_boundaries(groups, group_index: int, num_tokens: int) -> List[int]:
    """The boundaries that count for the store mask of one group (the contract's rule, verbatim)."""
    g = groups[group_index]
    tokens = o_chunk_tokens(g)
    alignment = o_alignment(groups)
    candidates = set(range(alignment, num_tokens + 1, alignment))
    final = (num_tokens // g.block_size) * g.block_size
    if final > 0:
        candidates.add(final)
    counted = []
    for boundary in sorted(candidates):
        start, end = o_store_interval(g, boundary)
        if all((c + 1) * tokens <= num_tokens for c in o_chunks_meeting(g, start, end)):
            counted.append(boundary)
    return counted


def o_store_mask(groups, group_index: int, num_tokens: int) -> List[bool]:
    g = groups[group_index]
    b = g.block_size
    num_blocks = num_tokens // b
    if g.sliding_window is None:
        return [True] * num_blocks
    intervals = [o_store_interval(g, h) for h in o_reachable_boundaries(groups, group_index, num_tokens)]
    return [any(o_meets(i * b, (i + 1) * b, s, e) for s, e in intervals) for i in range(num_blocks)]


def o_stored_chunks(groups, group_index: int, num_tokens: int, mask: List[bool]) -> Set[int]:
    """A producer stores a complete chunk iff any of its blocks is masked."""
    g = groups[group_index]
    p = g.blocks_per_chunk
    return {c for c in range(num_tokens // o_chunk_tokens(g)) if any(mask[c * p : (c + 1) * p])}


# --- strategies ----------------------------------------------------------------------------------


@st.composite
def groups_st(draw, *, eagle: bool = True, sliding: Optional[bool] = None):
    is_sliding = draw(st.booleans()) if sliding is None else sliding
    block_size = draw(st.integers(1, 16))
    blocks_per_chunk = draw(st.integers(1, 4))
    is_eagle = draw(st.booleans()) if eagle else False
    if not is_sliding:
        return AttentionGroup(block_size, blocks_per_chunk, is_eagle=is_eagle)
    return AttentionGroup(
        block_size,
        blocks_per_chunk,
        sliding_window=draw(st.integers(1, 64)),
        extra_retained_tokens=draw(st.integers(0, 4)),
        is_eagle=is_eagle,
    )


layouts_st = st.lists(groups_st(), min_size=1, max_size=3).map(lambda gs: ModelLayout(tuple(gs)))

# Palettes bias the states so that long hits, misses and waits all occur; READY first so that
# shrinking moves towards "everything stored".
PALETTES = (
    (READY,) * 12 + (MISSING, PENDING, LOADING),
    (READY,) * 3 + (MISSING, PENDING, LOADING),
    (READY,) * 6 + (PENDING, LOADING),
    (READY,) * 8 + (MISSING,),
)


@st.composite
def hit_cases(draw):
    layout = draw(layouts_st)
    max_tokens = draw(st.integers(0, MAX_TOKENS))
    palette = draw(st.sampled_from(PALETTES))
    tables = []
    for g in layout.groups:
        num_chunks = (max_tokens + g.block_size) // o_chunk_tokens(g) + 1
        tables.append(draw(st.lists(st.sampled_from(palette), min_size=num_chunks, max_size=num_chunks)))
    return layout, max_tokens, tables


def table_state(tables: List[List[ChunkState]]) -> Callable[[int, int], ChunkState]:
    def state(group_index: int, chunk_index: int) -> ChunkState:
        assert chunk_index >= 0
        table = tables[group_index]
        return table[chunk_index] if chunk_index < len(table) else MISSING

    return state


# --- layout attributes ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(layouts_st)
def test_layout_alignment_and_granularity_follow_the_contract(layout):
    assert layout.alignment_tokens == o_alignment(layout.groups)
    assert layout.hit_granularity_tokens == o_granularity(layout.groups)


# --- (a) longest_hit ------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(hit_cases())
def test_longest_hit_equals_oracle(case):
    layout, max_tokens, tables = case
    state = table_state(tables)
    expected = o_longest_hit(layout.groups, max_tokens, state)
    queries: List[Tuple[int, int]] = []

    def counted(gi: int, c: int) -> ChunkState:
        queries.append((gi, c))
        return state(gi, c)

    got = longest_hit(layout, max_tokens, counted)
    assert got == expected
    # O(chunks): each chunk's state is read at most once per group.
    assert len(queries) == len(set(queries))
    if got is not None:
        # Every returned hit has all its retained chunks READY, and it is a candidate boundary.
        assert got % o_granularity(layout.groups) == 0 and 0 <= got <= max_tokens
        for gi, g in enumerate(layout.groups):
            if got:
                assert all(state(gi, c) is READY for c in o_chunks_meeting(g, *o_interval(g, got)))


@settings(max_examples=100, deadline=None)
@given(hit_cases())
def test_longest_hit_none_turns_into_the_waited_for_hit(case):
    """Once every PENDING/LOADING chunk lands (READY), a ``None`` becomes the longer hit."""
    layout, max_tokens, tables = case
    landed = [[READY if s in (PENDING, LOADING) else s for s in table] for table in tables]
    before = longest_hit(layout, max_tokens, table_state(tables))
    after = longest_hit(layout, max_tokens, table_state(landed))
    assert after is not None
    if before is None:
        assert after > 0
    else:
        assert after >= before


# --- (b) store mask -------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(layouts_st, st.integers(0, 2 * MAX_TOKENS), st.data())
def test_store_mask_equals_oracle(layout, num_tokens, data):
    group_index = data.draw(st.integers(0, len(layout.groups) - 1))
    group = layout.groups[group_index]
    mask = reachable_store_block_mask(layout, group_index, num_tokens)
    assert mask == o_store_mask(layout.groups, group_index, num_tokens)
    assert len(mask) == num_tokens // group.block_size
    assert layout.groups[group_index] is group  # the group is never replaced or mutated


# --- (c) liveness and (d) minimality -------------------------------------------------------------


def produce(layout: ModelLayout, num_tokens: int) -> List[Set[int]]:
    stored = []
    for gi in range(len(layout.groups)):
        mask = reachable_store_block_mask(layout, gi, num_tokens)
        stored.append(o_stored_chunks(layout.groups, gi, num_tokens, mask))
    return stored


@settings(max_examples=300, deadline=None)
@given(layouts_st, st.integers(0, 2 * MAX_TOKENS))
def test_liveness_producer_serves_every_complete_aligned_boundary(layout, num_tokens):
    groups = layout.groups
    stored = produce(layout, num_tokens)

    def state(gi: int, c: int) -> ChunkState:
        return READY if c in stored[gi] else MISSING

    alignment, step = o_alignment(groups), o_granularity(groups)
    served = 0
    for boundary in range(alignment, num_tokens + 1, alignment):
        if boundary % step:
            # A hit lands on multiples of the hit granularity only; an alignment that is not one
            # (block sizes with no common step, e.g. 3 and 4) cannot be hit exactly.
            continue
        complete = all(
            (c + 1) * o_chunk_tokens(g) <= num_tokens
            for g in groups
            for c in o_chunks_meeting(g, *o_interval(g, boundary))
        )
        if complete:
            assert longest_hit(layout, boundary, state) == boundary
            served = boundary
    assert longest_hit(layout, num_tokens, state) >= served


@settings(max_examples=300, deadline=None)
@given(layouts_st, st.integers(0, 2 * MAX_TOKENS))
def test_minimality_every_stored_swa_chunk_serves_a_reachable_boundary(layout, num_tokens):
    groups = layout.groups
    stored = produce(layout, num_tokens)
    for gi, g in enumerate(groups):
        if g.sliding_window is None:
            assert stored[gi] == set(range(num_tokens // o_chunk_tokens(g)))
            continue
        boundaries = o_reachable_boundaries(groups, gi, num_tokens)
        needed = {c for h in boundaries for c in o_chunks_meeting(g, *o_interval(g, h))}
        assert stored[gi] <= needed
        # and, with liveness, nothing needed at a counted boundary is left out
        assert needed <= stored[gi]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(groups_st(sliding=False), min_size=1, max_size=2),
    st.lists(groups_st(eagle=False, sliding=True), min_size=1, max_size=2),
    st.integers(0, 2 * MAX_TOKENS),
)
def test_liveness_with_power_of_two_blocks_serves_every_aligned_boundary(fa, swa, num_tokens):
    """Real models: power-of-two blocks, so every alignment multiple is a hit candidate."""
    groups = [
        AttentionGroup(1 << (g.block_size.bit_length() - 1), g.blocks_per_chunk, g.sliding_window,
                       g.extra_retained_tokens, g.is_eagle)
        for g in fa[:1] + swa
    ]
    groups = [g for g in groups if not g.is_eagle]
    assume(groups)
    layout = ModelLayout(tuple(groups))
    alignment = o_alignment(groups)
    assert alignment % o_granularity(groups) == 0
    stored = produce(layout, num_tokens)

    def state(gi: int, c: int) -> ChunkState:
        return READY if c in stored[gi] else MISSING

    for boundary in range(alignment, num_tokens + 1, alignment):
        if all(
            (c + 1) * o_chunk_tokens(g) <= num_tokens
            for g in groups
            for c in o_chunks_meeting(g, *o_interval(g, boundary))
        ):
            assert longest_hit(layout, boundary, state) == boundary


# --- (e) the seed's formulas against the exact interval --------------------------------------------


def exact_chunks(g: AttentionGroup, end: int) -> int:
    span = g.sliding_window - 1 + g.extra_retained_tokens
    return len(o_chunks_meeting(g, max(0, end - span), end))


def over_ask_expected(g: AttentionGroup, end: int) -> bool:
    """Where the seed's formulas ask for one chunk more than the exact interval meets.

    DESIGN.md: ``R = 0``, the end chunk-aligned and ``W = 1 (mod T)``. Written ``(W - 1) % T == 0``
    (not ``W % T == 1``) so that ``T = 1`` is included. With ``W = 1, R = 0`` the interval is empty
    and the outer ``cdiv(W, T) = 1`` over-asks at every end, aligned or not.
    """
    tokens = o_chunk_tokens(g)
    w, r = g.sliding_window, g.extra_retained_tokens
    return r == 0 and (w - 1) % tokens == 0 and (end % tokens == 0 or w == 1)


swa_groups_st = groups_st(eagle=False, sliding=True)


@settings(max_examples=500, deadline=None)
@given(swa_groups_st, st.integers(0, 400))
def test_seed_formulas_never_below_exact_and_equal_except_the_documented_case(g, extra):
    span = g.sliding_window - 1 + g.extra_retained_tokens
    end = span + extra  # n >= W - 1 + R: the window lies wholly inside the request
    tokens = o_chunk_tokens(g)
    exact = exact_chunks(g, end)
    window = load_window_size_in_chunks(g, end)
    assert window >= exact
    if over_ask_expected(g, end):
        assert window == exact + 1
    else:
        assert window == exact
    if end % tokens == 0:
        assert sliding_window_size_in_chunks(g) == window


@settings(max_examples=300, deadline=None)
@given(swa_groups_st, st.data())
def test_seed_formulas_never_below_exact_for_short_requests(g, data):
    span = g.sliding_window - 1 + g.extra_retained_tokens
    end = data.draw(st.integers(0, span))
    exact = exact_chunks(g, end)
    assert load_window_size_in_chunks(g, end) >= exact
    if end % o_chunk_tokens(g) == 0:
        assert sliding_window_size_in_chunks(g) >= exact


@settings(max_examples=200, deadline=None)
@given(swa_groups_st)
def test_sliding_window_size_in_chunks_is_the_seed_formula(g):
    tokens = o_chunk_tokens(g)
    w, r = g.sliding_window, g.extra_retained_tokens
    assert sliding_window_size_in_chunks(g) == max(-(-w // tokens), -(-(w - 1 + r) // tokens))


@settings(max_examples=200, deadline=None)
@given(groups_st(), st.integers(0, 400))
def test_num_skipped_tokens_is_where_the_retained_interval_starts(g, end):
    if g.sliding_window is None:
        assert num_skipped_tokens(g, end) == 0
        assert sliding_window_size_in_chunks(g) is None
        assert load_window_size_in_chunks(g, end) is None
    else:
        skipped = max(0, end - g.sliding_window + 1 - g.extra_retained_tokens)
        assert num_skipped_tokens(g, end) == skipped
        assert o_interval(g, end)[0] == skipped


def test_documented_over_ask_corner_cases():
    # W = 1 (mod T), R = 0, aligned end: one chunk more than the interval [n - W + 1, n) meets.
    g = AttentionGroup(block_size=4, blocks_per_chunk=2, sliding_window=9)  # T = 8, W - 1 = 8
    assert exact_chunks(g, 64) == 1
    assert load_window_size_in_chunks(g, 64) == 2
    assert sliding_window_size_in_chunks(g) == 2
    # One retained token (R = 1) removes the over-ask: the interval now reaches the earlier chunk.
    g1 = AttentionGroup(block_size=4, blocks_per_chunk=2, sliding_window=9, extra_retained_tokens=1)
    assert exact_chunks(g1, 64) == load_window_size_in_chunks(g1, 64) == 2
    # T = 1: every W is 1 (mod 1); `W % T == 1` would miss this case.
    g2 = AttentionGroup(block_size=1, sliding_window=5)
    assert exact_chunks(g2, 40) == 4
    assert load_window_size_in_chunks(g2, 40) == 5
    # W = 1, R = 0: the interval is empty, the seed still asks for one chunk, aligned or not.
    g3 = AttentionGroup(block_size=4, sliding_window=1)
    assert exact_chunks(g3, 41) == 0
    assert load_window_size_in_chunks(g3, 41) == 1
