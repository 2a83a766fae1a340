"""Compressed attention (DeepSeek-V4) in kvtier's groups: the coverage contract against an oracle.

The oracle below knows nothing of ``retained_interval``: it says, in the model's own terms, what a
hit at ``H`` needs (DeepSeek-V4 cache semantics, transformers' ``DeepseekV4HCACache`` /
``DeepseekV4CSACache``):

- the sliding branch: tokens ``[H - (W - 1 + R), H)`` (``R`` retained for MTP);
- a compressor of rate ``r``: entries ``[0, H / r)`` (``H`` a multiple of ``r``, buffer empty);
  entry ``i`` sits in block ``i // e`` of its group, ``e = lcm(b, r) / r`` entries per block;
- an overlapping compressor (CSA): the per-token state of the last window, tokens ``[H - r, H)``.

A hit is a multiple of every rate. The properties: ``longest_hit`` admits only hits whose items
are all readable and misses no longer one; ``None`` exactly when in-flight chunks would allow more;
a producer's stored chunks serve every boundary a consumer can reach; the load plan restores
exactly the blocks holding needed items.
"""

from __future__ import annotations

from math import lcm
from typing import Dict, Set

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import ChunkState, longest_hit
from kvtier.policy.compressed import CompressedAttentionLayout, GroupRole, compressed_entry_range
from kvtier.policy.plan import load_block_plan, store_chunk_indices

READY, MISSING, PENDING, LOADING = ChunkState.READY, ChunkState.MISSING, ChunkState.PENDING, ChunkState.LOADING
MAX_TOKENS = 192

# --- the oracle: (group, block) items a hit needs, from the model's semantics ---------------------


