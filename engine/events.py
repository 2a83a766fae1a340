"""The engine's chunk events, bounded.

Primitives: ``EventLog`` (``append``, ``take``, ``dropped``). Event-loop thread only.

An embedder that never calls ``take_events()`` (the README example does not) must not pay ~3
entries per chunk forever: the log keeps the newest ``max_events`` and counts what it dropped, so a
router that does consume them can tell it fell behind (``kvtier_events_dropped_total``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, List, Optional

from .records import ChunkEvent

__all__ = ["EventLog"]


class EventLog:
    def __init__(self, max_events: int, on_drop: Optional[Callable[[int], None]] = None) -> None:
        self._events: Deque[ChunkEvent] = deque(maxlen=max_events)
        self._on_drop = on_drop
        self.dropped = 0

    def append(self, kind: str, key: bytes, group_index: int, tier: str) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop(1)
        self._events.append(ChunkEvent(kind, key, group_index, tier))

    def take(self) -> List[ChunkEvent]:
        """Every event kept since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
