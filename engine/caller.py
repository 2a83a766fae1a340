"""Who may call an engine: the loop that started it, in the process that started it.

Primitives: ``CallerGuard`` (bound by ``start`` to the running loop and the process; ``check``
raises ``ForkedProcessError`` in a forked child, ``EngineUsageError`` from another event loop or a
thread without one, and ``EngineUsageError`` once the engine failed). The guard is bound and failed
on the engine's event-loop thread; ``check`` may run on any thread, since telling a wrong caller is
what it is for.

Forks are counted in the child by an ``os.register_at_fork`` hook: an int compare per public call
instead of a ``getpid()`` system call on the lookup path.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Optional

from kvtier.errors import EngineUsageError, ForkedProcessError

__all__ = ["CallerGuard"]

# Forks of this process so far, counted in the child.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


class CallerGuard:
    """The engine's rightful caller: its loop, its thread, its process, and whether it failed."""

    def __init__(self) -> None:
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.thread: Optional[int] = None
        self.pid = os.getpid()
        self.forks = _forks
        self.failure: Optional[BaseException] = None

    def bind(self) -> None:
        """Make the running loop, this thread and this process the only rightful caller."""
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        self.pid = os.getpid()
        self.forks = _forks

    def check(self, failed_ok: bool = False) -> None:
        """Raise unless called from the bound loop of the bound process (and, unless
        ``failed_ok``, before the engine failed)."""
        if _forks != self.forks:
            raise ForkedProcessError(
                f"this OffloadEngine was started by pid {self.pid}; a forked child (pid {os.getpid()}) "
                "must start its own engine"
            )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self.loop:
            raise EngineUsageError(
                "this OffloadEngine belongs to the event loop that started it; it was called from "
                + ("another event loop" if running is not None else "a thread without a running event loop")
            )
        if self.failure is not None and not failed_ok:
            raise EngineUsageError(f"the offload engine failed: {self.failure!r}; close it and start a new one")
