"""Per-request plans derived from the coverage contract: which chunks a producer stores and which
blocks a consumer loads. Pure; the engine calls these on its event-loop thread.

Primitives: ``store_chunk_indices`` (chunks to store for ``n`` final tokens), ``load_block_plan``
(per chunk of a hit, which of its blocks to restore).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .coverage import reachable_store_block_mask, retained_chunk_range, retained_interval
from .geometry import ModelLayout

__all__ = ["store_chunk_indices", "load_block_plan", "LoadChunkPlan"]

# (chunk index, per block of the chunk: the logical block index to restore, or None to skip it)
LoadChunkPlan = Tuple[int, List[Optional[int]]]


def store_chunk_indices(layout: ModelLayout, group_index: int, num_tokens: int) -> List[int]:
    """Chunks of one group a producer with ``num_tokens`` final tokens must store.

    A chunk is the unit of storage, so it is stored when any of its blocks is in
    ``reachable_store_block_mask``; only complete chunks are ever stored.
    """
    group = layout.groups[group_index]
    per_chunk = group.blocks_per_chunk
    mask = reachable_store_block_mask(layout, group_index, num_tokens)
    complete = num_tokens // group.tokens_per_chunk
    return [c for c in range(complete) if any(mask[c * per_chunk : (c + 1) * per_chunk])]


def load_block_plan(layout: ModelLayout, group_index: int, hit_tokens: int) -> List[LoadChunkPlan]:
    """For a hit of ``hit_tokens``, the chunks of one group to read and, per chunk, which logical
    blocks to restore.

    Chunks are those meeting ``retained_interval`` (what ``longest_hit`` checked). Within them only
    blocks meeting ``[start, H)`` are restored: blocks wholly before the window are never attended
    (allocation gave them no device block), and blocks at or past ``H`` (the EAGLE trailing block,
    the tail of an unaligned last chunk) are recomputed by the consumer.
    """
    group = layout.groups[group_index]
    if hit_tokens <= 0:
        return []
    first, last = retained_chunk_range(group, hit_tokens)
    start, _ = retained_interval(group, hit_tokens)
    block_size = group.block_size
    first_block = start // block_size
    last_block = (hit_tokens - 1) // block_size
    per_chunk = group.blocks_per_chunk
    plan: List[LoadChunkPlan] = []
    for chunk in range(first, last + 1):
        lo, hi = chunk * per_chunk, (chunk + 1) * per_chunk
        if first_block <= lo and hi - 1 <= last_block:  # the common case: every block restored
            plan.append((chunk, list(range(lo, hi))))
            continue
        blocks: List[Optional[int]] = [block if first_block <= block <= last_block else None for block in range(lo, hi)]
        if any(b is not None for b in blocks):
            plan.append((chunk, blocks))
    return plan
