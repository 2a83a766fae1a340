"""A byte-capacity LRU index with all-or-nothing victim choice, shared by the disk tiers.

Primitive: ``ByteLru`` -- key -> stored bytes, least recently used first, and their total. Not
thread-safe: each tier touches its index from one thread only (the LMDB tier's writer thread, the
file tier's event-loop thread).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container, Iterable, Iterator, List, Mapping, Optional, Tuple

__all__ = ["ByteLru"]


class ByteLru:
    """Stored sizes in least-recently-used order. ``choose_victims`` picks what to drop for room;
    ``reconcile`` compares the index with what a tier finds in storage."""

    __slots__ = ("_sizes", "_total")

    def __init__(self, entries: Iterable[Tuple[bytes, int]] = ()) -> None:
        """``entries``: (key, size), least recently used first."""
        self._sizes: "OrderedDict[bytes, int]" = OrderedDict()
        self._total = 0
        for key, size in entries:
            self.put(key, size)

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __iter__(self) -> Iterator[bytes]:
        """Keys, least recently used first."""
        return iter(self._sizes)

    def get(self, key: bytes, default: Optional[int] = None) -> Optional[int]:
        return self._sizes.get(key, default)

    def put(self, key: bytes, size: int) -> None:
        """Insert or replace ``key`` as the most recently used."""
        old = self._sizes.pop(key, None)
        if old is not None:
            self._total -= old
        self._sizes[key] = size
        self._total += size

    def pop(self, key: bytes) -> Optional[int]:
        """Drop ``key``; its size, or ``None`` if absent."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self._total -= size
        return size

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recently used; False if absent."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def growth(self, sizes: Mapping[bytes, int]) -> int:
        """How many bytes the total would grow by if every (key, size) of ``sizes`` were put."""
        return sum(size - self._sizes.get(key, 0) for key, size in sizes.items())

    def choose_victims(self, excess: int, keep: Container[bytes] = ()) -> Optional[List[Tuple[bytes, int]]]:
        """The least recently used (key, size) pairs, skipping ``keep``, whose sizes add up to at
        least ``excess``; ``[]`` when ``excess <= 0``; ``None`` when even all of them are not enough
        (then nothing should be dropped: the choice is all or nothing). Changes nothing."""
        victims: List[Tuple[bytes, int]] = []
        freed = 0
        if excess <= 0:
            return victims
        for key, size in self._sizes.items():
            if key in keep:
                continue
            victims.append((key, size))
            freed += size
            if freed >= excess:
                return victims
        return None

    def reconcile(self, stored: Mapping[bytes, int], capacity: Optional[int], where: str = "stored") -> List[str]:
        """One line per disagreement between this index and ``stored`` (key -> size found in
        storage), and the byte bound; empty when consistent."""
        problems: List[str] = []
        for key, size in self._sizes.items():
            if key not in stored:
                problems.append(f"indexed but not {where}: {key.hex()}")
            elif stored[key] != size:
                problems.append(f"size differs for {key.hex()}: index {size}, {where} {stored[key]}")
        for key in stored.keys() - self._sizes.keys():
            problems.append(f"{where} but not indexed: {key.hex()}")
        if self._total != sum(self._sizes.values()):
            problems.append("byte count out of step with the index")
        if capacity is not None and self._total > capacity:
            problems.append(f"over capacity: {self._total} > {capacity}")
        return problems
