"""Small helpers the tiers share for batches: cutting a batch into codec slices, and waiting for a
future through repeated cancellation (the buffer rule: a call must not end while a worker may
still read or write the caller's buffers). Pure; ``wait_through_cancel`` runs on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, List, Sequence

__all__ = ["slices", "wait_through_cancel"]


def slices(sizes: Sequence[int], target: int) -> List[range]:
    """Consecutive index ranges of about ``target`` bytes each (at least one item per range)."""
    out: List[range] = []
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc >= target:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


async def wait_through_cancel(fut: "asyncio.Future[Any]") -> None:
    """Wait for ``fut`` even if the waiting task is cancelled again meanwhile; its outcome is
    left in ``fut`` (an exception is not raised here)."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except BaseException:
            return
