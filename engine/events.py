"""The engine's chunk events, bounded.

Primitives: ``EventLog`` (``append``, ``extend``, ``take``, ``dropped``). Event-loop thread only.

An embedder that never calls ``take_events()`` (the README example does not) must not pay ~3
entries per chunk forever: the log keeps the newest ``max_events`` and counts what it dropped, so a
router that does consume them can tell it fell behind (``kvtier_events_dropped_total``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

from .records import ChunkEvent

__all__ = ["EventLog"]


class EventLog:
    def __init__(self, max_events: int, on_drop: Optional[Callable[[int], None]] = None) -> None:
        # Plain tuples, made into ``ChunkEvent``s by ``take``: a frozen dataclass costs ~1.5 us to
        # build, paid per chunk stored or loaded, and most events are dropped unread.
        self._events: Deque[Tuple[str, bytes, int, str]] = deque(maxlen=max_events)
        self._on_drop = on_drop
        self.dropped = 0

    def append(self, kind: str, key: bytes, group_index: int, tier: str) -> None:
        events = self._events
        if len(events) == events.maxlen:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop(1)
        events.append((kind, key, group_index, tier))

    def extend(self, kind: str, entries: Sequence[Any], tier: str) -> None:
        """``append`` of one event per entry (a ``ChunkEntry``: its key and group), in order."""
        events = self._events
        room = events.maxlen - len(events) if events.maxlen is not None else len(entries)
        if len(entries) > room:
            self.dropped += len(entries) - room
            if self._on_drop is not None:
                self._on_drop(len(entries) - room)
        events.extend([(kind, e.key, e.group_index, tier) for e in entries])

    def take(self) -> List[ChunkEvent]:
        """Every event kept since the last call, oldest first."""
        events = [ChunkEvent(*event) for event in self._events]
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
