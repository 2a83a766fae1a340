"""What a ``FileTier`` instance knows of its records: the index, the sequence, the counters.

``FileIndex`` is touched on the event-loop thread only (so it needs no lock): the LRU index (key ->
record file size, least recently read first), this instance's mutation sequence, the keys with a
write in flight (never evicted), the bytes admitted batches reserved, the counters and ``degraded``.
Dropping keys (``drop``) is one mutation, reported to the removal feed with its sequence.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from kvtier.errors import TierFullError

from ..base import Removal, RemovalFeed
from ..key_counts import KeyCounts
from ..lru import ByteLru

__all__ = ["FileIndex", "COUNTERS"]

# Counters with a TierStatistics field of their own, and temps_removed (in ``extra``).
COUNTERS = ("puts", "put_batches", "gets", "hits", "misses", "corrupt", "mismatched", "quarantined",
            "evictions", "deletes", "errors", "temps_removed")


class FileIndex:
    """A file tier's bookkeeping (event-loop thread); see the module docstring."""

    def __init__(self, capacity: Optional[int], removals: RemovalFeed) -> None:
        self.capacity = capacity
        self.lru: ByteLru[bytes] = ByteLru()  # key -> record file size, least recently read first
        self.sequence = 0  # this instance's mutations (puts landing, removals), in order
        self.reserved = 0  # net growth of admitted batches not landed yet
        self.writing = KeyCounts()  # keys with a write in flight: never evicted
        self.stats: Dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.degraded = False
        self._removals = removals

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence

    def drop(self, keys: Sequence[bytes], reason: str) -> List[Tuple[bytes, int]]:
        """Take ``keys`` out of the index as one mutation and report those that were in it."""
        dropped = [(key, size) for key in keys for size in (self.lru.pop(key),) if size is not None]
        if dropped:
            sequence = self.next_sequence()
            self._removals.publish([Removal(key, sequence, reason) for key, _ in dropped])
        return dropped

    def pick_victims(self, excess: int) -> List[Tuple[bytes, int]]:
        """Drop least-recently-used records (not being written) from the index until ``excess``
        bytes are freed, reported as evicted; all or nothing: raises ``TierFullError`` and changes
        nothing otherwise."""
        chosen = self.lru.choose_victims(excess, keep=self.writing)
        if chosen is None:
            raise TierFullError(
                f"file tier: cannot free {excess} bytes under the capacity of {self.capacity} "
                "bytes: the rest is being written"
            )
        victims = self.drop([key for key, _ in chosen], "evicted")
        self.stats["evictions"] += len(victims)
        return victims
