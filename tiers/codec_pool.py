"""Running the record codec over a batch on a tier's worker threads, and waiting for it honestly.

Encoding (zstd of byte planes, checksums) releases the GIL, so a large batch is cut into contiguous
slices of roughly equal bytes, one thread hop per slice: never one hop per small chunk (a hop costs
~100 us, about what a 64 KiB chunk takes to encode), never more slices than worker threads.

Primitives (shared by the disk tiers):

- ``plan_slices(sizes, workers, min_slice_bytes)``: the index ranges of the slices.
- ``map_slices(executor, fn, jobs, sizes, ...)``: submit ``fn(slice)`` per slice; returns a
  ``concurrent.futures.Future`` of the concatenated results, in order, completed on the worker
  thread that finished last (so a thread-side continuation -- the LMDB writer -- needs no loop).
- ``wait_threads(future)``: await such a future from the loop under the buffer rule: a cancelled
  caller cancels the slices that have not started and waits for those running, then re-raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, Callable, List, Optional, Sequence

from .owned_tasks import wait_through_cancel

__all__ = ["MIN_SLICE_BYTES", "plan_slices", "map_slices", "wait_threads"]

# The smallest slice worth a hop of its own: below it the ~100 us hop costs more than a second core
# saves (measured on the LMDB put path: a 1 MiB batch of 64 KiB chunks).
MIN_SLICE_BYTES = 1 << 20


def plan_slices(sizes: Sequence[int], workers: int, min_slice_bytes: int) -> List[range]:
    """Contiguous index ranges over ``sizes`` (bytes per item): at most ``workers`` of them, each of
    about ``total / parts`` bytes and at least ``min_slice_bytes`` (except when one slice is all)."""
    n = len(sizes)
    if n == 0:
        return []
    total = sum(sizes)
    parts = max(1, min(workers, n, total // max(1, min_slice_bytes)))
    if parts == 1:
        return [range(n)]
    target = total / parts
    out: List[range] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= target * (len(out) + 1) and len(out) < parts - 1 and i + 1 < n:
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, n))
    return out


def map_slices(
    executor: concurrent.futures.Executor,
    fn: Callable[[List[Any]], List[Any]],
    jobs: Sequence[Any],
    sizes: Sequence[int],
    *,
    workers: int,
    min_slice_bytes: int,
    ranges: Optional[Sequence[range]] = None,
) -> "concurrent.futures.Future[List[Any]]":
    """Run ``fn`` over the slices of ``jobs`` on ``executor``; the returned future holds the
    results in job order, or the first slice's exception. The slices are ``plan_slices``' unless
    ``ranges`` gives them (contiguous, covering ``jobs`` in order: a caller that knows its I/O
    units). Raises ``RuntimeError`` if the executor is shut down before the first slice was
    submitted; slices that could not be submitted later fail the future with that error."""
    if ranges is None:
        ranges = plan_slices(sizes, workers, min_slice_bytes)
    result: "concurrent.futures.Future[List[Any]]" = concurrent.futures.Future()
    if not ranges:
        result.set_result([])
        return result
    parts: List[Optional[List[Any]]] = [None] * len(ranges)
    failures: List[BaseException] = []
    remaining = [len(ranges)]
    join = threading.Lock()
    result.slices = []  # type: ignore[attr-defined]  # for wait_threads

    def finish(index: int, value: Optional[List[Any]], exc: Optional[BaseException]) -> None:
        with join:
            parts[index] = value
            if exc is not None:
                failures.append(exc)
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            if failures:
                result.set_exception(failures[0])
            else:
                result.set_result([x for part in parts for x in part])  # type: ignore[union-attr]
        except concurrent.futures.InvalidStateError:
            pass  # the waiter cancelled the batch's future: nobody wants the result

    def run(index: int, part: List[Any]) -> None:
        try:
            value = fn(part)
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            finish(index, None, exc)
        else:
            finish(index, value, None)

    for index, r in enumerate(ranges):
        try:
            slice_future = executor.submit(run, index, [jobs[i] for i in r])
        except RuntimeError as exc:  # shut down
            if index == 0:
                raise
            for rest in range(index, len(ranges)):  # never started: they fail the batch
                finish(rest, None, exc)
            break
        slice_future.add_done_callback(functools.partial(_abandoned, index=index, finish=finish))
        result.slices.append(slice_future)  # type: ignore[attr-defined]
    return result


def _abandoned(slice_future: "concurrent.futures.Future[None]", index: int, finish: Callable[..., None]) -> None:
    if slice_future.cancelled():  # cancelled before it started: ``run`` never reports it
        finish(index, None, concurrent.futures.CancelledError())


async def wait_threads(future: "concurrent.futures.Future[Any]", *, abandon_unstarted: bool = False) -> Any:
    """Await a ``map_slices`` future (or any concurrent future) from the event loop. If the caller
    is cancelled, running slices are waited for -- and, with ``abandon_unstarted``, slices not yet
    started are cancelled (abandoned for good: right for reads, never for a put, which must still
    land) -- and ``CancelledError`` is re-raised only then: when this returns or raises, no thread
    of the batch touches the caller's buffers any more."""
    wrapped = asyncio.wrap_future(future)
    try:
        return await asyncio.shield(wrapped)
    except asyncio.CancelledError:
        if abandon_unstarted:
            for part in getattr(future, "slices", ()):
                part.cancel()
        await wait_through_cancel(wrapped)
        raise
