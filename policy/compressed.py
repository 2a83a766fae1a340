"""Compressed attention (DeepSeek-V4 style) in kvtier's group layout.

A compressed-attention layer keeps three things for a prefix of ``H`` tokens:

- a sliding window of per-token K (=V) over the last ``W - 1`` tokens (plus ``R`` for MTP);
- compressed entries, one per ``rate`` tokens, covering the whole history: entry ``i`` summarises
  tokens ``[i * rate, (i + 1) * rate)``;
- compressor state: the ``H mod rate`` tokens not yet compressed (the buffer) and, for overlapping
  compressors (CSA), the per-token projections of the last complete window (the overlap), which
  the next entry mixes in.

kvtier restores only at boundaries that are multiples of every rate, where every buffer is empty
(see docs/ARCHITECTURE.md, "Compressed attention"). Then each piece is an ordinary group:

- ``sliding``: an SWA group (``W``, ``R``) of per-token K=V;
- ``entries`` (one per rate): a full-attention group whose block holds ``entries_per_block``
  entries, i.e. ``entries_per_block * rate`` tokens; a hit at ``H`` needs entries ``[0, H / rate)``,
  which are exactly the blocks meeting the token interval ``[0, H)``;
- ``overlap`` (one per overlapping rate): an SWA group of per-token compressor state with block
  size ``rate`` and window ``rate + 1``: its retained interval ``[H - rate, H)`` is the last window.

Primitives (pure, synchronous, any thread): ``CompressedAttentionLayout`` (the groups, their roles
and the ``ModelLayout`` with the hit granularity set to ``lcm(rates)``), ``compressed_entry_range``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import Tuple

from .geometry import AttentionGroup, ModelLayout

__all__ = ["CompressedAttentionLayout", "GroupRole", "compressed_entry_range"]

SLIDING = "sliding"
ENTRIES = "entries"
OVERLAP = "overlap"


@dataclass(frozen=True)
class GroupRole:
    """What one group of a compressed-attention layout holds: ``kind`` is ``"sliding"``,
    ``"entries"`` or ``"overlap"``; ``rate`` is the compression rate (``None`` for sliding)."""

    kind: str
    rate: int | None = None


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def compressed_entry_range(rate: int, boundary_tokens: int) -> Tuple[int, int]:
    """Entries ``[0, H / rate)`` a hit at ``H`` needs from a compressor of ``rate``.

    ``H`` must be a multiple of ``rate``: elsewhere the compressor's buffer is not empty and kvtier
    does not store buffers (``ValueError``).
    """
    _positive("rate", rate)
    if not isinstance(boundary_tokens, int) or isinstance(boundary_tokens, bool) or boundary_tokens < 0:
        raise ValueError(f"boundary_tokens must be a non-negative int, got {boundary_tokens!r}")
    if boundary_tokens % rate:
        raise ValueError(
            f"boundary_tokens={boundary_tokens} is not a multiple of the compression rate {rate}: "
            "the compressor buffer would not be empty"
        )
    return 0, boundary_tokens // rate


@dataclass(frozen=True)
class CompressedAttentionLayout:
    """The kvtier groups of a compressed-attention model (DeepSeek-V4: CSA rate 4, HCA rate 128).

    ``block_size`` is the sliding group's block (tokens); each ``entries`` group's block is
    ``lcm(block_size, rate)`` tokens (``entries_per_block(rate)`` entries), so a block always holds
    whole entries. ``compress_rates`` lists the rates with compressed entries, ``overlap_rates`` the
    rates whose compressor carries per-token state across windows (CSA's overlapping windows).
    Groups, in order: sliding, entries per rate (ascending), overlap per rate (ascending).
    """

    block_size: int
    sliding_window: int
    compress_rates: Tuple[int, ...]
    overlap_rates: Tuple[int, ...] = ()
    blocks_per_chunk: int = 1
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("sliding_window", self.sliding_window)
        _positive("blocks_per_chunk", self.blocks_per_chunk)
        rates = tuple(sorted({_positive("compress_rates[]", r) for r in self.compress_rates}))
        overlap = tuple(sorted({_positive("overlap_rates[]", r) for r in self.overlap_rates}))
        if not rates:
            raise ValueError("compress_rates must not be empty (a model without compression is plain SWA)")
        if not set(overlap) <= set(rates):
            raise ValueError(f"overlap_rates {overlap} must be among compress_rates {rates}")
        object.__setattr__(self, "compress_rates", rates)
        object.__setattr__(self, "overlap_rates", overlap)
        # AttentionGroup validates extra_retained_tokens.
        self.groups  # noqa: B018 - construct once so bad arguments fail here

    def entries_per_block(self, rate: int) -> int:
        """Entries one block of the ``entries`` group of ``rate`` holds."""
        return lcm(self.block_size, rate) // rate

    @property
    def roles(self) -> Tuple[GroupRole, ...]:
        return (
            (GroupRole(SLIDING),)
            + tuple(GroupRole(ENTRIES, r) for r in self.compress_rates)
            + tuple(GroupRole(OVERLAP, r) for r in self.overlap_rates)
        )

    @property
    def groups(self) -> Tuple[AttentionGroup, ...]:
        sliding = AttentionGroup(
            block_size=self.block_size,
            blocks_per_chunk=self.blocks_per_chunk,
            sliding_window=self.sliding_window,
            extra_retained_tokens=self.extra_retained_tokens,
        )
        entries = tuple(
            AttentionGroup(block_size=lcm(self.block_size, r), blocks_per_chunk=self.blocks_per_chunk)
            for r in self.compress_rates
        )
        # Window rate + 1 and R = 0: retained_interval is [H - rate, H), the last complete window,
        # whatever MTP does to the sliding group (MTP re-prefills the sliding branch only).
        overlap = tuple(AttentionGroup(block_size=r, sliding_window=r + 1) for r in self.overlap_rates)
        return (sliding,) + entries + overlap

    @property
    def hit_granularity_tokens(self) -> int:
        """``lcm(rates)``: the boundaries where every compressor buffer is empty."""
        return lcm(*self.compress_rates)

    @property
    def alignment_tokens(self) -> int:
        """Where producers' boundaries land: ``lcm`` of the rates and of every entries group's chunk
        size, so each boundary ends a complete chunk of every entries group."""
        groups = self.groups
        entry_chunks = [groups[i].tokens_per_chunk for i, role in enumerate(self.roles) if role.kind == ENTRIES]
        return lcm(self.hit_granularity_tokens, *entry_chunks)

    def layout(self) -> ModelLayout:
        return ModelLayout(
            self.groups,
            alignment_tokens=self.alignment_tokens,
            hit_granularity_tokens=self.hit_granularity_tokens,
        )
