"""Byte-capacity eviction indexes with all-or-nothing victim choice, shared by the disk tiers.

Primitives: ``ByteLru`` -- key -> stored bytes, least recently used first, and their total;
``ByteLfuda`` -- the same interface in LFU-with-dynamic-aging order (as the host pool's ``lfuda``);
``make_byte_index(name, entries)`` and ``BYTE_INDEX_NAMES`` (by name; an unknown one lists the
valid ones; ``arc-lfuda``, the disk half of the pairing whose host pools run ARC,
``tiers.eviction.ArcLfudaPolicy``, is ``ByteLfuda``). Not thread-safe: each tier touches its index from one thread only (the LMDB tier's
writer thread, the file tier's event-loop thread).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Container, Dict, Generic, Hashable, Iterable, Iterator, List, Mapping, Optional, Tuple, TypeVar, overload

# A tier's keys are bytes; replay's fast mode keys the same indexes with chunk ids.
K = TypeVar("K", bound=Hashable)

__all__ = ["ByteLru", "ByteLfuda", "make_byte_index", "BYTE_INDEX_NAMES"]


class ByteLru(Generic[K]):
    """Stored sizes in least-recently-used order. ``choose_victims`` picks what to drop for room;
    ``reconcile`` compares the index with what a tier finds in storage. One thread only: the
    owning tier's (module docstring)."""

    __slots__ = ("_sizes", "_total")

    def __init__(self, entries: Iterable[Tuple[K, int]] = ()) -> None:
        """``entries``: (key, size), least recently used first."""
        self._sizes: "OrderedDict[K, int]" = OrderedDict()
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

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._sizes)

    @overload
    def get(self, key: K) -> Optional[int]: ...
    @overload
    def get(self, key: K, default: int) -> int: ...
    def get(self, key: K, default: Optional[int] = None) -> Optional[int]:
        return self._sizes.get(key, default)

    def put(self, key: K, size: int) -> None:
        """Insert or replace ``key`` as the most recently used."""
        old = self._sizes.pop(key, None)
        if old is not None:
            self._total -= old
        self._sizes[key] = size
        self._total += size

    def pop(self, key: K) -> Optional[int]:
        """Drop ``key``; its size, or ``None`` if absent."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self._total -= size
        return size

    def touch(self, key: K) -> bool:
        """Make ``key`` the most recently used; False if absent."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def growth(self, sizes: Mapping[K, int]) -> int:
        """How many bytes the total would grow by if every (key, size) of ``sizes`` were put."""
        return sum(size - self._sizes.get(key, 0) for key, size in sizes.items())

    def choose_victims(self, excess: int, keep: Container[K] = ()) -> Optional[List[Tuple[K, int]]]:
        """The least recently used (key, size) pairs, skipping ``keep``, whose sizes add up to at
        least ``excess``; ``[]`` when ``excess <= 0``; ``None`` when even all of them are not enough
        (then nothing should be dropped: the choice is all or nothing). Changes nothing."""
        victims: List[Tuple[K, int]] = []
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

    def reconcile(self: "ByteLru[bytes]", stored: Mapping[bytes, int], capacity: Optional[int],
                  where: str = "stored") -> List[str]:
        """One line per disagreement between this index and ``stored`` (key -> size found in
        storage), and the byte bound; empty when consistent. For a tier's index (bytes keys,
        shown in hex)."""
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


class ByteLfuda(ByteLru[K]):
    """``ByteLru``'s interface in LFU-DA order: each ``put`` or ``touch`` of a key adds one to its
    count, its priority is ``L + count`` (``L``: the priority of the last record dropped), the
    lowest goes first, equal ones least recently used first. Counts outlive the records (a chunk
    written again keeps its history), halved every ``history`` accesses (zeros dropped) so at most
    about that many keys are remembered. A size change by ``put`` is an access like any other.
    One thread only, as ``ByteLru``."""

    __slots__ = ("_rank", "_heap", "_counts", "_age", "_sequence", "_samples", "_history")

    def __init__(self, entries: Iterable[Tuple[K, int]] = (), history: int = 1 << 20) -> None:
        self._rank: Dict[K, Tuple[float, int]] = {}
        self._heap: List[Tuple[float, int, K]] = []
        self._counts: Dict[K, int] = {}
        self._age = 0.0
        self._sequence = 0
        self._samples = 0
        self._history = max(1, int(history))
        super().__init__(entries)

    @property
    def age(self) -> float:
        return self._age

    def count(self, key: K) -> int:
        return self._counts.get(key, 0)

    def _access(self, key: K) -> None:
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        self._samples += 1
        if self._samples >= self._history:
            self._samples = 0
            self._counts = {k: c >> 1 for k, c in self._counts.items() if c > 1}
        self._sequence += 1
        rank = (self._age + count, self._sequence)
        self._rank[key] = rank
        heapq.heappush(self._heap, (rank[0], rank[1], key))
        if len(self._heap) > 2 * len(self._rank) + 64:
            self._heap = [(p, q, k) for k, (p, q) in self._rank.items()]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[K]:
        """Keys, first victim first."""
        return iter(sorted(self._rank, key=self._rank.__getitem__))

    def put(self, key: K, size: int) -> None:
        super().put(key, size)
        self._access(key)

    def pop(self, key: K) -> Optional[int]:
        """Drop ``key`` (evicted or removed): ``L`` becomes its priority if that is higher."""
        size = super().pop(key)
        if size is not None:
            self._age = max(self._age, self._rank.pop(key)[0])
        return size

    def touch(self, key: K) -> bool:
        if key not in self._sizes:
            return False
        self._access(key)
        return True

    def choose_victims(self, excess: int, keep: Container[K] = ()) -> Optional[List[Tuple[K, int]]]:
        victims: List[Tuple[K, int]] = []
        if excess <= 0:
            return victims
        heap, rank, sizes = self._heap, self._rank, self._sizes
        popped: List[Tuple[float, int, K]] = []
        freed = 0
        try:
            while heap:
                item = heapq.heappop(heap)
                live = rank.get(item[2])
                if live is None or live[1] != item[1]:
                    continue  # stale: accessed or dropped since
                popped.append(item)
                key = item[2]
                if key in keep:
                    continue
                victims.append((key, sizes[key]))
                freed += sizes[key]
                if freed >= excess:
                    return victims
            return None
        finally:
            for item in popped:
                heapq.heappush(heap, item)


_BYTE_INDEXES = {"lru": ByteLru, "lfuda": ByteLfuda, "arc-lfuda": ByteLfuda}
BYTE_INDEX_NAMES: Tuple[str, ...] = tuple(sorted(_BYTE_INDEXES))


def make_byte_index(name: str, entries: Iterable[Tuple[K, int]] = ()) -> ByteLru[K]:
    """A new index of eviction policy ``name`` over ``entries`` (coldest first). Unknown name:
    ValueError listing the valid names."""
    try:
        cls = _BYTE_INDEXES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown disk eviction policy {name!r}; valid names: "
                         f"{', '.join(repr(n) for n in BYTE_INDEX_NAMES)}") from None
    index: ByteLru[K] = cls(entries)
    return index