def o_needed_blocks(spec: CompressedAttentionLayout, boundary: int) -> Dict[int, Set[int]]:
    """Per group index, the blocks holding an item a hit at ``boundary`` reads."""
    needed: Dict[int, Set[int]] = {}
    gi = 0
    span = spec.sliding_window - 1 + spec.extra_retained_tokens
    needed[gi] = {t // spec.block_size for t in range(max(0, boundary - span), boundary)}
    for rate in spec.compress_rates:
        gi += 1
        per_block = lcm(spec.block_size, rate) // rate
        needed[gi] = {entry // per_block for entry in range(boundary // rate)}
    for rate in spec.overlap_rates:
        gi += 1
        needed[gi] = {t // rate for t in range(max(0, boundary - rate), boundary)}  # block size = rate
    return needed


def o_blocks_per_chunk(spec: CompressedAttentionLayout, gi: int) -> int:
    return 1 if gi > len(spec.compress_rates) else spec.blocks_per_chunk  # overlap groups: p = 1


def o_needed_chunks(spec, boundary) -> Dict[int, Set[int]]:
    return {g: {b // o_blocks_per_chunk(spec, g) for b in blocks} for g, blocks in o_needed_blocks(spec, boundary).items()}


def o_block_tokens(spec, gi) -> int:
    if gi == 0:
        return spec.block_size
    if gi <= len(spec.compress_rates):
        return lcm(spec.block_size, spec.compress_rates[gi - 1])
    return spec.overlap_rates[gi - 1 - len(spec.compress_rates)]


def o_granularity(spec) -> int:
    return lcm(*spec.compress_rates)


def o_valid(spec, boundary, readable) -> bool:
    return all(readable(g, c) for g, chunks in o_needed_chunks(spec, boundary).items() for c in chunks)


def o_longest_hit(spec, max_tokens, state):
    step = o_granularity(spec)
    candidates = range((max_tokens // step) * step, 0, -step)
    now = next((h for h in candidates if o_valid(spec, h, lambda g, c: state(g, c) is READY)), 0)
    soon = next((h for h in candidates if o_valid(spec, h, lambda g, c: state(g, c) is not MISSING)), 0)
    return None if soon > now else now


def o_complete(spec, gi, chunk, num_tokens) -> bool:
    return (chunk + 1) * o_block_tokens(spec, gi) * o_blocks_per_chunk(spec, gi) <= num_tokens


# --- strategies -------------------------------------------------------------------------------------

specs = st.builds(
    lambda b, w, rates, overlap_mask, p, r: CompressedAttentionLayout(
        block_size=b,
        sliding_window=w,
        compress_rates=tuple(rates),
        overlap_rates=tuple(x for x, keep in zip(sorted(set(rates)), overlap_mask) if keep),
        blocks_per_chunk=p,
        extra_retained_tokens=r,
    ),
    b=st.sampled_from([2, 4, 8, 16]),
    w=st.integers(1, 40),
    rates=st.lists(st.sampled_from([2, 4, 8, 16, 32]), min_size=1, max_size=2),
    overlap_mask=st.lists(st.booleans(), min_size=2, max_size=2),
    p=st.integers(1, 3),
    r=st.integers(0, 4),
)


def _stored_state(spec, num_tokens):
    layout = spec.layout()
    stored = [set(store_chunk_indices(layout, g, num_tokens)) for g in range(len(layout.groups))]
    return stored, lambda g, c: READY if c in stored[g] else MISSING


# --- properties -------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(spec=specs, max_tokens=st.integers(0, MAX_TOKENS), data=st.data())
def test_longest_hit_matches_the_oracle_over_random_chunk_states(spec, max_tokens, data):
    layout = spec.layout()
    table = {}
    for g, group in enumerate(layout.groups):
        for c in range(MAX_TOKENS // group.tokens_per_chunk + 2):
            table[g, c] = data.draw(st.sampled_from([READY, READY, READY, MISSING, PENDING, LOADING]))
    state = lambda g, c: table.get((g, c), MISSING)  # noqa: E731
    hit = longest_hit(layout, max_tokens, state)
    assert hit == o_longest_hit(spec, max_tokens, state)
    if hit:
        assert all(hit % rate == 0 for rate in spec.compress_rates)  # every buffer empty


@settings(max_examples=120, deadline=None)
@given(spec=specs, num_tokens=st.integers(0, MAX_TOKENS))
def test_a_producer_serves_every_boundary_a_consumer_can_reach(spec, num_tokens):
    layout = spec.layout()
    stored, state = _stored_state(spec, num_tokens)
    step = layout.alignment_tokens
    for boundary in range(step, num_tokens + 1, step):
        chunks = o_needed_chunks(spec, boundary)
        if not all(o_complete(spec, g, c, num_tokens) for g, cs in chunks.items() for c in cs):
            continue  # an incomplete chunk is never stored: no one can be served there
        assert all(c in stored[g] for g, cs in chunks.items() for c in cs), boundary
        # A consumer sharing exactly this prefix (and one more token) hits it in full.
        assert longest_hit(layout, boundary, state) == boundary
    # Whatever a consumer of this prefix is offered is safe.
    hit = longest_hit(layout, num_tokens, state)
    assert hit is not None and o_valid(spec, hit, lambda g, c: c in stored[g])


@settings(max_examples=120, deadline=None)
@given(spec=specs, hit_windows=st.integers(1, 12))
def test_the_load_plan_restores_exactly_the_blocks_holding_needed_items(spec, hit_windows):
    layout = spec.layout()
    hit = hit_windows * layout.hit_granularity_tokens
    needed = o_needed_blocks(spec, hit)
    for g in range(len(layout.groups)):
        planned = {b for _, blocks in load_block_plan(layout, g, hit) for b in blocks if b is not None}
        assert planned == needed[g], (g, hit)


def test_worked_dsv4_flash_geometry():
    """transformers' DeepseekV4Config defaults (V4-Flash): W = 128, CSA rate 4, HCA rate 128; with
    vLLM's 64-token blocks a CSA block holds 16 entries, an HCA block 1 entry (128 tokens)."""
    spec = CompressedAttentionLayout(
        block_size=64, sliding_window=128, compress_rates=(4, 128), overlap_rates=(4,), extra_retained_tokens=3
    )
    assert spec.roles == (GroupRole("sliding"), GroupRole("entries", 4), GroupRole("entries", 128), GroupRole("overlap", 4))
    assert (spec.entries_per_block(4), spec.entries_per_block(128)) == (16, 1)
    assert [g.block_size for g in spec.groups] == [64, 64, 128, 4]
    layout = spec.layout()
    assert (layout.hit_granularity_tokens, layout.alignment_tokens) == (128, 128)
    # A 1000-token prompt: hits land at multiples of 128; the longest is 896.
    stored, state = _stored_state(spec, 1000)
    assert longest_hit(layout, 1000, state) == 896
    assert stored[1] == set(range(15)) and stored[2] == set(range(7))  # all complete entry chunks
    # The overlap group keeps one 4-token block per multiple of 128, plus one for its own final
    # complete-block boundary (1000; no consumer can hit it: it is not a multiple of 128).
    assert stored[3] == {128 * k // 4 - 1 for k in range(1, 8)} | {1000 // 4 - 1}
    assert compressed_entry_range(4, 896) == (0, 224) and compressed_entry_range(128, 896) == (0, 7)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="not a multiple of the compression rate 4"):
        compressed_entry_range(4, 10)
    with pytest.raises(ValueError, match="overlap_rates"):
        CompressedAttentionLayout(block_size=8, sliding_window=8, compress_rates=(4,), overlap_rates=(8,))
    with pytest.raises(ValueError, match="compress_rates must not be empty"):
        CompressedAttentionLayout(block_size=8, sliding_window=8, compress_rates=())
    with pytest.raises(ValueError, match="block_size"):
        CompressedAttentionLayout(block_size=0, sliding_window=8, compress_rates=(4,))
