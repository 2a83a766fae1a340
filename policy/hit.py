"""The longest valid hit over per-chunk states.

Primitives: ``ChunkState`` (what the engine knows of one stored chunk) and ``longest_hit``. Pure and
synchronous; the engine calls it on its event-loop thread with a state function over its own tables.
"""

from __future__ import annotations

import enum
from typing import Callable, Dict, FrozenSet, List, Optional

from .coverage import retained_chunk_range
from .geometry import ModelLayout

__all__ = ["ChunkState", "longest_hit", "StateFn"]


class ChunkState(enum.Enum):
    """A chunk as a lookup sees it.

    ``READY``: readable now (host or disk). ``PENDING``: its device -> host copy is in flight.
    ``LOADING``: a disk -> host or host -> device copy is in flight. ``MISSING``: not stored.
    """

    MISSING = "missing"
    PENDING = "pending"
    READY = "ready"
    LOADING = "loading"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is a Python call, per chunk


StateFn = Callable[[int, int], ChunkState]

_READY_ONLY: FrozenSet[ChunkState] = frozenset({ChunkState.READY})
_READY_SOON: FrozenSet[ChunkState] = frozenset({ChunkState.READY, ChunkState.PENDING, ChunkState.LOADING})


def longest_hit(layout: ModelLayout, max_tokens: int, state: StateFn) -> Optional[int]:
    """The longest hit ``H <= max_tokens`` whose retained chunks are READY in every group.

    ``H`` ranges over multiples of ``layout.hit_granularity_tokens``; ``H`` is valid when every chunk
    meeting ``retained_interval(g, H)`` is READY in every group (``H = 0`` always is). Returns the
    largest valid ``H``, or ``None`` when a larger ``H`` would be valid once the PENDING/LOADING
    chunks became READY: the caller should ask again next step rather than admit a shorter hit now.

    Cost: each chunk's state is read at most once per group, so O(chunks), not O(tokens x chunks);
    one read when a full-attention group's chunk 0 is MISSING (nothing shared: the hit is 0).
    The search walks ``H`` downward; a chunk that is not readable rules out every ``H`` whose
    interval still reaches it, so ``H`` jumps straight below that chunk.
    """
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
    granularity = layout.hit_granularity_tokens
    boundary = (max_tokens // granularity) * granularity
    groups = layout.groups
    num_groups = len(groups)
    if boundary > 0:
        # Every H > 0 needs chunk 0 of each group that keeps its whole prefix (full attention). One
        # read settles a prompt that shares nothing (the common miss) without walking every chunk,
        # and spares the caller the keys of the rest of the prompt.
        first_states: Dict[int, ChunkState] = {}
        for gi, group in enumerate(groups):
            if group.retained_span is None:
                first_state = state(gi, 0)
                if first_state is ChunkState.MISSING:
                    return 0
                first_states[gi] = first_state
        if first_states:
            state = _remembering(state, first_states)
    # Per group: chunks [known_lo, known_hi] are known acceptable (empty when known_lo > known_hi);
    # chunks found PENDING/LOADING are remembered to decide READY-now versus READY-soon at the end.
    known_lo = [0] * num_groups
    known_hi = [-1] * num_groups
    waiting: List[List[int]] = [[] for _ in range(num_groups)]

    while boundary > 0:
        moved = False
        for gi in range(num_groups):
            group = groups[gi]
            first, last = retained_chunk_range(group, boundary)
            if last < first:
                continue
            lo, hi = known_lo[gi], known_hi[gi]
            if last > hi or last < lo - 1:
                lo, hi = last + 1, last  # forget: the new range lies apart from what we know
            chunk = min(last, lo - 1)
            bad = -1
            while chunk >= first:
                chunk_state = state(gi, chunk)
                if chunk_state is ChunkState.READY:
                    pass
                elif chunk_state in _READY_SOON:
                    waiting[gi].append(chunk)
                else:
                    bad = chunk
                    break
                lo = chunk
                chunk -= 1
            if bad >= 0:
                known_lo[gi], known_hi[gi] = bad, bad - 1
                # Every boundary whose interval still reaches chunk `bad` is invalid: jump below it.
                limit = bad * group.tokens_per_chunk - group.trailing_extension
                boundary = (max(limit, 0) // granularity) * granularity
                moved = True
                break
            known_lo[gi], known_hi[gi] = lo, hi
        if not moved:
            break

    if boundary <= 0:
        return 0
    # `boundary` is the largest H valid once in-flight chunks land; it is valid now only if none of
    # the chunks still in flight lies inside its retained ranges.
    for gi in range(num_groups):
        if waiting[gi]:
            first, last = retained_chunk_range(groups[gi], boundary)
            if any(first <= chunk <= last for chunk in waiting[gi]):
                return None
    return boundary


def _remembering(state: StateFn, first_states: Dict[int, ChunkState]) -> StateFn:
    """``state``, answering chunk 0 of the groups in ``first_states`` from what was already read
    (each chunk's state is read at most once per group)."""

    def remembered(group_index: int, chunk_index: int) -> ChunkState:
        if chunk_index == 0:
            known = first_states.get(group_index)
            if known is not None:
                return known
        return state(group_index, chunk_index)

    return remembered
