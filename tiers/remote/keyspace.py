"""What one remote tier instance knows of its namespace's keys: ``Keyspace``. Event-loop thread only.

A chunk key's server-side name is ``kvtier:<namespace>:<fingerprint tag>:<hex chunk key>``. The
instance remembers the keys it knows to be on the server (it wrote, listed or read them) with the
sequence at which it last saw each and the record bytes it wrote of it, assigns the mutation
sequence, and reports each known key that stops being readable once (``Removal``). Keys with a put
in flight are counted, so an eviction notice that overtakes the put's own reply (it comes on
another connection) is held and reported after the put's sequence instead of being lost.
"""

from __future__ import annotations

from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import xxhash

from ..base import Removal, RemovalFeed
from ..key_counts import KeyCounts

__all__ = ["Keyspace"]


class Keyspace:
    """Names, known keys, sequence and removal reports of one namespace (module docstring). Event-loop
    thread only; subscribers are called on the loop they subscribed from (``RemovalFeed``)."""

    def __init__(self, namespace: str, fingerprint: Optional[bytes]) -> None:
        tag = xxhash.xxh3_64_hexdigest(fingerprint) if fingerprint is not None else "any"
        self.prefix = f"kvtier:{namespace}:{tag}:".encode()
        self.sequence = 0
        # key -> (sequence at which this instance last saw it written or present, record bytes or 0)
        self.known: Dict[bytes, Tuple[int, int]] = {}
        self.known_bytes = 0
        self.feed = RemovalFeed()
        self._writing = KeyCounts()
        self._evicted_while_writing: Set[bytes] = set()
        self._removed_while_listing: Optional[Set[bytes]] = None  # see watch_removals
        self._watchers = 0

    # -- names -----------------------------------------------------------------------------------

    def rkey(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def rkeys(self, keys: Iterable[bytes]) -> List[bytes]:
        return [self.prefix + key.hex().encode() for key in keys]

    def chunk_key(self, rkey: bytes) -> Optional[bytes]:
        """The chunk key a server-side name stands for; ``None`` when it is not of this namespace."""
        if not rkey.startswith(self.prefix):
            return None
        try:
            return bytes.fromhex(rkey[len(self.prefix):].decode("ascii"))
        except ValueError:
            return None

    # -- known keys ------------------------------------------------------------------------------

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence

    def remember(self, key: bytes, seq: int, size: int) -> None:
        """``key`` is on the server as of ``seq``, its record ``size`` bytes (0: size unknown, keep
        the one known)."""
        old = self.known.get(key)
        if old is not None:
            self.known_bytes -= old[1]
            size = size or old[1]
        self.known[key] = (seq, size)
        self.known_bytes += size

    def remember_new(self, keys: Iterable[bytes], seq: int, size: int = 0) -> None:
        """``remember`` the keys not known yet (found by a listing or a read)."""
        for key in keys:
            if key not in self.known:
                self.remember(key, seq, size)

    def know(self, keys: Iterable[bytes]) -> None:
        """Treat ``keys`` as known (size unknown) so their removal is reported even if this instance
        never saw them: a reader's index may hold them from a listing elsewhere."""
        for key in keys:
            self.known.setdefault(key, (self.sequence, 0))

    def watch_removals(self) -> None:
        """Note every key ``removed`` from now on, known or not, until ``watched_removals``: a
        listing that found a key it did not know must not take a key evicted meanwhile for new.
        Listings may overlap: each watch lasts until its own ``watched_removals``."""
        if self._removed_while_listing is None:
            self._removed_while_listing = set()
        self._watchers += 1

    def watched_removals(self) -> Set[bytes]:
        """The keys ``removed`` since the oldest watch still open (at least this one's)."""
        watched = set(self._removed_while_listing or ())
        self._watchers -= 1
        if self._watchers <= 0:
            self._watchers, self._removed_while_listing = 0, None
        return watched

    def removed(self, keys: Iterable[bytes], reason: str) -> List[Removal]:
        """Forget ``keys`` and build one Removal per key this instance knew (each reported once)."""
        out: List[Removal] = []
        watching = self._removed_while_listing
        for key in keys:
            if watching is not None:
                watching.add(key)
            entry = self.known.pop(key, None)
            if entry is not None:
                self.known_bytes -= entry[1]
                out.append(Removal(key, self.next_sequence(), reason))
        return out

    def report(self, removals: Sequence[Removal]) -> None:
        self.feed.publish(removals)

    def gone(self, since: int, found: Collection[bytes], lost_node: Callable[[bytes], bool]) -> List[bytes]:
        """Known keys a listing did not find: last seen at or before ``since`` (the listing's start),
        absent from ``found``, and not on a node for which ``lost_node(rkey)`` is true (no owner,
        or its listing failed)."""
        return [key for key, (seq, _) in self.known.items()
                if seq <= since and key not in found and not lost_node(self.rkey(key))]

    # -- puts in flight ----------------------------------------------------------------------------

    def start_writing(self, keys: List[bytes]) -> None:
        self._writing.add(keys)

    def done_writing(self, keys: List[bytes]) -> None:
        self._evicted_while_writing.difference_update(self._writing.discard(keys))

    def evicted(self, names: Iterable[bytes]) -> List[bytes]:
        """The chunk keys of this namespace among evicted server-side ``names``; those with a put in
        flight are also held for ``evicted_during``."""
        keys = [k for k in (self.chunk_key(name) for name in names) if k is not None]
        self._evicted_while_writing.update(k for k in keys if k in self._writing)
        return keys

    def evicted_during(self, keys: Iterable[bytes]) -> List[bytes]:
        """Of a put's ``keys``, those evicted while it was in flight (maybe this put's copy, maybe
        an older one); each is handed out once."""
        late = [key for key in keys if key in self._evicted_while_writing]
        self._evicted_while_writing.difference_update(late)
        return late
