"""vLLM's prefix-cache retention interval as a store policy: which boundaries a producer serves.

vLLM 0.33's ``prefix_cache_retention_interval`` trades stored bytes for hits: ``None`` keeps a
sliding-window tail at every alignment boundary (kvtier's dense ``reachable_store_block_mask``),
``0`` only at the final boundary of the request, ``k`` once every ``k`` tokens (plus the final one).
Pure, synchronous, any thread.

Primitives: ``retention_boundaries`` (the boundaries served), ``retention_store_block_mask`` (the
blocks a producer stores for them), ``retention_store_chunk_indices`` (the chunks),
``retention_speculative_limit`` (below it, those only a partial-prefix hit can read).
"""

from __future__ import annotations

from typing import List, Optional

from .coverage import reachable_store_block_mask, store_block_mask_for_boundaries
from .geometry import ModelLayout

__all__ = ["retention_boundaries", "retention_store_block_mask", "retention_store_chunk_indices",
           "retention_speculative_limit", "check_retention_interval"]


def check_retention_interval(layout: ModelLayout, retention_interval: Optional[int]) -> None:
    """``None``, ``0``, or a positive multiple of ``layout.alignment_tokens`` (hits land only there)."""
    if retention_interval is None:
        return
    alignment = layout.alignment_tokens
    if isinstance(retention_interval, bool) or not isinstance(retention_interval, int) or retention_interval < 0 or (
        retention_interval and retention_interval % alignment
    ):
        raise ValueError(
            f"retention_interval must be None, 0 or a positive multiple of alignment_tokens ({alignment}), "
            f"got {retention_interval!r}"
        )


def retention_boundaries(layout: ModelLayout, group_index: int, num_tokens: int,
                         retention_interval: Optional[int]) -> List[int]:
    """Ascending boundaries ``H`` a producer of ``num_tokens`` tokens serves for one group.

    ``None``: every multiple of ``alignment_tokens`` up to ``num_tokens``; ``k > 0``: every multiple
    of ``k``; ``0``: none of those. Always added: the last multiple of ``alignment_tokens`` (where a
    consumer continuing this request hits) and the group's final complete-block boundary.
    """
    check_retention_interval(layout, retention_interval)
    if not isinstance(group_index, int) or not 0 <= group_index < len(layout.groups):
        raise ValueError(f"group_index must be in [0, {len(layout.groups)}), got {group_index!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    alignment = layout.alignment_tokens
    step = alignment if retention_interval is None else retention_interval
    found = set(range(step, num_tokens + 1, step)) if step else set()
    found.add(num_tokens // alignment * alignment)
    block_size = layout.groups[group_index].block_size
    found.add(num_tokens // block_size * block_size)
    found.discard(0)
    return sorted(found)


def retention_store_block_mask(layout: ModelLayout, group_index: int, num_tokens: int,
                               retention_interval: Optional[int]) -> List[bool]:
    """One bool per complete block of the group: stored under this retention interval?
    ``None`` is exactly ``reachable_store_block_mask``."""
    if retention_interval is None:
        check_retention_interval(layout, None)
        return reachable_store_block_mask(layout, group_index, num_tokens)
    group = layout.groups[group_index]
    boundaries = retention_boundaries(layout, group_index, num_tokens, retention_interval)
    if group.sliding_window is None:
        return [True] * (num_tokens // group.block_size)
    return store_block_mask_for_boundaries(group, num_tokens, boundaries)


def retention_store_chunk_indices(layout: ModelLayout, group_index: int, num_tokens: int,
                                  retention_interval: Optional[int]) -> List[int]:
    """Complete chunks of the group holding at least one block of ``retention_store_block_mask``."""
    if (type(group_index) is int and 0 <= group_index < len(layout.groups) and type(num_tokens) is int
            and num_tokens >= 0 and layout.groups[group_index].sliding_window is None):
        # Full attention: the mask holds every complete block, so every complete chunk (a store's
        # common case, without a per-block mask); other arguments take the general path and its errors.
        check_retention_interval(layout, retention_interval)
        return list(range(num_tokens // layout.groups[group_index].tokens_per_chunk))
    group = layout.groups[group_index]
    mask = retention_store_block_mask(layout, group_index, num_tokens, retention_interval)
    per_chunk = group.blocks_per_chunk
    return [c for c in range(num_tokens // group.tokens_per_chunk) if any(mask[c * per_chunk : (c + 1) * per_chunk])]



def retention_speculative_limit(layout: ModelLayout, group_index: int, num_tokens: int,
                                retention_interval: Optional[int]) -> int:
    """Stored chunks of the group below this index are interior tails: a sliding group's chunks
    that end more than the window (``W + R`` tokens, and a chunk of margin) before the earliest
    boundary the final one serves (interval ``0``), so only a hit ending inside the prompt reads
    them. ``0`` (none) for a full-attention group and for interval ``0``. Eviction may let these
    go first. Arithmetic only: no per-block mask on the store path."""
    group = layout.groups[group_index]
    if group.sliding_window is None or retention_interval == 0:
        return 0
    final = retention_boundaries(layout, group_index, num_tokens, 0)
    if not final:
        return 0
    reach = group.sliding_window + group.extra_retained_tokens + group.tokens_per_chunk
    return max(0, (final[0] - reach) // group.tokens_per_chunk)
