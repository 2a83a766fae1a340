"""How the engine waits for work it owns, and keeps its background loops alive.

Primitives: ``settle`` (await a future to its end even when the awaiting task is cancelled) and
``wait_all`` (wait for tasks without ever cancelling them), both from ``kvtier.tiers.owned_tasks``
(the tiers wait the same way); ``Supervised`` (a background loop that is restarted when it crashes,
and fails the engine loudly when it keeps crashing). Event-loop thread only.

The rule these serve: a caller's cancellation cancels its own wait, never the engine's work. A copy
thread or a tier keeps reading or writing a buffer after an ``await`` on it is cancelled, so the
engine may release a pin or a fence only once that work really ended: ``settle`` waits for the end
and only then lets a ``CancelledError`` through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Coroutine, Optional

from kvtier.tiers.owned_tasks import settle, wait_all

__all__ = ["settle", "wait_all", "Supervised"]

logger = logging.getLogger("kvtier.engine")


class Supervised:
    """Runs ``factory()`` as a task named ``name``; when it ends with an exception while
    ``running()`` is still true, logs it, calls ``on_crash(exc)`` and starts it again, up to
    ``max_restarts`` times in a row (crashes ``calm_s`` apart or more are not "in a row": a server
    that lives for weeks must not fail for three unrelated crashes); then calls
    ``on_give_up(exc)`` (the engine fails loudly). A run that ends normally, or after
    ``running()`` turned false, is not restarted."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], Coroutine[Any, Any, None]],
        *,
        running: Callable[[], bool],
        on_crash: Callable[[BaseException], None],
        on_give_up: Callable[[BaseException], None],
        max_restarts: int = 3,
        calm_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._factory = factory
        self._running = running
        self._on_crash = on_crash
        self._on_give_up = on_give_up
        self._max_restarts = max_restarts
        self._calm_s = calm_s
        self._clock = clock
        self._last_crash: Optional[float] = None
        self.restarts = 0  # restarts in the current row
        self.task: Optional[asyncio.Task] = None
        self.done = asyncio.Event()  # set when the loop ended for good

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._factory(), name=self.name)
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self.done.set()
            return
        exc = task.exception()
        if exc is None or not self._running():
            if exc is not None:
                logger.error("kvtier %s loop failed while closing: %r", self.name, exc, exc_info=exc)
            self.done.set()
            return
        self._on_crash(exc)
        now = self._clock()
        if self._last_crash is not None and now - self._last_crash >= self._calm_s:
            self.restarts = 0
        self._last_crash = now
        if self.restarts >= self._max_restarts:
            logger.error("kvtier %s loop crashed %d times; giving up", self.name, self.restarts + 1, exc_info=exc)
            self._on_give_up(exc)
            self.done.set()
            return
        self.restarts += 1
        logger.error("kvtier %s loop crashed (%r); restarting it", self.name, exc, exc_info=exc)
        self.start()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def wait(self) -> None:
        """Wait until the loop ended for good (never cancels it)."""
        if self.task is None:
            return
        await self.done.wait()
