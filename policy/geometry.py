"""Group geometry: what one KV-cache group looks like and how groups make a model layout.

Primitives: ``AttentionGroup`` (one group's block/chunk/window spec), ``ModelLayout`` (the groups of
one model and the token granularities derived from them), ``cdiv``. Pure and synchronous; safe on any
thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

__all__ = ["AttentionGroup", "ModelLayout", "cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


# Token and block counts live in int32 in serving engines' block tables (vLLM) and in 64-bit
# fields of the keys; a count past 2**31 is a typo, refused here rather than failing in a key.
MAX_COUNT = 2**31 - 1


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a block size is always a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    if value > MAX_COUNT:
        raise ValueError(f"{name} must be at most 2**31 - 1, got {value!r}")


@dataclass(frozen=True)
class AttentionGroup:
    """One KV-cache group: layers that share one attention spec (vLLM's hybrid allocator).

    ``block_size`` tokens make one device block; ``blocks_per_chunk`` blocks make one chunk, the unit
    kvtier stores and keys. ``sliding_window`` is ``W`` (``None`` for full attention);
    ``extra_retained_tokens`` is ``R``, the tokens older than the window that multi-token prediction
    may re-prefill and so must stay restorable. ``is_eagle`` marks an EAGLE/MTP drafter group whose
    trailing block is volatile (recomputed), so a hit needs one block more than it restores.
    """

    block_size: int
    blocks_per_chunk: int = 1
    sliding_window: Optional[int] = None
    extra_retained_tokens: int = 0
    is_eagle: bool = False

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1)
        _require_int("blocks_per_chunk", self.blocks_per_chunk, 1)
        if self.sliding_window is not None:
            _require_int("sliding_window", self.sliding_window, 1)
        _require_int("extra_retained_tokens", self.extra_retained_tokens, 0)
        if self.sliding_window is None and self.extra_retained_tokens != 0:
            raise ValueError(
                "extra_retained_tokens must be 0 for a full-attention group "
                f"(sliding_window=None), got {self.extra_retained_tokens!r}"
            )
        if not isinstance(self.is_eagle, bool):
            raise ValueError(f"is_eagle must be a bool, got {self.is_eagle!r}")

    @property
    def tokens_per_chunk(self) -> int:
        """``T = block_size * blocks_per_chunk``."""
        return self.block_size * self.blocks_per_chunk

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    @property
    def retained_span(self) -> Optional[int]:
        """``W - 1 + R``: how far back from a boundary a sliding-window group must be restorable."""
        if self.sliding_window is None:
            return None
        return self.sliding_window - 1 + self.extra_retained_tokens

    @property
    def trailing_extension(self) -> int:
        """Tokens past the boundary a hit needs present: one block for EAGLE, else none."""
        return self.block_size if self.is_eagle else 0


@dataclass(frozen=True, init=False)
class ModelLayout:
    """The KV-cache groups of one model, in the serving process's group order.

    ``alignment_tokens`` (``A``) is where producers' hits land: the full-attention chunk size when all
    full-attention groups share one, else the largest chunk size. ``hit_granularity_tokens`` is the
    step of candidate hit lengths: the smallest block size. Either may be given explicitly (then the
    alignment must be a multiple of the hit granularity); after construction both attributes hold the effective value, so a layout
    always reads the same.
    """

    groups: Tuple[AttentionGroup, ...]
    # Typed as what they hold once built; the constructor below takes None for "derive it".
    alignment_tokens: int
    hit_granularity_tokens: int

    def __init__(
        self,
        groups: Sequence[AttentionGroup],
        alignment_tokens: Optional[int] = None,
        hit_granularity_tokens: Optional[int] = None,
    ) -> None:
        if isinstance(groups, (AttentionGroup, str, bytes)) or not isinstance(groups, Sequence):
            raise ValueError(f"groups must be a sequence of AttentionGroup, got {groups!r}")
        groups = tuple(groups)
        if not groups:
            raise ValueError("groups must not be empty, got ()")
        for index, group in enumerate(groups):
            if not isinstance(group, AttentionGroup):
                raise ValueError(f"groups[{index}] must be an AttentionGroup, got {group!r}")
        object.__setattr__(self, "groups", groups)

        explicit_alignment = alignment_tokens is not None
        explicit_granularity = hit_granularity_tokens is not None
        if alignment_tokens is None:
            full_chunk_sizes = {g.tokens_per_chunk for g in groups if not g.is_sliding}
            if len(full_chunk_sizes) == 1:
                alignment_tokens = full_chunk_sizes.pop()
            else:
                alignment_tokens = max(g.tokens_per_chunk for g in groups)
        else:
            _require_int("alignment_tokens", alignment_tokens, 1)
        if hit_granularity_tokens is None:
            hit_granularity_tokens = min(g.block_size for g in groups)
        else:
            _require_int("hit_granularity_tokens", hit_granularity_tokens, 1)
        object.__setattr__(self, "alignment_tokens", alignment_tokens)
        object.__setattr__(self, "hit_granularity_tokens", hit_granularity_tokens)
        if (explicit_alignment or explicit_granularity) and self.alignment_tokens % self.hit_granularity_tokens:
            # Producers store for boundaries at multiples of alignment_tokens, consumers ask for hits
            # at multiples of hit_granularity_tokens: a boundary that is no hit length is stored for
            # nothing, and the hits between are never stored for.
            raise ValueError(
                f"alignment_tokens ({self.alignment_tokens}) must be a multiple of hit_granularity_tokens "
                f"({self.hit_granularity_tokens})"
            )

    def __len__(self) -> int:
        return len(self.groups)
