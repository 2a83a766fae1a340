"""Which chunk keys the disk tier holds, as the engine believes: adds and removals in order.

Primitives: ``DiskIndex`` (``key in index``, ``add``, ``remove``, ``refresh``, ``admit`` (one page
of the start-up listing), ``begin``/``end``
of an operation that races with removals), ``Stamp``. Event-loop thread only.

Why ordering matters: the tier reports removals (capacity eviction, quarantine, deletes) from its
own threads, so a removal can reach the loop *before* the answer of a put that wrote the same key
earlier, or while a listing taken before the removal is still on its way. Adding the key back then
gives ``lookup`` a hit that ``load`` fails. Two clocks order an add against a removal:

- the tier's mutation sequence (tier contract: a key is readable iff the put that wrote it returned
  ``p`` greater than the sequence ``s`` of its latest removal; a ``KeySnapshot(keys, s)`` reflects
  every removal up to ``s``) -- exact, used whenever the tier reports it;
- the engine's own clock, ticking on the loop at every add and removal: a removal that reaches the
  loop while a put or a listing of its key is in flight, and that the tier's sequence cannot place,
  wins. That may cost a hit (the key was rewritten after all) but never gives a false one; and a
  listing only removes keys added before it began.

Removals are remembered only while an operation that began before them is still in flight.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

__all__ = ["DiskIndex", "Stamp", "keys_of"]

# (engine clock, tier sequence or None when the tier has none)
Stamp = Tuple[int, Optional[int]]


class DiskIndex:
    """Keys on disk, each with the stamp of the operation that put it in the index.

    ``on_removed(key)`` is called for every key that leaves the index (for the engine's events).
    """

    def __init__(self, on_removed: Optional[Callable[[bytes], None]] = None) -> None:
        self._keys: Dict[bytes, Stamp] = {}  # key -> stamp of its add
        self._clock = 0  # ticks at every add and removal seen on the loop
        self._removed: Dict[bytes, Stamp] = {}  # key -> stamp of its latest removal
        self._open_ops: Dict[int, int] = {}  # start clock -> operations in flight that began there
        self._on_removed = on_removed

    # -- queries ---------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._keys))

    def keys(self) -> Set[bytes]:
        return set(self._keys)

    # -- operations racing with removals ---------------------------------------------------------

    def begin(self) -> int:
        """Mark the start of a put or listing; pass the token to ``add``/``refresh`` and ``end``."""
        start = self._clock
        self._open_ops[start] = self._open_ops.get(start, 0) + 1
        return start

    def end(self, start: int) -> None:
        left = self._open_ops.get(start, 0) - 1
        if left > 0:
            self._open_ops[start] = left
        else:
            self._open_ops.pop(start, None)
        # Forget removals no operation still in flight can race with.
        oldest = min(self._open_ops, default=None)
        if oldest is None:
            self._removed.clear()
        elif self._removed:
            self._removed = {k: v for k, v in self._removed.items() if v[0] > oldest}

    def _removed_since(self, key: bytes, start: int, sequence: Optional[int]) -> bool:
        """True when a removal of ``key`` reached the loop after ``start`` and the tier's sequence
        does not show it older than the mutation ``sequence`` (then the removal wins)."""
        removal = self._removed.get(key)
        if removal is None or removal[0] <= start:
            return False
        removed_at = removal[1]
        return sequence is None or removed_at is None or removed_at >= sequence

    # -- mutations -------------------------------------------------------------------------------

    def add(self, key: bytes, start: int, sequence: Optional[int] = None) -> bool:
        """The put begun at ``start`` (returning ``sequence``) wrote ``key``. Returns False, adding
        nothing, when a removal of the key since then wins (see the module docstring)."""
        if self._removed_since(key, start, sequence):
            return False
        self._clock += 1
        self._keys[key] = (self._clock, sequence)
        return True

    def remove(self, key: bytes, sequence: Optional[int] = None) -> bool:
        """The tier reports ``key`` gone at ``sequence``. Returns True if the key left the index."""
        self._clock += 1
        if self._open_ops:
            self._removed[key] = (self._clock, sequence)
        if key not in self._keys:
            return False
        added_at = self._keys[key][1]
        if sequence is not None and added_at is not None and sequence < added_at:
            return False  # an older removal: the key was written again since
        del self._keys[key]
        if self._on_removed is not None:
            self._on_removed(key)
        return True

    def discard(self, key: bytes) -> bool:
        """Drop ``key`` because the engine found it unreadable (a failed read): no ordering needed."""
        if self._keys.pop(key, _MISSING) is _MISSING:
            return False
        if self._on_removed is not None:
            self._on_removed(key)
        return True

    def replace_all(self, keys: Iterable[bytes], sequence: Optional[int] = None) -> None:
        """Start-up: the tier's listing, nothing racing yet."""
        self._keys = {bytes(k): (self._clock, sequence) for k in keys}

    def admit(self, listed: Iterable[bytes], start: int, sequence: Optional[int] = None) -> int:
        """Merge one page of a listing begun at ``start`` into an index that was empty when it began
        (the start-up listing, merged page by page): listed keys join unless a removal since
        ``start`` wins; no key leaves (every key indexed meanwhile was added after ``start``).
        Returns how many joined."""
        added = 0
        for key in listed:
            if key in self._keys or self._removed_since(key, start, sequence):
                continue
            self._clock += 1
            self._keys[key] = (self._clock, sequence)
            added += 1
        return added

    def refresh(self, listed: Iterable[bytes], start: int, sequence: Optional[int] = None) -> Tuple[int, int]:
        """Merge a listing begun at ``start`` (a snapshot at tier ``sequence`` when known): keys
        indexed before it began and absent from it leave; listed keys join unless a removal since
        ``start`` wins; keys added while it ran stay. Returns (added, removed)."""
        listed_set = set(listed)
        gone = [
            key
            for key, (clock, added_at) in self._keys.items()
            if key not in listed_set
            and clock <= start
            and (sequence is None or added_at is None or added_at <= sequence)
        ]
        for key in gone:
            del self._keys[key]
            if self._on_removed is not None:
                self._on_removed(key)
        return self.admit(listed_set, start, sequence), len(gone)


_MISSING = object()


def keys_of(removals: Iterable[object]) -> List[Tuple[bytes, Optional[int]]]:
    """(key, sequence) of each item a tier reports: a ``Removal`` (tier contract) or a bare key
    (tiers that predate it)."""
    out: List[Tuple[bytes, Optional[int]]] = []
    for item in removals:
        if isinstance(item, (bytes, bytearray, memoryview)):
            out.append((bytes(item), None))
        else:
            out.append((bytes(item.key), item.sequence))  # type: ignore[attr-defined]
    return out
