"""vLLM's retention interval as kvtier's store policy (policy/retention.py), against a brute-force
oracle that walks every token boundary and every block."""

from __future__ import annotations

from typing import List, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import AttentionGroup, ModelLayout, reachable_store_block_mask
from kvtier.policy.retention import (
    retention_boundaries,
    retention_store_block_mask,
    retention_store_chunk_indices,
)


def oracle_mask(layout: ModelLayout, gi: int, n: int, retention: Optional[int]) -> List[bool]:
    """Block j is stored iff some served boundary's MTP-widened interval meets it and every chunk
    that interval touches is complete within n. Served boundaries, token by token."""
    g = layout.groups[gi]
    a, b, t = layout.alignment_tokens, g.block_size, g.block_size * g.blocks_per_chunk
    blocks = n // b
    if g.sliding_window is None:
        return [True] * blocks
    served = [
        h for h in range(1, n + 1)
        if (retention is None and h % a == 0) or (retention and h % retention == 0)
        or h == n // a * a or h == n // b * b
    ]
    span = g.sliding_window + g.extra_retained_tokens - 1
    mask = [False] * blocks
    for h in served:
        start, end = max(0, h - span), h
        if end <= start or any((c + 1) * t > n for c in range(start // t, (end - 1) // t + 1)):
            continue
        for j in range(blocks):
            if j * b < end and (j + 1) * b > start:
                mask[j] = True
    return mask


@st.composite
def cases(draw):
    fa = AttentionGroup(block_size=draw(st.sampled_from([4, 8, 16])), blocks_per_chunk=draw(st.sampled_from([1, 2])))
    swa = AttentionGroup(
        block_size=draw(st.sampled_from([2, 4, 8])), blocks_per_chunk=draw(st.sampled_from([1, 2])),
        sliding_window=draw(st.integers(1, 40)), extra_retained_tokens=draw(st.integers(0, 4)),
    )
    layout = ModelLayout(groups=(fa, swa))
    a = layout.alignment_tokens
    retention = draw(st.sampled_from([None, 0, a, 2 * a, 3 * a]))
    return layout, draw(st.integers(0, 160)), retention


@settings(max_examples=150, deadline=None)
@given(cases())
def test_mask_matches_brute_force_oracle(case):
    layout, n, retention = case
    for gi in range(2):
        assert retention_store_block_mask(layout, gi, n, retention) == oracle_mask(layout, gi, n, retention)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_none_is_the_dense_mask_and_sparser_intervals_store_subsets(case):
    layout, n, _ = case
    a = layout.alignment_tokens
    dense = retention_store_block_mask(layout, 1, n, None)
    assert dense == reachable_store_block_mask(layout, 1, n)
    final = retention_store_block_mask(layout, 1, n, 0)
    every_2a = retention_store_block_mask(layout, 1, n, 2 * a)
    assert all(f <= e <= d for f, e, d in zip(final, every_2a, dense))


def test_worked_numbers_match_vllm_0_33():
    """DESIGN's alignment-skip layout, a 33-token prompt: the sets vLLM 0.33 stores
    (tests/integration/test_vllm_tier.py records them from vLLM itself)."""
    for r, final, dense in ((0, [6, 7], [2, 3, 6, 7]), (1, [6, 7], [2, 3, 6, 7]), (3, [5, 6, 7], [1, 2, 3, 5, 6, 7])):
        layout = ModelLayout(groups=(AttentionGroup(block_size=16),
                                     AttentionGroup(block_size=4, sliding_window=8, extra_retained_tokens=r)))
        assert retention_store_chunk_indices(layout, 1, 33, 0) == final
        assert retention_store_chunk_indices(layout, 1, 33, None) == dense
        assert retention_store_chunk_indices(layout, 1, 33, 32) == final
        assert retention_store_chunk_indices(layout, 0, 33, 0) == [0, 1]
        assert retention_boundaries(layout, 1, 33, 0) == [32]
        assert retention_boundaries(layout, 1, 33, None) == [16, 32]


@pytest.mark.parametrize("bad", [-1, 5, 1.5, True, "16"])
def test_bad_interval_is_a_value_error_naming_it(bad):
    layout = ModelLayout(groups=(AttentionGroup(block_size=16), AttentionGroup(block_size=4, sliding_window=8)))
    with pytest.raises(ValueError, match="retention_interval must be None, 0 or a positive multiple of alignment_tokens"):
        retention_store_block_mask(layout, 1, 33, bad)
