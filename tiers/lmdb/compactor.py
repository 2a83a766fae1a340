"""Compaction's moves and its automatic passes: the ``Compactor`` (see ``compaction`` for why,
what a pass is, and the pure planning it uses).

Threads, per method: ``plan_pass`` / ``run_passes`` / ``compact`` on any thread but the writer
(a plan reads in read transactions; the automatic one runs on the read pool); ``step``,
``remove_retired``, ``retry_retired`` and the triggers ``segments_changed`` / ``segment_rotated``
(the writer side's ``SegmentWatcher``) on the writer thread only; a timer thread only queues a
later writer job. State marked "writer thread" below is touched by that thread alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Dict, List, Optional, Set, Tuple

import lmdb
import xxhash

from kvtier.errors import ClosedError, CorruptRecordError, TierIOError

from ..record_format import validate_record
from ..writer import Job, WriterThread
from .compaction import (
    DISK_MARGIN,
    PLAN_DUTY,
    REOFFER_S,
    RETIRE_TRIES,
    RETIRE_WAIT_S,
    STEP_BYTES,
    CompactionReport,
    PlannedPass,
    SegmentUsage,
    choose_segments,
    closed_segments,
    eviction_horizon,
    oldest_reader,
    take_for_pass,
    usage_row,
    usage_rows,
)
from .environment import LmdbEnv
from .reads import ReaderSide
from .segment_files import held_by_writer, remove_dead
from .segments import Ledger, SegmentPointer, is_pointer
from .writes import WriterSide

__all__ = ["Compactor"]

log = logging.getLogger(__name__)

_LIST_BATCH = 4096
_OFFERED_MAX = 4096


class Compactor:
    """Plans passes and moves their records in writer-thread steps; schedules the automatic ones
    (which thread calls what: the module docstring).

    Wired by ``LmdbTier``: the environment, the writer side (its transactions, segment writer and
    LRU), the reader side (its pool and segment reader) and the writer thread; it is the writer
    side's ``SegmentWatcher``. ``live_fraction``: the tier's ``segment_compaction_live_fraction``
    (0: no automatic pass)."""

    def __init__(self, db: LmdbEnv, writes: WriterSide, reads: ReaderSide, writer: WriterThread, *,
                 live_fraction: float) -> None:
        self._db = db
        self._writes = writes
        self._reads = reads
        self._writer = writer
        self._count = db.counters.count
        self.live_fraction = live_fraction
        self.step_bytes = STEP_BYTES
        # writer thread: an automatic pass is planned or running / a commit asked for another one since
        self.scheduled = False
        self._wanted = False
        # writer thread: segment name -> when it was last offered to an automatic pass (monotonic s);
        # whether a step is running (its own quarantines offer nothing)
        self._offered: Dict[str, float] = {}
        self._compacting = False
        # monotonic time before which no automatic plan starts (``PLAN_DUTY``); whether the first
        # commit offered the segments found at open
        self.next_automatic_at = 0.0
        self._offered_at_open = False
        # writer thread: (commit id, name, file size) of emptied sources not deleted yet, and whether a
        # timer will retry them
        self.retiring: List[Tuple[int, str, int]] = []
        self._retire_timer = False

    async def compact(self, fraction: float) -> CompactionReport:
        """``run_passes`` on a thread of the loop's default executor (event-loop thread); see
        ``LmdbTier.compact_segments`` for what cancelling it does."""
        stop = threading.Event()
        running = asyncio.get_running_loop().run_in_executor(None, lambda: self.run_passes(fraction, stop))
        running.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled caller's result
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            stop.set()
            raise

    def run_passes(self, fraction: float, stop: threading.Event) -> CompactionReport:
        """Any thread but the writer: passes until no candidate is left over (``PASS_LIVE_BYTES``),
        each step a writer job; then wait a little for the emptied sources' readers to finish
        (``RETIRE_TRIES``), leaving any still held to the timer. ``stop``: no further step."""
        report = CompactionReport()
        more = True
        while more and not stop.is_set():
            plan = self.plan_pass(fraction)
            while not plan.done and not stop.is_set():
                self._writer.call(lambda: self.step(plan))
            report.add(plan.report)
            more = plan.more and plan.report.records > 0
        for _ in range(RETIRE_TRIES):
            report.add(self._writer.call(self.remove_retired))
            if not self.retiring or stop.is_set():
                break
            time.sleep(RETIRE_WAIT_S)
        if self.retiring:
            self._writer.submit(Job(self.retry_retired, _log_failure))
        return report

    # -------------------------------------------------------------------------------- planning

    def plan_pass(self, live_fraction: float) -> PlannedPass:
        """Any thread but the writer: choose the segments (``compaction``'s pure rules) and list
        their live records."""
        capacity = self._writes.capacity
        budget = None if capacity is None else int(capacity * (1 + DISK_MARGIN))
        usage = self._db.read_txn(self._usage_in)
        closed, locked = closed_segments(
            usage, live_fraction, active=self._writes.active_segment, budgeted=budget is not None,
            ours=f"seg-{os.getpid()}-", held=lambda name: held_by_writer(self._db.path, name))
        chosen, more = take_for_pass(choose_segments(usage, closed, live_fraction=live_fraction, disk_budget_bytes=budget))
        sizes: Dict[str, int] = {}
        for u in chosen:
            try:
                sizes[u.name] = os.stat(self._db.path / u.name).st_size
            except FileNotFoundError:
                sizes[u.name] = 0
        below = {u.name for u in usage if u.live_fraction < live_fraction}
        plan = PlannedPass(deque(self._list_records(set(sizes))), sizes)
        plan.more = more
        plan.report.segments = len(chosen)
        plan.report.skipped_locked = len(locked & below)
        self._count(compaction_passes=1)
        return plan

    def _list_records(self, names: Set[str]) -> List[Tuple[bytes, bytes]]:
        """(key, pointer) of every record in the segments ``names``, by segment and offset. Walks the
        keys of ``atime`` (small values; a cursor over ``chunks`` would touch every inline record's
        pages) and looks each one up, in read transactions of ``_LIST_BATCH`` keys."""
        if not names:
            return []
        found: List[Tuple[SegmentPointer, bytes, bytes]] = []
        last: Optional[bytes] = None
        while True:

            def body(txn: lmdb.Transaction) -> Optional[bytes]:
                cur = txn.cursor(db=self._db.tables.atime)
                positioned = cur.first() if last is None else cur.set_range(last)
                if positioned and last is not None and bytes(cur.key()) == last:
                    positioned = cur.next()
                key = None
                n = 0
                while positioned and n < _LIST_BATCH:
                    key = bytes(cur.key())
                    value = txn.get(key, db=self._db.tables.chunks)
                    if value is not None and is_pointer(value):
                        pointer = SegmentPointer.unpack(value, check=False)  # a damaged one: its read refuses it
                        if pointer.name in names:
                            found.append((pointer, key, bytes(value)))
                    n += 1
                    positioned = cur.next()
                return key if n == _LIST_BATCH else None

            last = self._db.read_txn(body)
            if last is None:
                break
        found.sort(key=lambda f: (f[0].name, f[0].offset))
        return [(key, value) for _, key, value in found]

    # ------------------------------------------------------------------------ writer-thread steps

    def step(self, plan: PlannedPass) -> None:
        """Writer thread: move the next records of ``plan`` (at most ``step_bytes``)."""
        plan.report.add(self.remove_retired())  # earlier steps' sources, when the readers allow
        self._compacting = True  # its quarantines offer nothing: the segments are this pass's already
        try:
            records, olds = self._read_sources(self._next_current(plan), plan.report)
        finally:
            self._compacting = False
        if not records:
            return
        # durable before the commit, as puts; into segments even when new puts go inline (the
        # records were large enough for a segment once, and LMDB's path is the slow one for them)
        values = {key: p.pack() for key, p in zip(records, self._writes.append_synced(list(records.values())))}
        self._commit_moves(plan, records, olds, values)

    def _next_current(self, plan: PlannedPass) -> List[Tuple[bytes, bytes]]:
        """Writer thread: the next (key, pointer) entries of ``plan``, up to the step's bytes, less
        those whose key no longer holds that pointer. Nothing of this process writes between this
        check and the step's commit (this thread is its only writer), so it saves copying what was
        moved, deleted or evicted since the plan; the commit checks again for other processes."""
        taken: List[Tuple[bytes, bytes]] = []
        nbytes = 0
        doomed = self._eviction_horizon() if plan.automatic else frozenset()
        while plan.pending and (not taken or nbytes < self.step_bytes):
            key, value = plan.pending.popleft()
            if key in doomed:
                plan.report.left_to_eviction += 1
                continue
            taken.append((key, value))
            nbytes += SegmentPointer.unpack(value, check=False).length

        def still_there(txn: lmdb.Transaction) -> List[bool]:
            return [txn.get(key, db=self._db.tables.chunks) == value for key, value in taken]

        current = [kv for kv, keep in zip(taken, self._db.read_txn(still_there)) if keep]
        plan.report.superseded += len(taken) - len(current)
        return current

    def _eviction_horizon(self) -> "frozenset[bytes]":
        """Writer thread: ``compaction.eviction_horizon`` of this tier's LRU."""
        lru = self._writes.lru
        return eviction_horizon(lru, lru.total_bytes, lambda key: lru.get(key) or 0,
                                capacity=self._writes.capacity, segment_max_bytes=self._writes.segment_max_bytes)

    def _read_sources(self, entries: List[Tuple[bytes, bytes]],
                      report: CompactionReport) -> Tuple[Dict[bytes, bytes], Dict[bytes, bytes]]:
        """Writer thread: read each entry's record and check its checksum. Returns key -> record
        and key -> old pointer of the intact ones; corrupt ones are quarantined (like a failed read;
        only if the key still holds those bytes), an unreadable one stays for a later pass."""
        def read_one(entry: Tuple[bytes, bytes]) -> "bytes | Exception":
            try:
                record = self._reads.segment_reader.read(entry[1])
                validate_record(entry[0], record, max_raw_bytes=self._reads.max_raw_bytes)
                return record
            except (CorruptRecordError, TierIOError) as exc:
                return exc

        # on the read pool: several direct reads in flight (one at a time left the disk idle)
        results = self._reads.map_or_here(read_one, entries)
        records: Dict[bytes, bytes] = {}
        olds: Dict[bytes, bytes] = {}
        corrupt: List[Tuple[bytes, int, str]] = []
        for (key, value), result in zip(entries, results):
            if isinstance(result, CorruptRecordError):
                log.warning("kvtier lmdb: corrupt record %s found by compaction in %s: %s", key.hex(), self._db.path, result)
                corrupt.append((key, xxhash.xxh3_64_intdigest(value), str(result)))
            elif isinstance(result, Exception):
                log.warning("kvtier lmdb: compaction could not read %s: %s", key.hex(), result)
            else:
                records[key] = result
                olds[key] = value
        if corrupt:
            quarantined = self._writes.quarantine_entries(corrupt)
            self._count(corrupt=quarantined)
            report.quarantined += quarantined
        return records, olds

    def _commit_moves(self, plan: PlannedPass, records: Dict[bytes, bytes], olds: Dict[bytes, bytes],
                      values: Dict[bytes, bytes]) -> None:
        """Writer thread: one transaction pointing each key at its copy, only where the key still
        holds the old pointer (another process's write since the check wins), with the ``segments``
        table moved along; ``atime`` and the LRU stay (a move is not an access)."""

        def body(txn: lmdb.Transaction) -> Callable[[], None]:
            ledger = Ledger(txn, self._db.tables.writable_segments)
            moved: List[bytes] = []
            for key, old in olds.items():
                now = txn.get(key, db=self._db.tables.chunks)
                if now is None or now != old:
                    continue
                ledger.drop(now)
                ledger.add(SegmentPointer.unpack(values[key]))
                txn.put(key, values[key], db=self._db.tables.chunks)
                moved.append(key)
            ledger.commit()
            # Not ``WriterSide.emptied_segments``: a read that took an old pointer before this commit may not
            # have opened its file yet, so the emptied sources are retired until no read
            # transaction older than this one is left (``remove_retired``). Until then they are
            # files without an entry in ``segments``: a crash leaves them to ``reclaim_orphans``.
            commit_id = txn.id()
            emptied = list(ledger.emptied)

            def apply() -> None:
                self.retiring.extend((commit_id, name, plan.sizes.get(name, 0)) for name in emptied)
                moved_bytes = sum(len(records[key]) for key in moved)
                plan.report.records += len(moved)
                plan.report.bytes += moved_bytes
                plan.report.superseded += len(olds) - len(moved)
                self._count(compacted_records=len(moved), compacted_bytes=moved_bytes)

            return apply

        self._writes.write(body, 64 * len(olds))  # pointers only: what a map growth must make room for

    def remove_retired(self) -> CompactionReport:
        """Writer thread: delete the retired sources that no read transaction (of any process) can
        still reach through an old pointer: LMDB's reader table lists each open read transaction's
        snapshot, and one at or after the commit that emptied a source sees only new pointers.
        Returns the files and bytes freed (also counted)."""
        freed = CompactionReport()
        if not self.retiring:
            return freed
        oldest = oldest_reader(self._db.env)
        ready = [r for r in self.retiring if oldest is None or oldest >= r[0]]
        if not ready:
            return freed
        self.retiring = [r for r in self.retiring if r not in ready]
        # A file still locked (a probe of another process's planner, for an instant) stays as an
        # orphan without an entry in ``segments``: the next writable open deletes it.
        removed = set(remove_dead(self._db.path, [name for _, name, _ in ready], self._writes.segment_writer, self._reads.segment_reader))
        freed.files_freed = len(removed)
        freed.bytes_freed = sum(size for _, name, size in ready if name in removed)
        self._count(compacted_segments=freed.files_freed, compaction_bytes_freed=freed.bytes_freed)
        return freed

    def retry_retired(self) -> None:
        """Writer thread: ``remove_retired``, and again ``RETIRE_WAIT_S`` later while some remain
        (a timer thread queues the next try; closing ends the chain: the leftovers are orphans the
        next open deletes)."""
        self.remove_retired()
        if self.retiring and not self._retire_timer:
            self._retire_timer = True
            timer = threading.Timer(RETIRE_WAIT_S, self._queue_retry)
            timer.daemon = True
            timer.start()

    def _queue_retry(self) -> None:
        """Timer thread: hand the next try to the writer."""
        self._retire_timer = False
        self._queue_job(self.retry_retired)

    # ---------------------------------------------------------------------- automatic compaction

    def segments_changed(self, ledger: Ledger) -> None:
        """Writer thread, inside a put/delete/eviction/quarantine transaction: when it leaves a
        closed segment below the live fraction, offer it to an automatic pass (scheduled after the
        commit: the plan runs on the read pool, which only sees committed data; an aborted
        transaction at worst costs a pass that finds nothing). A segment is offered again only
        ``REOFFER_S`` later (one that another process still appends to is skipped by the pass, and
        retried once it may be closed), so the many commits that touch a segment cost one pass.
        The first such commit of this tier also offers every segment already below the fraction
        when it opened (a job after the commit reads the table): left by an earlier process, or by
        records deleted while they were some writer's active segment. Read-only uses (inspect,
        verify of a clean cache) commit nothing and so never start a pass."""
        if not self._compacting and not self._offered_at_open:
            self._offered_at_open = True
            try:
                self._writer.submit(Job(self._offer_all, _log_failure))
            except ClosedError:
                pass
        for name, usage in ledger.remaining.items():
            self._offer(SegmentUsage(name, *usage))

    def _offer_all(self) -> None:
        """Writer thread: offer every segment in the ``segments`` table."""

        for usage in self._db.read_txn(self._usage_in):
            self._offer(usage)

    def _usage_in(self, txn: lmdb.Transaction) -> List[SegmentUsage]:
        """Every row of the ``segments`` table."""
        return usage_rows(txn.cursor(db=self._db.tables.segments).iternext(keys=True, values=True))

    def segment_rotated(self, name: str) -> None:
        """Writer thread, after this writer closed its active segment ``name``: records deleted
        while it was active (not offered then) may have left it below the fraction."""

        def usage_of(txn: lmdb.Transaction) -> Optional[SegmentUsage]:
            return usage_row(name, txn.get(name.encode(), db=self._db.tables.segments))

        usage = self._db.read_txn(usage_of)
        if usage is not None:
            self._offer(usage)

    def _offer(self, usage: SegmentUsage) -> None:
        """Writer thread: schedule an automatic pass if ``usage`` is a closed segment below the
        fraction not offered in the last ``REOFFER_S``."""
        fraction = self.live_fraction
        active = self._writes.active_segment
        if fraction <= 0 or self._compacting or usage.name == active or usage.live_fraction >= fraction:
            return
        now = time.monotonic()
        if now - self._offered.get(usage.name, -REOFFER_S) < REOFFER_S:
            return
        if len(self._offered) >= _OFFERED_MAX:  # names of long-gone segments
            self._offered = {n: t for n, t in self._offered.items() if now - t < REOFFER_S}
        self._offered[usage.name] = now
        if self.scheduled:
            self._wanted = True
            return
        self.scheduled = True
        # A writer job queued now runs after the current job (and its commit): this thread runs
        # jobs in order, so the plan it starts sees the commit.
        try:
            self._writer.submit(Job(self._start_automatic, _log_failure))
        except ClosedError:
            self.scheduled = False

    def _start_automatic(self) -> None:
        """Writer thread, after the triggering commit: plan on the read pool -- or, when the last
        automatic plan took long (it walks every key), only ``PLAN_DUTY`` of the time later, so
        planning never holds a read thread for more than that share of it."""
        wait_s = self.next_automatic_at - time.monotonic()
        try:
            if wait_s > 0:
                timer = threading.Timer(wait_s, lambda: self._queue_job(self._start_automatic))
                timer.daemon = True
                timer.start()
            else:
                self._reads.submit(self._plan_automatic)
        except ClosedError:
            self.scheduled = False

    def _queue_job(self, fn: Callable[[], None]) -> None:
        """Timer thread: hand ``fn`` to the writer (closing: nothing more is done; retired files
        left are orphans the next open deletes)."""
        try:
            self._writer.submit(Job(fn, _log_failure))
        except ClosedError:
            pass

    def _plan_automatic(self) -> None:
        """Read pool: plan an automatic pass and hand its first step to the writer."""
        try:
            started = time.monotonic()
            plan = self.plan_pass(self.live_fraction)
            self.next_automatic_at = started + (time.monotonic() - started) / PLAN_DUTY
            plan.automatic = True
            self._writer.submit(Job(lambda: self._automatic_step(plan), _log_failure))
        except ClosedError:
            self.scheduled = False
        except Exception:
            self.scheduled = False
            log.exception("kvtier lmdb: planning a compaction of %s failed", self._db.path)

    def _automatic_step(self, plan: PlannedPass) -> None:
        """Writer thread: one step; the next one goes to the back of the queue (puts queued meanwhile
        run first). At the end, another pass if a commit asked for one meanwhile."""
        try:
            self.step(plan)
        except BaseException:
            self.scheduled = False
            raise
        if not plan.done:
            try:
                self._writer.submit(Job(lambda: self._automatic_step(plan), _log_failure))
                return
            except ClosedError:
                pass  # closing: the pass ends here
        self.retry_retired()
        self.scheduled = False
        if plan.more and plan.report.records:
            self._wanted = True
        if plan.report.records or plan.report.quarantined:
            log.info("kvtier lmdb: compacted %d records (%d bytes) out of %d segments of %s",
                     plan.report.records, plan.report.bytes, plan.report.segments, self._db.path)
        if self._wanted:
            self._wanted = False
            self.scheduled = True
            self._start_automatic()


def _log_failure(result: object, exc: Optional[BaseException]) -> None:
    if exc is not None:
        log.warning("kvtier lmdb: automatic compaction step failed: %s", exc)
