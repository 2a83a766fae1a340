"""The writer thread and the map lock of a database tier.

Primitives:

- ``WriterThread``: one dedicated thread that runs closures (``Job``) taken in order from a
  ``queue.SimpleQueue``. A database whose write transactions must stay on the thread that began
  them (LMDB) runs each whole transaction, begin to commit, inside one closure. Consecutive jobs that
  share a ``group`` runner are handed to it together (group commit: one fsync for many batches);
  the runner may also take the next such group queued behind (``more``), to start its work before
  it finishes the first one's (the LMDB tier begins batch n+1's payload writes before it commits
  batch n), and may wait in ``more`` until either such a group arrives or its own work is done.
  Results go back through the job's ``done(result, exc)`` callback, called on the writer thread.
- ``loop_callback(loop, fut)``: a ``done`` that resolves an asyncio future on its loop with
  ``loop.call_soon_threadsafe``, guarded by ``fut.done()`` so a cancelled caller (or a closed loop)
  never breaks the worker.
- ``SharedExclusiveLock``: many holders of ``shared()`` (transactions) or one of ``exclusive()``
  (remapping or closing the environment); waiting exclusive holders go first.

Threads: ``WriterThread`` owns its thread; the lock is used from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, TypeVar

from kvtier.errors import ClosedError

__all__ = ["Job", "WriterThread", "SharedExclusiveLock", "loop_callback", "Done"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Done = Callable[[Any, Optional[BaseException]], None]


@dataclass
class Job:
    """A closure for the writer. ``group``, when set, runs a list of consecutive jobs with an equal
    ``group`` and must call every job's ``done``; its second argument, ``more(until=None)``,
    returns the next group of such jobs queued (empty when the next job is another kind, or none
    is queued), whose ``done`` it must then call too; with ``until`` (a future) it waits for such
    a group until ``until`` is done, instead of answering at once; ``weight`` (bytes) bounds how
    much one group takes. Built on any thread; ``run`` and ``finish`` run on the writer thread only."""

    fn: Callable[[], Any]
    done: Done
    group: Optional[Callable[[List["Job"], Callable[..., List["Job"]]], None]] = None
    weight: int = 0

    def run(self) -> None:
        try:
            result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller, never kills the writer
            _deliver(self.done, None, exc)
        else:
            _deliver(self.done, result, None)

    def finish(self, result: Any, exc: Optional[BaseException] = None) -> None:
        """Call ``done`` (a group runner's way to report; a broken callback is logged)."""
        _deliver(self.done, result, exc)


def _deliver(done: Done, result: Any, exc: Optional[BaseException]) -> None:
    try:
        done(result, exc)
    except Exception:  # a broken callback must not stop the writer
        log.exception("kvtier writer: completion callback failed")


def loop_callback(loop: asyncio.AbstractEventLoop, fut: "asyncio.Future[Any]") -> Done:
    """A ``done`` callback (any thread) that resolves ``fut`` on ``loop`` unless it is already done."""

    def resolve(result: Any, exc: Optional[BaseException]) -> None:
        if fut.done():  # the caller was cancelled: the result is dropped
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def done(result: Any, exc: Optional[BaseException]) -> None:
        try:
            loop.call_soon_threadsafe(resolve, result, exc)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    return done


_STOP = object()


class WriterThread:
    """One thread running ``Job`` closures in submission order. ``submit`` and ``stop`` from any
    thread, ``submit_async`` from an event-loop thread, ``call`` from any thread but blocks it."""

    def __init__(self, name: str, *, max_group_jobs: int = 256, max_group_weight: int = 64 << 20) -> None:
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._max_group_jobs = max_group_jobs
        self._max_group_weight = max_group_weight
        self._held: Any = None  # writer thread: a job taken from the queue, to run next
        self._arrived = threading.Event()  # set by each submit (and stop): wakes a waiting ``more``
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> Optional[int]:
        return self._thread.ident

    def submit(self, job: Job) -> None:
        """Queue a job (any thread). Raises ``ClosedError`` once ``stop`` was called."""
        with self._lock:
            if self._stopped:
                raise ClosedError("the tier's writer thread has stopped")
            self._queue.put(job)
        self._arrived.set()

    def submit_async(self, fn: Callable[[], T], **job_kw: Any) -> "asyncio.Future[T]":
        """Queue ``fn`` and return a future of its result on the running loop (loop thread only)."""
        loop = asyncio.get_running_loop()
        fut: "asyncio.Future[T]" = loop.create_future()
        self.submit(Job(fn, loop_callback(loop, fut), **job_kw))
        return fut

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the writer and wait for it (blocking; for tools and the close path)."""
        if threading.get_ident() == self._thread.ident:
            return fn()
        cf: "concurrent.futures.Future[T]" = concurrent.futures.Future()

        def done(result: Any, exc: Optional[BaseException]) -> None:
            if exc is not None:
                cf.set_exception(exc)
            else:
                cf.set_result(result)

        self.submit(Job(fn, done))
        return cf.result()

    def stop(self) -> None:
        """Run every job queued so far, then end the thread and wait for it. Idempotent."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(_STOP)
        self._arrived.set()
        if threading.get_ident() != self._thread.ident:
            self._thread.join()

    def _main(self) -> None:
        while True:
            job = self._held if self._held is not None else self._queue.get()
            self._held = None
            if job is _STOP:
                break
            if job.group is None:
                job.run()
                continue
            group = self._group_from(job)
            runner = job.group
            try:
                runner(group, lambda until=None: self._more(runner, until))
            except BaseException as exc:  # noqa: BLE001 - the runner failed as a whole
                log.exception("kvtier writer: group runner failed")
                for j in group:
                    _deliver(j.done, None, exc)
        # Nothing can be queued after _STOP (submit refuses), so the queue is empty here.

    def _group_from(self, job: Job) -> List[Job]:
        """``job`` and the consecutive queued jobs of its group, up to the bounds; the first job
        that does not join is held for the next turn."""
        group = [job]
        weight = job.weight
        while len(group) < self._max_group_jobs and weight < self._max_group_weight:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is not _STOP and nxt.group is not None and nxt.group == job.group:
                group.append(nxt)
                weight += nxt.weight
            else:
                self._held = nxt
                break
        return group

    def _more(self, runner: Callable[..., None], until: "Optional[concurrent.futures.Future[Any]]" = None) -> List[Job]:
        """Writer thread, inside ``runner``: the next group of ``runner``'s jobs if one is queued
        and nothing else is ahead of it (order is kept: a held job of another kind, or ``stop``,
        ends the look-ahead). Without ``until`` it answers at once; with it, it waits for a job
        until ``until`` is done (then answers [] if none came)."""
        if until is not None:
            until.add_done_callback(lambda _f: self._arrived.set())
        while True:
            if self._held is not None:
                return []
            self._arrived.clear()  # before looking: a job or ``until`` after this wakes the wait
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                if until is None or until.done():
                    return []
                self._arrived.wait()
                continue
            break
        if nxt is _STOP or nxt.group is None or nxt.group != runner:
            self._held = nxt
            return []
        return self._group_from(nxt)


class SharedExclusiveLock:
    """A readers-writer lock that prefers the exclusive side (so a remap is never starved). Any
    thread may take either side; both block, so never on an event loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            self._release_shared()

    @contextlib.contextmanager
    def shared_nowait(self) -> Iterator[bool]:
        """The shared side if it is free now (yields True, released on exit), else yields False at
        once: for callers that must not wait behind a remap and every read transaction before it."""
        with self._cond:
            if self._exclusive or self._waiting:
                held = False
            else:
                self._shared += 1
                held = True
        try:
            yield held
        finally:
            if held:
                self._release_shared()

    def _release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._shared == 0:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
