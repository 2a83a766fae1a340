"""Compaction of partly-live payload segments: choose segments, move their live records.

Why: space returns by whole segment (``segments``): a file is deleted only once its last live record
goes, so one live 256 KiB record can keep a 256 MiB file, and disk usage can stay far above the
tier's capacity. Compaction moves the live records of mostly-dead *closed* segments into this
writer's active segment; each source, once empty, is deleted (``segments.remove_dead``) as soon as no
read transaction of any process is older than the commit that emptied it (LMDB's reader table says
which snapshots are open): a read that took the old pointer just before the move still finds its
file, so moving a live record never turns a hit into a miss.

A pass, in two phases:

1. ``Compaction._plan_pass`` (a read-pool or tool thread, never the writer): read the ``segments`` table
   (live bytes | live records | committed end per segment) and ``choose_segments``: a segment is a
   candidate when it is closed -- not this writer's active one, and no writer (ours or another
   process's) holds its ``flock`` -- and its live bytes are below ``live_fraction`` of its committed
   end (a page of padding per live record counted as live); when a ``disk_budget_bytes`` is given and the segment files together exceed it, more segments
   are taken, least live first, until the projected total fits. Then list the candidates' live
   records (key and pointer, from the small ``atime`` table's keys, in read transactions of a few
   thousand keys each) in file order.
2. ``Compaction._compaction_step`` (writer thread, one job per step of at most ``step_bytes``, so
   puts queued meanwhile run between steps): keep only the records whose key still holds the planned
   pointer, read each one (on the read pool, several in flight) and check its checksum (a corrupt one is quarantined like a failed read,
   never copied), append the good ones to this writer's segment (``_append_synced``, as puts:
   ``fdatasync``'d before the commit; also when new puts go inline), then ONE write transaction
   replaces each key's value ONLY IF it is still the exact old pointer (a put, delete or eviction by
   another process since the check wins; the copy is then dead bytes), moves the live bytes in the
   ``segments`` table with a ``Ledger``, and leaves ``atime`` and the LRU alone: compaction is not
   an access. Emptied sources are retired (``_remove_retired``) until the reader table allows.

Crash safety: before the step's commit the old pointer stands and the copy is an orphan tail of our
segment (truncated by ``reclaim_orphans`` at the next writable open); after it the new pointer
stands, and the emptied source is deleted once retired or, if the process died first, at the next
open (no entry in ``segments``: an orphan file).

When it runs: after a commit (put, delete, eviction, quarantine) leaves a closed segment below
``live_fraction`` (``_segments_changed``, a cheap check of the transaction's own ledger, offers it to
an automatic pass, at most once per ``REOFFER_S``) or this writer closes its active segment below
it (``_segment_rotated``), from ``LmdbTier.compact_segments`` / ``compact_segments_sync`` and from ``kvtier gc``.

Primitives: ``SegmentUsage``, ``choose_segments`` (pure), ``CompactionReport``, ``segment_disk_bytes``,
``oldest_reader`` (any thread), ``Compaction`` (a mixin of ``LmdbTier``: ``compact_segments``,
``compact_segments_sync``; the automatic passes). Threads: plans on the read pool (automatic) or
the caller's worker thread, steps and deletions on the writer thread, a timer thread only to queue
a later deletion try.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import lmdb
import xxhash

from kvtier.errors import ClosedError, CorruptRecordError, TierIOError

from ..record_format import validate_record
from ..writer import Job, WriterThread
from .segments import LIVE, Ledger, SegmentPointer, held_by_writer, is_pointer, remove_dead, segment_files
from .writes import WriterSide

__all__ = [
    "SegmentUsage",
    "choose_segments",
    "CompactionReport",
    "segment_disk_bytes",
    "Compaction",
    "DEFAULT_COMPACTION_LIVE_FRACTION",
    "check_live_fraction",
    "oldest_reader",
]

log = logging.getLogger(__name__)

# A closed segment less than half live is rewritten: the copy costs at most as many bytes as it frees,
# and the files never hold more than twice the live bytes (plus the active segments).
DEFAULT_COMPACTION_LIVE_FRACTION = 0.5
# Bytes of records moved per write transaction (a put waits at most about one step). Measured
# (bench_compaction, 256 MiB of 1 MiB records, 30 % live): moves ran at 320-360 MB/s with 8, 16 or
# 32 MiB steps alike, while a single-record put during the pass took at most 27 / 48 / 106 ms.
STEP_BYTES = 8 << 20
# Segment files may exceed the capacity by this fraction before the capacity rule takes more
# segments than the live-fraction rule does (the active segment and page padding live there).
DISK_MARGIN = 0.25
# The capacity rule leaves segments at least this live: rewriting them would free little.
_CAPACITY_RULE_MAX_LIVE = 0.9
_LIST_BATCH = 4096
_PAGE = 4096
# Live bytes one pass takes at most (its plan holds a key and a pointer per record, and goes stale
# as it runs); a pass that leaves candidates behind is followed by another.
PASS_LIVE_BYTES = 4 << 30
# An emptied source waits for read transactions older than its emptying commit; a pass's caller
# retries this often, this long apart, before leaving the rest to a timer (reads finish in ms).
RETIRE_TRIES = 50
RETIRE_WAIT_S = 0.02
# A segment below the fraction is offered to an automatic pass at most this often (a pass that had
# to skip it -- another process still appends to it -- retries once a later commit touches it).
REOFFER_S = 30.0
# The share of time automatic planning may take (a plan walks every key of ``atime``: seconds for
# millions of records): the next automatic plan starts no sooner than its duration / PLAN_DUTY later.
PLAN_DUTY = 0.05
# How far from the LRU's old end an automatic pass leaves records to eviction (``_eviction_horizon``).
EVICTION_HORIZON_SEGMENTS = 4
_OFFERED_MAX = 4096


def check_live_fraction(value: object, name: str = "segment_compaction_live_fraction") -> float:
    """Validate a compaction live fraction: a number in [0, 1) (0 turns compaction off);
    ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SegmentUsage:
    """One row of the ``segments`` table: live record bytes, live records, committed end.

    Each live record also takes about a page of padding in the file (its head page, its payload's
    last partial page), which a copy takes again: counted as live, so a segment of small records
    that is all live never looks worth rewriting."""

    name: str
    live_bytes: int
    live_records: int
    committed_end: int

    @property
    def live_extent(self) -> int:
        return min(self.committed_end, self.live_bytes + self.live_records * _PAGE)

    @property
    def live_fraction(self) -> float:
        return self.live_extent / self.committed_end if self.committed_end else 1.0

    @property
    def dead_bytes(self) -> int:
        """What rewriting the segment gives back."""
        return self.committed_end - self.live_extent


