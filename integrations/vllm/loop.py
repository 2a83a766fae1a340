"""``LoopThread``: kvtier's asyncio event loop on a thread of its own inside vLLM's scheduler process.

vLLM calls a secondary tier from its scheduler thread (and sometimes its tier-poll thread), under
the tiering manager's lock, and every call must return at once. kvtier's tiers are asyncio: they
live on this loop; the scheduler side only *posts* work (``post``: one ``call_soon_threadsafe``,
a few microseconds, never waits) and reads completions from a queue. ``run`` blocks and is used
only at construction and shutdown, never from a scheduler step. The tasks ``post`` starts are
owned (``OwnedTasks``): the loop keeps a reference to each until it ends (asyncio itself keeps only
a weak one, so an unowned task can vanish mid-flight), and ``idle`` waits for all of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from kvtier.tiers.owned_tasks import OwnedTasks

__all__ = ["LoopThread"]

logger = logging.getLogger("kvtier.integrations.vllm")

T = TypeVar("T")


class LoopThread:
    """One daemon thread running one asyncio loop until ``stop``."""

    def __init__(self, name: str = "kvtier-vllm-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._tasks = OwnedTasks(on_error=self._task_failed)  # touched on the loop thread only
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait for it (construction and shutdown only).

        On timeout the coroutine is cancelled and ``TimeoutError`` raised."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"kvtier loop did not finish within {timeout_s} s") from None

    def post(self, make: Callable[[], Awaitable[Any]]) -> None:
        """Start ``make()`` as a task the loop owns, without waiting; any thread. Its errors belong
        inside it: one that escapes is logged."""
        self.loop.call_soon_threadsafe(lambda: self._tasks.spawn(make()))

    async def idle(self) -> None:
        """On the loop: return once no posted task is left (tasks posted meanwhile included).
        Cancelling it stops only this wait."""
        await self._tasks.wait_all()

    @staticmethod
    def _task_failed(exc: BaseException) -> None:
        logger.error("kvtier: a task on the vLLM tier's loop failed: %r", exc, exc_info=exc)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop without waiting (a plain call, not a task); nothing once
        the loop is closed. Any thread."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def stop(self, timeout_s: float) -> None:
        """Stop the loop after the callbacks already posted, and join the thread."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("kvtier loop thread did not stop within %s s", timeout_s)
