"""The LMDB tier's timer thread: periodic housekeeping that must not wait for traffic.

Primitive: ``PeriodicThread`` (one daemon thread per tier) runs each of its tasks every
``interval_s`` until ``stop()``. The tier gives it two: clear stale reader slots
(``env.reader_check()``; a crashed reader process would otherwise pin old pages forever) and ask
the writer to persist recorded access times. A task that raises is logged and runs again next time;
a task that returns ``False`` ends the thread (the tier is closing).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["PeriodicThread"]

log = logging.getLogger(__name__)

# (interval in seconds, task); a task returns False to end the thread.
Task = Tuple[float, Callable[[], Optional[bool]]]


class PeriodicThread:
    """Runs ``tasks`` on one daemon thread, each every ``interval_s``; the thread wakes at the
    shortest interval. ``stop()`` ends it and joins (safe to call twice)."""

    def __init__(self, name: str, tasks: Sequence[Task]) -> None:
        if not tasks or any(not interval > 0 for interval, _ in tasks):
            raise ValueError(f"tasks need positive intervals, got {[i for i, _ in tasks]!r}")
        self._tasks = list(tasks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _main(self) -> None:
        tick = min(interval for interval, _ in self._tasks)
        now = time.monotonic()
        due: List[float] = [now + interval for interval, _ in self._tasks]
        while not self._stop.wait(tick):
            now = time.monotonic()
            for i, (interval, task) in enumerate(self._tasks):
                if now < due[i]:
                    continue
                due[i] = now + interval
                try:
                    if task() is False:
                        return
                except Exception:
                    log.exception("kvtier: periodic task %s failed", getattr(task, "__name__", task))