def choose_segments(usage: Sequence[SegmentUsage], closed: Set[str], *, live_fraction: float,
                    disk_budget_bytes: Optional[int] = None) -> List[SegmentUsage]:
    """The segments to compact, least live first: every closed one below ``live_fraction``; then,
    while all segments' committed bytes minus the dead bytes of those chosen exceed
    ``disk_budget_bytes``, further closed ones below ``_CAPACITY_RULE_MAX_LIVE`` live. Pure."""
    if live_fraction <= 0:
        return []
    ordered = sorted((u for u in usage if u.name in closed), key=lambda u: (u.live_fraction, u.name))
    chosen = [u for u in ordered if u.live_fraction < live_fraction]
    if disk_budget_bytes is not None:
        projected = sum(u.committed_end for u in usage) - sum(u.dead_bytes for u in chosen)
        for u in ordered:
            if projected <= disk_budget_bytes:
                break
            if u not in chosen and u.live_fraction < _CAPACITY_RULE_MAX_LIVE:
                chosen.append(u)
                projected -= u.dead_bytes
    return chosen


@dataclass
class CompactionReport:
    """What one compaction pass did: ``segments`` chosen, ``records`` / ``bytes`` moved,
    ``files_freed`` / ``bytes_freed`` (source files deleted, their sizes), ``quarantined`` (corrupt
    sources), ``superseded`` (records a concurrent write changed first: left to it),
    ``skipped_locked`` (segments below the threshold that a writer still appends to),
    ``left_to_eviction`` (records an automatic pass left where they are: the LRU evicts them next)."""

    segments: int = 0
    records: int = 0
    bytes: int = 0
    files_freed: int = 0
    bytes_freed: int = 0
    quarantined: int = 0
    superseded: int = 0
    skipped_locked: int = 0
    left_to_eviction: int = 0

    def add(self, other: "CompactionReport") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Pass:
    """A planned pass: the records still to move, in file order, and its running report."""

    pending: Deque[Tuple[bytes, bytes]]  # (key, the pointer it held when planned)
    sizes: Dict[str, int]  # source segment -> file size when planned (bytes a deletion frees)
    report: CompactionReport = field(default_factory=CompactionReport)
    more: bool = False  # more segments were candidates than one pass takes
    automatic: bool = False  # spares the records the LRU evicts next (``_eviction_horizon``)

    @property
    def done(self) -> bool:
        return not self.pending


