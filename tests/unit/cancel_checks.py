"""A check the unit tests of the wait-through-cancel helpers share."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest


async def assert_cancel_waits_for_the_work(waiter: "asyncio.Future[Any]", release: Callable[[], None], *,
                                           held_s: float, left_early: str) -> None:
    """Cancel ``waiter``: ``held_s`` later it still waits (``left_early`` says otherwise), and once
    ``release()`` lets the work end it raises ``CancelledError``."""
    waiter.cancel()
    await asyncio.sleep(held_s)
    assert not waiter.done(), left_early
    release()
    with pytest.raises(asyncio.CancelledError):
        await waiter
