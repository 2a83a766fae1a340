"""Rate-limited log lines for dropped stores.

Primitives: ``DropLog.note(reason, chunks, detail)``, ``drop_detail`` (what to tell the operator).
Event-loop thread (called from ``store``).

A dropped store is counted in the metrics (``statistics()["dropped"]``) every time; this says it in
the log too, so an operator sees *why* nothing reaches the cache (a store queue or a host pool too
small for one request drops every such request), without one line per request: at most one line
per reason per ``interval_s``, carrying how many drops it stands for.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Dict, Iterable, Sequence, Tuple

__all__ = ["DropLog"]

logger = logging.getLogger("kvtier.engine")


class DropLog:
    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        # reason -> (when the last line was written, drops since then not yet said)
        self._state: Dict[str, Tuple[float, int]] = {}

    def note(self, reason: str, chunks: int, detail: str) -> None:
        """Record ``chunks`` dropped for ``reason``; log now unless a line for it went out less
        than ``interval_s`` ago (those drops are added to the next line)."""
        now = self._clock()
        last, pending = self._state.get(reason, (None, 0))
        pending += chunks
        if last is not None and now - last < self.interval_s:
            self._state[reason] = (last, pending)
            return
        self._state[reason] = (now, 0)
        logger.warning("store dropped (%s): %s [%d chunks dropped for this reason since the last such line]",
                       reason, detail, pending)


def drop_detail(
    reason: str,
    groups: Iterable[int],
    *,
    inflight: int,
    queue_max_chunks: int,
    pool_slots: Sequence[int],
) -> str:
    """Why a store of chunks of ``groups`` (one group index per chunk) was dropped, and, when the
    store can never fit, which setting to raise."""
    needed = Counter(groups)
    count = sum(needed.values())
    if reason == "queue_full":
        text = f"{count} chunks do not fit the store queue ({inflight} in flight, store_queue_max_chunks={queue_max_chunks})"
        if count > queue_max_chunks:
            text += "; a request this large never fits: raise store_queue_max_chunks"
        return text
    if reason == "host_full":
        never = [g for g, n in sorted(needed.items()) if n > pool_slots[g]]
        text = "the host pool cannot free " + ", ".join(
            f"{n} slots of group {g} (of {pool_slots[g]})" for g, n in sorted(needed.items())
        )
        if never:
            text += "; a request this large never fits: raise host_capacity_bytes"
        return text
    if reason == "pressure":
        return "memory pressure is above the high watermark; stores resume below the low one"
    return reason
