"""Waiting for work that no caller's cancellation may stop, and the tasks a tier owns.

Primitives (event-loop thread):

- ``wait_through_cancel(awaitable)``: wait until a future (or task) is done even if the waiting task
  is cancelled meanwhile, again and again; returns whether it was. The one such wait in kvtier: a
  copy thread or a tier keeps reading or writing a buffer after an ``await`` on it is cancelled, so
  a pin, a fence or a buffer may be released only once that work really ended.
- ``settle(awaitable)``: the same, then the work's result, or ``CancelledError`` when the waiter
  was cancelled meanwhile.
- ``wait_all(tasks)``: wait until every task is done; cancelling the wait cancels none of them
  (``asyncio.wait`` never does, unlike ``gather``).
- ``OwnedTasks``: ``spawn`` a task on behalf of a caller (a put handed to a tier must still land all
  or nothing when the caller that asked for it is cancelled), ``wait_all`` for every one of them.
  A failed task's exception is marked retrieved here (or handed to ``on_error``): the owner counts
  failures itself, and a caller that left must not make asyncio log "exception was never
  retrieved" at exit.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Iterable, Optional, Set, TypeVar

__all__ = ["OwnedTasks", "settle", "wait_all", "wait_through_cancel"]

_T = TypeVar("_T")


async def wait_through_cancel(awaitable: "Awaitable[Any]") -> bool:
    """Wait until ``awaitable`` is done, even if the waiting task is cancelled meanwhile; its
    outcome stays for whoever else awaits it (marked retrieved). Returns True if the waiter was
    cancelled while waiting (the caller should then re-raise ``CancelledError``)."""
    future = asyncio.ensure_future(awaitable)
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])  # never raises the future's own outcome, only our cancel
        except asyncio.CancelledError:
            cancelled = True
    if not future.cancelled():
        future.exception()
    return cancelled


async def settle(awaitable: Awaitable[_T]) -> _T:
    """Await ``awaitable`` (wrapped in a future) to its end. If the awaiting task is cancelled
    meanwhile, keep waiting until the work finished, then raise ``CancelledError``."""
    future = asyncio.ensure_future(awaitable)
    if await wait_through_cancel(future):
        raise asyncio.CancelledError()
    return future.result()


async def wait_all(tasks: Iterable["asyncio.Future[Any]"]) -> None:
    """Wait until every task is done. Cancelling the wait cancels none of them."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        await asyncio.wait(pending)


class OwnedTasks:
    """The set of an owner's own tasks (see the module docstring). ``on_error(exc)``, when given,
    hears of each task that failed; else the failure is only marked retrieved."""

    __slots__ = ("_tasks", "_on_error")

    def __init__(self, on_error: Optional[Callable[[BaseException], None]] = None) -> None:
        self._tasks: Set["asyncio.Task[Any]"] = set()
        self._on_error = on_error

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Awaitable[_T]) -> "asyncio.Task[_T]":
        """Run ``coro`` as a task the owner keeps; callers await it through ``asyncio.shield``."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: "asyncio.Task[Any]") -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._on_error is not None:
            self._on_error(exc)

    async def wait_all(self) -> None:
        """Return once no owned task is left, including tasks spawned while waiting. Cancelling
        it stops only this wait; the tasks run on."""
        while self._tasks:
            pending = [task for task in self._tasks if not task.done()]
            if pending:
                await wait_all(pending)
            else:
                await asyncio.sleep(0)  # done tasks leave the set in their done callbacks
