"""Tasks a tier starts on behalf of its callers, which no caller's cancellation may reach.

Primitive: ``OwnedTasks`` (``spawn`` a task the tier owns, ``wait_all`` for every one of them).
Event-loop thread. A put handed to a tier must still land all or nothing when the caller that
asked for it is cancelled, and a ``flush``/``close`` that is cancelled must stop only its own wait:
so waiting uses ``asyncio.wait`` (cancelling it leaves the tasks running), never ``gather``
(cancelling a gather cancels its children). A failed task's exception is marked retrieved here:
the tier counts failures in its statistics, and a caller that left must not make asyncio log
"exception was never retrieved" at exit.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Set, TypeVar

__all__ = ["OwnedTasks"]

_T = TypeVar("_T")


class OwnedTasks:
    """The set of a tier's own tasks (see the module docstring)."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: Set["asyncio.Task[Any]"] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Awaitable[_T]) -> "asyncio.Task[_T]":
        """Run ``coro`` as a task the tier owns; callers await it through ``asyncio.shield``."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: "asyncio.Task[Any]") -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()

    async def wait_all(self) -> None:
        """Return once no owned task is left, including tasks spawned while waiting. Cancelling
        it stops only this wait; the tasks run on."""
        while self._tasks:
            pending = [task for task in self._tasks if not task.done()]
            if pending:
                await asyncio.wait(pending)
            else:
                await asyncio.sleep(0)  # done tasks leave the set in their done callbacks
