"""Keys with work in flight, counted per key: a key stays marked while any of its writes runs.

Primitive: ``KeyCounts`` (``add`` keys when a write starts, ``discard`` them when it ends; ``in``
asks whether a key still has a write in flight). Event-loop thread. The file and remote tiers
keep a key with a write in flight out of eviction (and the remote tier holds back an eviction
notice that overtakes its put); two overlapping writes of one key must both end before the key
is free, hence counts rather than a set.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List

__all__ = ["KeyCounts"]


class KeyCounts:
    """A multiset of keys (see the module docstring)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: Dict[bytes, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._counts[key] = self._counts.get(key, 0) + 1

    def discard(self, keys: Iterable[bytes]) -> List[bytes]:
        """End one write of each key; returns the keys no write holds any more."""
        freed: List[bytes] = []
        for key in keys:
            left = self._counts[key] - 1
            if left:
                self._counts[key] = left
            else:
                del self._counts[key]
                freed.append(key)
        return freed
