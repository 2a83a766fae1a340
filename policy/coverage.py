"""The SWA + MTP coverage contract: one retained interval, and everything derived from it.

Primitives (pure, synchronous, any thread):

- ``retained_interval(group, H)``: the token interval a hit at boundary ``H`` needs from ``group``.
- ``num_skipped_tokens``: allocation side, the tokens a hit never restores.
- ``sliding_window_size_in_chunks`` / ``load_window_size_in_chunks``: the seed's documented lookup and
  load windows, kept unchanged (they over-ask by one chunk in one corner case, never under-ask).
- ``reachable_store_block_mask``: which blocks a producer must store so that every boundary a
  consumer can reach is served, and nothing else.
- ``store_spec``: the MTP-widened spec the store mask is computed with (derived, never mutated).

Every function here reads the interval through ``retained_interval`` so lookup, load, allocation and
store pruning cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

from .geometry import AttentionGroup, ModelLayout, cdiv

__all__ = [
    "retained_interval",
    "retained_chunk_range",
    "num_skipped_tokens",
    "sliding_window_size_in_chunks",
    "load_window_size_in_chunks",
    "reachable_store_block_mask",
    "store_spec",
    "store_block_mask_for_boundaries",
]


def _require_tokens(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def retained_interval(group: AttentionGroup, boundary_tokens: int) -> Tuple[int, int]:
    """Tokens ``[start, end)`` that must be readable for a hit ending at ``boundary_tokens`` (``H``).

    Sliding window: ``[max(0, H - (W - 1 + R)), H)``: the last ``W - 1`` tokens the next token
    attends to plus the ``R`` tokens MTP may re-prefill. Full attention: ``[0, H)``. An EAGLE group's
    end moves one block right: its trailing block is recomputed, so a hit needs it present.
    """
    _require_tokens("boundary_tokens", boundary_tokens)
    end = boundary_tokens + group.trailing_extension
    span = group.retained_span
    start = 0 if span is None else max(0, boundary_tokens - span)
    return start, end


def retained_chunk_range(group: AttentionGroup, boundary_tokens: int) -> Tuple[int, int]:
    """Chunk indices ``[first, last]`` meeting ``retained_interval(group, H)``; empty when last < first."""
    start, end = retained_interval(group, boundary_tokens)
    tokens_per_chunk = group.tokens_per_chunk
    if end <= start:
        return 0, -1
    return start // tokens_per_chunk, (end - 1) // tokens_per_chunk


def num_skipped_tokens(group: AttentionGroup, num_tokens: int) -> int:
    """Allocation side: how many leading tokens of an ``n``-token hit are never restored.

    ``max(0, n - W + 1 - R)`` for a sliding-window group, 0 for full attention.
    """
    _require_tokens("num_tokens", num_tokens)
    span = group.retained_span
    if span is None:
        return 0
    return max(0, num_tokens - span)


def sliding_window_size_in_chunks(group: AttentionGroup) -> Optional[int]:
    """The seed's lookup coverage at a chunk-aligned end: ``max(cdiv(W, T), cdiv(W - 1 + R, T))``.

    ``None`` for full attention. The outer ``max`` keeps one retained token from asking for one more
    chunk; against the exact interval it over-asks by one chunk only when ``R = 0`` and
    ``W = 1 (mod T)``.
    """
    window, span = group.sliding_window, group.retained_span
    if window is None or span is None:  # both None exactly for full attention
        return None
    tokens_per_chunk = group.tokens_per_chunk
    return max(cdiv(window, tokens_per_chunk), cdiv(span, tokens_per_chunk))


def load_window_size_in_chunks(group: AttentionGroup, num_tokens: int) -> Optional[int]:
    """The seed's per-request load window for a hit ending at any ``n``.

    ``max(SW, cdiv(W - 1 + R + rho, T))`` with ``rho = (-n) mod T``: an unaligned end leaves the
    last chunk partly past the hit, so the window reaches one chunk further back. ``None`` for full
    attention.
    """
    _require_tokens("num_tokens", num_tokens)
    window = sliding_window_size_in_chunks(group)
    span = group.retained_span
    if window is None or span is None:
        return None
    tokens_per_chunk = group.tokens_per_chunk
    rho = (-num_tokens) % tokens_per_chunk
    return max(window, cdiv(span + rho, tokens_per_chunk))


def store_spec(group: AttentionGroup) -> AttentionGroup:
    """The spec the store mask is computed with: window ``W + R`` and no extra tokens.

    MTP widens only what a producer stores; the attention window, keys and ownership stay those of
    the real spec, so this is a derived copy (``dataclasses.replace``), never a mutation.
    """
    if group.sliding_window is None or group.extra_retained_tokens == 0:
        return group
    return dataclasses.replace(
        group,
        sliding_window=group.sliding_window + group.extra_retained_tokens,
        extra_retained_tokens=0,
    )


def reachable_store_block_mask(layout: ModelLayout, group_index: int, num_tokens: int) -> List[bool]:
    """One bool per complete block of ``layout.groups[group_index]``: must a producer store it?

    A block is stored iff it meets ``retained_interval(g, H)`` for some boundary ``H`` a consumer can
    reach: each multiple of ``alignment_tokens`` up to ``num_tokens`` and the group's final
    complete-block boundary, counting a boundary only when every chunk its interval touches is
    complete within ``num_tokens`` (an incomplete chunk is never stored, so that boundary can never
    be served). Full attention: every block. Cost: O(boundaries + blocks).
    """
    if not isinstance(group_index, int) or not 0 <= group_index < len(layout.groups):
        raise ValueError(f"group_index must be in [0, {len(layout.groups)}), got {group_index!r}")
    _require_tokens("num_tokens", num_tokens)
    group = layout.groups[group_index]
    block_size = group.block_size
    num_blocks = num_tokens // block_size
    if group.sliding_window is None:
        return [True] * num_blocks

    alignment = layout.alignment_tokens
    boundaries = list(range(alignment, num_tokens + 1, alignment))
    final_boundary = num_blocks * block_size
    if final_boundary and (not boundaries or boundaries[-1] != final_boundary):
        boundaries.append(final_boundary)
    return store_block_mask_for_boundaries(group, num_tokens, boundaries)


def store_block_mask_for_boundaries(group: AttentionGroup, num_tokens: int, boundaries: Sequence[int]) -> List[bool]:
    """One bool per complete block: does it meet ``retained_interval`` (MTP-widened, ``store_spec``)
    of one of ``boundaries``? A boundary counts only when every chunk its interval touches is
    complete within ``num_tokens``. The shared core of every store mask (dense, retention)."""
    block_size = group.block_size
    num_blocks = num_tokens // block_size
    spec = store_spec(group)
    storable_end = (num_tokens // spec.tokens_per_chunk) * spec.tokens_per_chunk
    # Difference array over blocks: +1 where a retained interval starts, -1 past where it ends.
    delta = [0] * (num_blocks + 1)
    for boundary in boundaries:
        start, end = retained_interval(spec, boundary)
        if end <= start or end > storable_end:
            continue
        delta[start // block_size] += 1
        delta[(end - 1) // block_size + 1] -= 1
    return [depth > 0 for depth in accumulate(delta[:num_blocks])]