def segment_disk_bytes(directory: Path) -> int:
    """Bytes the segment files in ``directory`` take (their sizes), for reports and tests."""
    total = 0
    for name in segment_files(directory):
        try:
            total += os.stat(directory / name).st_size
        except FileNotFoundError:
            pass
    return total


class Compaction(WriterSide):
    """Compaction of ``LmdbTier`` (see the module docstring): planning on read threads, moves as
    writer-thread steps."""

    _writer: Optional[WriterThread]
    _pool: ThreadPoolExecutor
    _max_raw_bytes: int
    _compaction_live_fraction: float
    _compaction_step_bytes: int
    # writer thread: an automatic pass is planned or running / a commit asked for another one since
    _compaction_scheduled: bool
    _compaction_wanted: bool
    # writer thread: segment name -> when it was last offered to an automatic pass (monotonic s);
    # whether a step is running (its own quarantines offer nothing)
    _compaction_offered: Dict[str, float]
    _compacting: bool
    # monotonic time before which no automatic plan starts (``PLAN_DUTY``); whether the first
    # commit offered the segments found at open
    _next_automatic_at: float
    _offered_at_open: bool
    # writer thread: (commit id, name, file size) of emptied sources not deleted yet, and whether a
    # timer will retry them
    _retiring: List[Tuple[int, str, int]]
    _retire_timer: bool

    def _check_usable(self, write: bool = False) -> None:
        raise NotImplementedError  # LmdbTier's

    def _submit_to_pool(self, fn: Callable[[], None]) -> None:
        raise NotImplementedError  # LmdbTier's

    # ------------------------------------------------------------------------------ public calls

    async def compact_segments(self, *, live_fraction: Optional[float] = None) -> CompactionReport:
        """Plan a pass over the closed segments below ``live_fraction`` (default: the tier's
        ``segment_compaction_live_fraction``; and over the capacity margin) and move their live
        records, one writer job of at most ``STEP_BYTES`` at a time (puts queued meanwhile run
        between the steps); returns what it did. Plans and waits on a thread of the loop's default
        executor, never on the loop.

        Cancelling it: the step already handed to the writer still runs to its commit (all or
        nothing: each moved key holds its old pointer or its new one); no further step starts,
        records moved so far stay moved, and their emptied sources are still deleted once no older
        read transaction remains (a timer retries; a crash leaves them to the next open)."""
        fraction = self._compaction_live_fraction if live_fraction is None else check_live_fraction(live_fraction)
        self._check_usable(write=True)
        stop = threading.Event()
        running = asyncio.get_running_loop().run_in_executor(None, lambda: self._run_passes(fraction, stop))
        running.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled caller's result
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            stop.set()
            raise

    def compact_segments_sync(self, *, live_fraction: Optional[float] = None) -> CompactionReport:
        """Blocking ``compact_segments`` for tools (``kvtier gc``) and tests: plans on the calling
        thread, moves on the writer thread."""
        fraction = self._compaction_live_fraction if live_fraction is None else check_live_fraction(live_fraction)
        self._check_usable(write=True)
        return self._run_passes(fraction, threading.Event())

    def _run_passes(self, fraction: float, stop: threading.Event) -> CompactionReport:
        """Any thread but the writer: passes until no candidate is left over (``PASS_LIVE_BYTES``),
        each step a writer job; then wait a little for the emptied sources' readers to finish
        (``RETIRE_TRIES``), leaving any still held to the timer. ``stop``: no further step."""
        assert self._writer is not None
        report = CompactionReport()
        more = True
        while more and not stop.is_set():
            plan = self._plan_pass(fraction)
            while not plan.done and not stop.is_set():
                self._writer.call(lambda: self._compaction_step(plan))
            report.add(plan.report)
            more = plan.more and plan.report.records > 0
        for _ in range(RETIRE_TRIES):
            report.add(self._writer.call(self._remove_retired))
            if not self._retiring or stop.is_set():
                break
            time.sleep(RETIRE_WAIT_S)
        if self._retiring:
            self._writer.submit(Job(self._retry_retired, _log_failure))
        return report

    # -------------------------------------------------------------------------------- planning

    def _plan_pass(self, live_fraction: float) -> _Pass:
        """Any thread but the writer: choose the segments and list their live records."""
        budget = None
        if self._capacity is not None:
            budget = int(self._capacity * (1 + DISK_MARGIN))

        usage = self._read_txn(self._usage_in)
        active = self._segment_writer.active if self._segment_writer is not None else None
        closed: Set[str] = set()
        locked: Set[str] = set()
        # Probe only what could be chosen, and never our own closed segments (this process appends to
        # its active one only): each probe takes the lock for an instant, and a remove_dead elsewhere
        # that meets it leaves that file for the next open.
        could = max(live_fraction, _CAPACITY_RULE_MAX_LIVE if budget is not None else 0.0)
        ours = f"seg-{os.getpid()}-"
        for u in usage:
            if u.name == active or u.live_fraction >= could:
                continue
            held = False if u.name.startswith(ours) else held_by_writer(self._path, u.name)
            if held is None:
                continue  # the file is gone: its records are misses, quarantined when read
            if held:
                locked.add(u.name)
            else:
                closed.add(u.name)
        chosen = choose_segments(usage, closed, live_fraction=live_fraction, disk_budget_bytes=budget)
        taken, live = 0, 0
        for u in chosen:  # bounded memory: at least one segment, the rest in the next pass
            if taken and live + u.live_bytes > PASS_LIVE_BYTES:
                break
            taken, live = taken + 1, live + u.live_bytes
        more, chosen = taken < len(chosen), chosen[:taken]
        sizes: Dict[str, int] = {}
        for u in chosen:
            try:
                sizes[u.name] = os.stat(self._path / u.name).st_size
            except FileNotFoundError:
                sizes[u.name] = 0
        below = {u.name for u in usage if u.live_fraction < live_fraction}
        plan = _Pass(deque(self._list_records(set(sizes))), sizes)
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
                cur = txn.cursor(db=self._tables.atime)
                positioned = cur.first() if last is None else cur.set_range(last)
                if positioned and last is not None and bytes(cur.key()) == last:
                    positioned = cur.next()
                key = None
                n = 0
                while positioned and n < _LIST_BATCH:
                    key = bytes(cur.key())
                    value = txn.get(key, db=self._tables.chunks)
                    if value is not None and is_pointer(value):
                        pointer = SegmentPointer.unpack(value, check=False)  # a damaged one: its read refuses it
                        if pointer.name in names:
                            found.append((pointer, key, bytes(value)))
                    n += 1
                    positioned = cur.next()
                return key if n == _LIST_BATCH else None

            last = self._read_txn(body)
            if last is None:
                break
        found.sort(key=lambda f: (f[0].name, f[0].offset))
        return [(key, value) for _, key, value in found]

    # ------------------------------------------------------------------------ writer-thread steps

    def _compaction_step(self, plan: _Pass) -> None:
        """Writer thread: move the next records of ``plan`` (at most ``_compaction_step_bytes``)."""
        plan.report.add(self._remove_retired())  # earlier steps' sources, when the readers allow
        self._compacting = True  # its quarantines offer nothing: the segments are this pass's already
        try:
            records, olds = self._read_sources(self._next_current(plan), plan.report)
        finally:
            self._compacting = False
        if not records:
            return
        # durable before the commit, as puts; into segments even when new puts go inline (the
        # records were large enough for a segment once, and LMDB's path is the slow one for them)
        values = {key: p.pack() for key, p in zip(records, self._append_synced(list(records.values())))}
        self._commit_moves(plan, records, olds, values)

    def _next_current(self, plan: _Pass) -> List[Tuple[bytes, bytes]]:
        """Writer thread: the next (key, pointer) entries of ``plan``, up to the step's bytes, less
        those whose key no longer holds that pointer. Nothing of this process writes between this
        check and the step's commit (this thread is its only writer), so it saves copying what was
        moved, deleted or evicted since the plan; the commit checks again for other processes."""
        taken: List[Tuple[bytes, bytes]] = []
        nbytes = 0
        doomed = self._eviction_horizon() if plan.automatic else frozenset()
        while plan.pending and (not taken or nbytes < self._compaction_step_bytes):
            key, value = plan.pending.popleft()
            if key in doomed:
                plan.report.left_to_eviction += 1
                continue
            taken.append((key, value))
            nbytes += SegmentPointer.unpack(value, check=False).length

        def still_there(txn: lmdb.Transaction) -> List[bool]:
            return [txn.get(key, db=self._tables.chunks) == value for key, value in taken]

        current = [kv for kv, keep in zip(taken, self._read_txn(still_there)) if keep]
        plan.report.superseded += len(taken) - len(current)
        return current

    def _eviction_horizon(self) -> "frozenset[bytes]":
        """Writer thread: the keys the LRU evicts next -- the oldest ``EVICTION_HORIZON_SEGMENTS``
        segments' worth -- when the tier is within a tenth of its capacity; else none. An automatic
        pass does not move them: under steady eviction the segment being eaten from its old end
        falls below the fraction long before it is empty, and moving its survivors just ahead of
        their eviction wrote 228 MiB for every 384 MiB put (measured: 64 MiB capacity, 8 MiB
        segments, 1 MiB records, no reads). Records kept young by reads are outside it: they move."""
        cap = self._capacity
        if cap is None or self._lru.total_bytes < 0.9 * cap:
            return frozenset()
        horizon = min(cap // 2, EVICTION_HORIZON_SEGMENTS * self._segment_max_bytes)
        doomed = []
        total = 0
        for key in self._lru:
            if total >= horizon:
                break
            doomed.append(key)
            total += self._lru.get(key) or 0
        return frozenset(doomed)

    def _read_sources(self, entries: List[Tuple[bytes, bytes]],
                      report: CompactionReport) -> Tuple[Dict[bytes, bytes], Dict[bytes, bytes]]:
        """Writer thread: read each entry's record and check its checksum. Returns key -> record
        and key -> old pointer of the intact ones; corrupt ones are quarantined (like a failed read;
        only if the key still holds those bytes), an unreadable one stays for a later pass."""
        def read_one(entry: Tuple[bytes, bytes]) -> "bytes | Exception":
            try:
                record = self._segment_reader.read(entry[1])
                validate_record(entry[0], record, max_raw_bytes=self._max_raw_bytes)
                return record
            except (CorruptRecordError, TierIOError) as exc:
                return exc

        # on the read pool: several direct reads in flight (one at a time left the disk idle)
        try:
            results = list(self._pool.map(read_one, entries))
        except RuntimeError:  # the pool is shut down: closing, the last step reads alone
            results = [read_one(entry) for entry in entries]
        records: Dict[bytes, bytes] = {}
        olds: Dict[bytes, bytes] = {}
        corrupt: List[Tuple[bytes, int, str]] = []
        for (key, value), result in zip(entries, results):
            if isinstance(result, CorruptRecordError):
                log.warning("kvtier lmdb: corrupt record %s found by compaction in %s: %s", key.hex(), self._path, result)
                corrupt.append((key, xxhash.xxh3_64_intdigest(value), str(result)))
            elif isinstance(result, Exception):
                log.warning("kvtier lmdb: compaction could not read %s: %s", key.hex(), result)
            else:
                records[key] = result
                olds[key] = value
        if corrupt:
            quarantined = self._quarantine_entries(corrupt)
            self._count(corrupt=quarantined)
            report.quarantined += quarantined
        return records, olds

    def _commit_moves(self, plan: _Pass, records: Dict[bytes, bytes], olds: Dict[bytes, bytes],
                      values: Dict[bytes, bytes]) -> None:
        """Writer thread: one transaction pointing each key at its copy, only where the key still
        holds the old pointer (another process's write since the check wins), with the ``segments``
        table moved along; ``atime`` and the LRU stay (a move is not an access)."""

        def body(txn: lmdb.Transaction) -> Callable[[], None]:
            ledger = Ledger(txn, self._tables.segments)
            moved: List[bytes] = []
            for key, old in olds.items():
                now = txn.get(key, db=self._tables.chunks)
                if now is None or now != old:
                    continue
                ledger.drop(now)
                ledger.add(SegmentPointer.unpack(values[key]))
                txn.put(key, values[key], db=self._tables.chunks)
                moved.append(key)
            ledger.commit()
            # Not ``_emptied_segments``: a read that took an old pointer before this commit may not
            # have opened its file yet, so the emptied sources are retired until no read
            # transaction older than this one is left (``_remove_retired``). Until then they are
            # files without an entry in ``segments``: a crash leaves them to ``reclaim_orphans``.
            commit_id = txn.id()
            emptied = list(ledger.emptied)

            def apply() -> None:
                self._retiring.extend((commit_id, name, plan.sizes.get(name, 0)) for name in emptied)
                moved_bytes = sum(len(records[key]) for key in moved)
                plan.report.records += len(moved)
                plan.report.bytes += moved_bytes
                plan.report.superseded += len(olds) - len(moved)
                self._count(compacted_records=len(moved), compacted_bytes=moved_bytes)

            return apply

        self._write(body, 64 * len(olds))  # pointers only: what a map growth must make room for

    def _remove_retired(self) -> CompactionReport:
        """Writer thread: delete the retired sources that no read transaction (of any process) can
        still reach through an old pointer: LMDB's reader table lists each open read transaction's
        snapshot, and one at or after the commit that emptied a source sees only new pointers.
        Returns the files and bytes freed (also counted)."""
        freed = CompactionReport()
        if not self._retiring:
            return freed
        oldest = oldest_reader(self._env)
        ready = [r for r in self._retiring if oldest is None or oldest >= r[0]]
        if not ready:
            return freed
        self._retiring = [r for r in self._retiring if r not in ready]
        # A file still locked (a probe of another process's planner, for an instant) stays as an
        # orphan without an entry in ``segments``: the next writable open deletes it.
        removed = set(remove_dead(self._path, [name for _, name, _ in ready], self._segment_writer, self._segment_reader))
        freed.files_freed = len(removed)
        freed.bytes_freed = sum(size for _, name, size in ready if name in removed)
        self._count(compacted_segments=freed.files_freed, compaction_bytes_freed=freed.bytes_freed)
        return freed

    def _retry_retired(self) -> None:
        """Writer thread: ``_remove_retired``, and again ``RETIRE_WAIT_S`` later while some remain
        (a timer thread queues the next try; closing ends the chain: the leftovers are orphans the
        next open deletes)."""
        self._remove_retired()
        if self._retiring and not self._retire_timer:
            self._retire_timer = True
            timer = threading.Timer(RETIRE_WAIT_S, self._queue_retry)
            timer.daemon = True
            timer.start()

    def _queue_retry(self) -> None:
        """Timer thread: hand the next try to the writer."""
        self._retire_timer = False
        self._queue_job(self._retry_retired)

    # ---------------------------------------------------------------------- automatic compaction

    def _segments_changed(self, ledger: Ledger) -> None:
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
            assert self._writer is not None
            try:
                self._writer.submit(Job(self._offer_all, _log_failure))
            except ClosedError:
                pass
        for name, usage in ledger.remaining.items():
            self._offer(SegmentUsage(name, *usage))

    def _offer_all(self) -> None:
        """Writer thread: offer every segment in the ``segments`` table."""

        for usage in self._read_txn(self._usage_in):
            self._offer(usage)

    def _usage_in(self, txn: lmdb.Transaction) -> List[SegmentUsage]:
        """Every row of the ``segments`` table."""
        return [SegmentUsage(bytes(k).decode(errors="replace"), *LIVE.unpack(v))
                for k, v in txn.cursor(db=self._tables.segments).iternext(keys=True, values=True)
                if len(v) == LIVE.size]

    def _segment_rotated(self, name: str) -> None:
        """Writer thread, after this writer closed its active segment ``name``: records deleted
        while it was active (not offered then) may have left it below the fraction."""

        def usage_of(txn: lmdb.Transaction) -> Optional[SegmentUsage]:
            value = txn.get(name.encode(), db=self._tables.segments)
            return SegmentUsage(name, *LIVE.unpack(value)) if value is not None and len(value) == LIVE.size else None

        usage = self._read_txn(usage_of)
        if usage is not None:
            self._offer(usage)

    def _offer(self, usage: SegmentUsage) -> None:
        """Writer thread: schedule an automatic pass if ``usage`` is a closed segment below the
        fraction not offered in the last ``REOFFER_S``."""
        fraction = self._compaction_live_fraction
        active = self._segment_writer.active if self._segment_writer is not None else None
        if fraction <= 0 or self._compacting or usage.name == active or usage.live_fraction >= fraction:
            return
        now = time.monotonic()
        if now - self._compaction_offered.get(usage.name, -REOFFER_S) < REOFFER_S:
            return
        if len(self._compaction_offered) >= _OFFERED_MAX:  # names of long-gone segments
            self._compaction_offered = {n: t for n, t in self._compaction_offered.items() if now - t < REOFFER_S}
        self._compaction_offered[usage.name] = now
        if self._compaction_scheduled:
            self._compaction_wanted = True
            return
        self._compaction_scheduled = True
        # A writer job queued now runs after the current job (and its commit): this thread runs
        # jobs in order, so the plan it starts sees the commit.
        assert self._writer is not None
        try:
            self._writer.submit(Job(self._start_automatic, _log_failure))
        except ClosedError:
            self._compaction_scheduled = False

    def _start_automatic(self) -> None:
        """Writer thread, after the triggering commit: plan on the read pool -- or, when the last
        automatic plan took long (it walks every key), only ``PLAN_DUTY`` of the time later, so
        planning never holds a read thread for more than that share of it."""
        wait_s = self._next_automatic_at - time.monotonic()
        try:
            if wait_s > 0:
                timer = threading.Timer(wait_s, lambda: self._queue_job(self._start_automatic))
                timer.daemon = True
                timer.start()
            else:
                self._submit_to_pool(self._plan_automatic)
        except ClosedError:
            self._compaction_scheduled = False

    def _queue_job(self, fn: Callable[[], None]) -> None:
        """Timer thread: hand ``fn`` to the writer (closing: nothing more is done; retired files
        left are orphans the next open deletes)."""
        assert self._writer is not None
        try:
            self._writer.submit(Job(fn, _log_failure))
        except ClosedError:
            pass

    def _plan_automatic(self) -> None:
        """Read pool: plan an automatic pass and hand its first step to the writer."""
        try:
            started = time.monotonic()
            plan = self._plan_pass(self._compaction_live_fraction)
            self._next_automatic_at = started + (time.monotonic() - started) / PLAN_DUTY
            plan.automatic = True
            assert self._writer is not None
            self._writer.submit(Job(lambda: self._automatic_step(plan), _log_failure))
        except ClosedError:
            self._compaction_scheduled = False
        except Exception:
            self._compaction_scheduled = False
            log.exception("kvtier lmdb: planning a compaction of %s failed", self._path)

    def _automatic_step(self, plan: _Pass) -> None:
        """Writer thread: one step; the next one goes to the back of the queue (puts queued meanwhile
        run first). At the end, another pass if a commit asked for one meanwhile."""
        try:
            self._compaction_step(plan)
        except BaseException:
            self._compaction_scheduled = False
            raise
        assert self._writer is not None
        if not plan.done:
            try:
                self._writer.submit(Job(lambda: self._automatic_step(plan), _log_failure))
                return
            except ClosedError:
                pass  # closing: the pass ends here
        self._retry_retired()
        self._compaction_scheduled = False
        if plan.more and plan.report.records:
            self._compaction_wanted = True
        if plan.report.records or plan.report.quarantined:
            log.info("kvtier lmdb: compacted %d records (%d bytes) out of %d segments of %s",
                     plan.report.records, plan.report.bytes, plan.report.segments, self._path)
        if self._compaction_wanted:
            self._compaction_wanted = False
            self._compaction_scheduled = True
            self._start_automatic()


def oldest_reader(env: lmdb.Environment) -> Optional[int]:
    """The oldest snapshot (transaction id) an open read transaction of any process reads, from
    LMDB's reader table (``mdb_reader_list``: a header line, then ``pid thread txnid`` per slot,
    ``-`` for an idle one); ``None`` when none is open."""
    oldest: Optional[int] = None
    for line in env.readers().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[2].isdigit():
            txnid = int(parts[2])
            oldest = txnid if oldest is None else min(oldest, txnid)
    return oldest


def _log_failure(result: object, exc: Optional[BaseException]) -> None:
    if exc is not None:
        log.warning("kvtier lmdb: automatic compaction step failed: %s", exc)
