"""The LMDB tier's writer side: every write transaction, the in-memory LRU index and the mutation
sequence it owns, and the segment writer.

``WriterSide`` runs on the tier's writer thread only (``tiers.writer.WriterThread``): each batch --
begin, LRU eviction, puts, access-time updates, commit -- is one closure passed to ``write``, which
bumps the sequence stored in the environment (so writes of other processes are ordered too),
commits, and then applies the in-memory update the closure returned (which reports removals with
that sequence). It is also the only code that grows the map (``MapFullError``: abort,
``set_mapsize`` x2 under the exclusive map lock, retry) and the only code that touches ``lru``
after open. Two exceptions, both safe from any thread: ``accesses`` is a deque readers append to,
and ``sequence`` / ``degraded`` / ``lru``'s totals are read by ``statistics``.

After a commit that changed the ``segments`` table, and after the segment writer closed its active
segment, it tells its ``SegmentWatcher`` (compaction's triggers; ``watch``).
"""


from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, TypeVar

import lmdb
import xxhash

from kvtier.errors import CorruptRecordError, TierFullError, TierIOError

from ..base import Removal, RemovalFeed
from ..lru import ByteLru
from ..quarantine import QuarantineRoom
from ..writer import Job
from .environment import LmdbEnv
from .segment_records import codec_of, release_records
from .segment_reader import SegmentReader
from .segment_files import remove_dead
from .segments import Ledger, PendingAppend, SegmentPointer, SegmentWriter, free_bytes, is_pointer, stored_size
from .tables import ATIME, bump_sequence, take_segment_number

__all__ = ["WriterSide", "PutJob", "SegmentWatcher", "STAGED_GROUPS"]

log = logging.getLogger(__name__)

# Put groups in the write pipeline at once (the one committing next included): a bound on the
# payload bytes pinned and the direct writes queued ahead of a commit; the engine's spill keeps as
# many batches in flight (``engine.spill.BATCHES_IN_FLIGHT``), so each of them is staged on arrival.
STAGED_GROUPS = 4

T = TypeVar("T")


@dataclass
class _StagedPut:
    """A put batch between ``WriterSide.stage_put`` and ``commit_put``: the records by key, what
    the counters need, the keys that go to segments and their writes in flight."""

    batch: Dict[bytes, bytes]
    batch_bytes: int
    records: int
    raw_in: int
    batches: int
    large: List[bytes]
    pending: Optional[PendingAppend]
    values: Optional[Dict[bytes, bytes]] = None  # once durable: key -> its ``chunks`` value

    def release(self) -> None:
        if self.pending is not None:
            self.pending.release()


@dataclass
class _StagedGroup:
    """A group of put jobs being run: their staged batch, or why it could not be staged or made
    durable (``_commit_group`` then reports it)."""

    jobs: List["PutJob"]
    put: Optional[_StagedPut] = None
    error: Optional[Exception] = None

    def synced(self) -> "Optional[concurrent.futures.Future[None]]":
        """The future of the payload's sync (None: nothing to wait for, or staging failed)."""
        if self.put is None or self.error is not None or self.put.pending is None:
            return None
        return self.put.pending.durable

    def synced_now(self) -> bool:
        """Whether the group is staged and its payload's sync already succeeded (or it has none
        to wait for)."""
        if self.put is None or self.error is not None:
            return False
        synced = self.synced()
        return synced is None or (synced.done() and not synced.cancelled() and synced.exception() is None)

    def durable(self, side: "WriterSide") -> bool:
        """Wait until the payload is synced (True), or record why not (False)."""
        if self.put is None or self.error is not None:
            return False
        try:
            side.durable_values(self.put)
        except Exception as exc:  # noqa: BLE001 - reported by _commit_group
            self.error = exc
            return False
        return True


@dataclass
class PutJob(Job):
    """An encoded put batch; consecutive ones are committed together by ``WriterSide.run_put_group``."""

    encoded: List[Tuple[bytes, bytes]] = field(default_factory=list)
    raw_in: int = 0


class SegmentWatcher(Protocol):
    """What the writer side tells about segments (writer thread; ``compactor.Compactor``)."""

    def segments_changed(self, ledger: Ledger) -> None:
        """Inside a put/delete transaction, after its ledger's commit."""

    def segment_rotated(self, name: str) -> None:
        """After this writer closed its active segment ``name``."""


class _NoWatcher:
    def segments_changed(self, ledger: Ledger) -> None:
        pass

    def segment_rotated(self, name: str) -> None:
        pass


class WriterSide:
    """Write transactions, the LRU index and the sequence (writer thread). See the module docstring.

    ``lru``: key -> stored bytes, first victim first, as built at open; ``sequence``: the
    environment's mutation sequence at open."""

    def __init__(
        self,
        db: LmdbEnv,
        lru: ByteLru,
        sequence: int,
        removals: RemovalFeed,
        segment_reader: SegmentReader,
        *,
        capacity: Optional[int],
        max_map_size: int,
        max_quarantine: int,
        segment_threshold: Optional[int],
        segment_max_bytes: int,
    ) -> None:
        self._db = db
        self._path = db.path
        self._count = db.counters.count
        self.lru = lru
        # The environment's mutation sequence as of our last commit (or the open, or a snapshot).
        self.sequence = sequence
        # (key, time_ns) of reads, appended by readers (any thread), drained here into the LRU and ``atime``.
        self.accesses: Deque[Tuple[bytes, int]] = deque()
        self.degraded = False
        self.capacity = capacity
        self._max_map_size = max_map_size
        self._max_quarantine = max_quarantine
        # Records of at least this many encoded bytes go to segment files (None: all inline).
        self.segment_threshold = segment_threshold
        self.segment_max_bytes = segment_max_bytes
        self.segment_writer: Optional[SegmentWriter] = None
        self._segment_reader = segment_reader
        self._removals = removals
        # Segments whose last record the transaction being built removes (deleted after its commit).
        self.emptied_segments: List[str] = []
        self._watcher: SegmentWatcher = _NoWatcher()
        # The number of the next segment this writer opens, taken from the directory's counter
        # inside a put's commit: a rotation then needs no write transaction of its own (each one
        # syncs the environment and, beside the serving process's threads, waits for the GIL
        # after every one of its LMDB calls).
        self._next_segment_number: Optional[int] = None

    def watch(self, watcher: SegmentWatcher) -> None:
        """Tell ``watcher`` of segment changes from now on (before the writer thread starts)."""
        self._watcher = watcher

    @property
    def active_segment(self) -> Optional[str]:
        """This writer's active segment file (None: none open)."""
        return self.segment_writer.active if self.segment_writer is not None else None

    def write(self, body: Callable[["lmdb.Transaction[memoryview]"], Callable[[], T]], nbytes: int = 0) -> T:
        """Writer thread: run ``body`` in one write transaction that also bumps the sequence, and
        commit; ``body`` returns the in-memory update to apply once the commit succeeded (it sees the
        new ``sequence``). MapFullError -> grow and retry."""
        while True:
            self.emptied_segments = []
            try:
                with self._db.map_lock.shared():
                    with self._db.env.begin(write=True, buffers=True) as txn:
                        sequence = bump_sequence(txn, self._db.tables)
                        apply = body(txn)
                        self._db.io_hook.before("commit")  # raising here aborts the transaction
            except lmdb.MapFullError as exc:
                self._grow_map(nbytes, exc)
                continue
            except lmdb.MapResizedError:
                with self._db.map_lock.exclusive():
                    self._db.env.set_mapsize(0)
                continue
            except lmdb.Error as exc:
                raise self._write_failed(exc, nbytes) from exc
            self.degraded = False
            self.sequence = max(self.sequence, sequence)
            # Committed: nothing below may fail the batch. The in-memory update and its removal
            # reports come first; deleting the emptied files never raises (``remove_dead``).
            result = apply()
            if self.emptied_segments:
                remove_dead(self._path, self.emptied_segments, self.segment_writer, self._segment_reader)
            return result

    def _grow_map(self, nbytes: int, cause: BaseException) -> None:
        current = self._db.env.info()["map_size"]
        if current >= self._max_map_size:
            self.degraded = True
            self._count(errors=1)
            raise TierFullError(
                f"LMDB map of {self._path} is at max_map_size_bytes={self._max_map_size}"
            ) from cause
        new = min(self._max_map_size, max(current * 2, current + 2 * nbytes))
        with self._db.map_lock.exclusive():
            self._db.env.set_mapsize(new)
        self._count(map_growths=1)
        log.info("kvtier lmdb: map of %s grown from %d to %d bytes", self._path, current, new)

    def _write_failed(self, exc: lmdb.Error, nbytes: int) -> TierIOError:
        self.degraded = True
        self._count(errors=1)
        full = "No space" in str(exc) or getattr(exc, "errno", None) == errno.ENOSPC
        if not full:
            # LMDB reports a short write on a full disk as EIO; look at the filesystem.
            free = free_bytes(self._path)
            full = free is not None and free < nbytes + (1 << 20)
        if isinstance(exc, lmdb.PanicError):
            self._db.reopen()
        if full:
            return TierFullError(f"disk full under {self._path}: {exc}")
        return TierIOError(f"LMDB write failed in {self._path}: {exc}")

    def take_accesses(self) -> List[Tuple[bytes, int]]:
        """Writer thread: drain recorded reads and move those keys to the young end of the LRU."""
        taken: Dict[bytes, int] = {}
        while True:
            try:
                key, t = self.accesses.popleft()
            except IndexError:
                break
            taken.pop(key, None)  # its last read sets its place in the LRU, not its first
            taken[key] = t
        return [(key, t) for key, t in taken.items() if self.lru.touch(key)]

    def _put_access_times(self, txn: lmdb.Transaction, accesses: List[Tuple[bytes, int]], skip: object) -> None:
        for key, t in accesses:
            size = self.lru.get(key)
            # Another process may have removed the record since it was read (our LRU does not see
            # that): an access time without its record would list a key no record backs.
            if size is not None and key not in skip and txn.get(key, db=self._db.tables.chunks) is not None:  # type: ignore[operator]
                txn.put(key, ATIME.pack(t, size), db=self._db.tables.atime)

    def flush_accesses(self) -> None:
        accesses = self.take_accesses()
        if not accesses:
            return

        def body(txn: lmdb.Transaction) -> Callable[[], None]:
            self._put_access_times(txn, accesses, ())
            return lambda: None

        self.write(body)

    def run_put_group(self, group: List[Job], more: Callable[..., List[Job]] = lambda until=None: []) -> None:
        """Writer thread: commit consecutive put batches in one transaction (they share its
        sequence); if that fails, run each alone so every caller gets its own outcome.

        Pipelined: while a group's payload is being written and synced (the lanes, then the sync
        thread), every put group that arrives (``more``) is staged at once -- its direct writes
        begun behind the ones in flight -- up to ``STAGED_GROUPS`` ahead, so the disk's queue never
        drains between batches while this thread waits for a sync or commits. Each group is still
        acknowledged only after its own payload was synced and the commit of its records
        succeeded, and commits keep the queue's order; the groups behind the one committing next
        whose payload is synced by then commit in its transaction (``_synced_behind``)."""
        pipeline: Deque[_StagedGroup] = deque([self._stage_group(group)])
        while pipeline:
            current = pipeline[0]
            synced = current.synced()
            while len(pipeline) < STAGED_GROUPS:
                following = more(synced)  # waits for a group until this one's payload is synced
                if not following:
                    break
                pipeline.append(self._stage_group(following))
            together = self._synced_behind(pipeline) if current.durable(self) else [current]
            self._commit_groups(together)
            for _ in together:
                pipeline.popleft()

    def _synced_behind(self, pipeline: Deque["_StagedGroup"]) -> List["_StagedGroup"]:
        """The pipeline's head (durable) and the groups right behind it whose payload is
        already synced (none is waited for), as many as fit the capacity together. Committed in
        one transaction, they pay once for what every commit costs whatever its size: the
        sequence, the ledger, the environment's sync, and beside the serving process's threads a
        wait for the GIL after each of those LMDB calls."""
        head = pipeline[0]
        assert head.put is not None, "a durable group is staged"
        together = [head]
        total, cap = head.put.batch_bytes, self.capacity
        for group in itertools.islice(pipeline, 1, None):
            if not group.synced_now():
                break
            assert group.put is not None, "a synced group is staged"
            if cap is not None and total + group.put.batch_bytes > cap:
                break
            if not group.durable(self):  # synced: returns at once
                break
            total += group.put.batch_bytes
            together.append(group)
        return together

    def _commit_groups(self, together: List["_StagedGroup"]) -> None:
        """Commit durable groups in one transaction (they share its sequence); if that fails, each
        commits alone and so gets its own outcome."""
        if len(together) == 1:
            self._commit_group(together[0])
            return
        puts = [group.put for group in together if group.put is not None]
        assert len(puts) == len(together), "only staged, durable groups are committed together"
        try:
            sequence = self.commit_put(*puts)
        except Exception:  # noqa: BLE001 - each group alone decides its own fate
            for group in together:
                self._commit_group(group)
            return
        for group, put in zip(together, puts):
            put.release()
            for j in group.jobs:
                j.finish(sequence)

    def _stage_group(self, group: List[Job]) -> "_StagedGroup":
        jobs = [j for j in group if isinstance(j, PutJob)]
        assert len(jobs) == len(group), "the writer groups only the jobs naming this runner: PutJobs"
        staged = _StagedGroup(jobs)
        try:
            if len(jobs) > 1:
                staged.put = self.stage_put([item for j in jobs for item in j.encoded],
                                            sum(j.raw_in for j in jobs), batches=len(jobs))
            else:
                staged.put = self.stage_put(jobs[0].encoded, jobs[0].raw_in)
        except Exception as exc:  # noqa: BLE001 - reported by _commit_group
            staged.error = exc
        return staged

    def _commit_group(self, staged: "_StagedGroup") -> None:
        jobs = staged.jobs
        if staged.put is not None:
            try:
                if staged.error is None:
                    sequence = self.commit_put(staged.put)
                    for j in jobs:
                        j.finish(sequence)
                    return
            except Exception as exc:  # noqa: BLE001 - reported below
                staged.error = exc
            finally:
                staged.put.release()  # committed or given up: the segment descriptor goes
        if len(jobs) == 1:
            jobs[0].finish(None, staged.error)
            return
        for j in jobs:  # each batch alone decides its own fate
            j.run()

    def put_encoded(self, encoded: List[Tuple[bytes, bytes]], raw_in: int, batches: int = 1) -> int:
        """Writer thread: store encoded records, evicting least recently used ones for room in the
        same transaction; returns the sequence that made them visible."""
        staged = self.stage_put(encoded, raw_in, batches)
        try:
            return self.commit_put(staged)
        finally:
            staged.release()

    def stage_put(self, encoded: List[Tuple[bytes, bytes]], raw_in: int, batches: int = 1) -> "_StagedPut":
        """Writer thread: the first half of ``put_encoded``: the batch checked against the capacity
        and its large records' direct writes begun (``commit_put`` waits for them)."""
        batch: Dict[bytes, bytes] = {}
        for key, record in encoded:
            batch[key] = record  # the later write of a key wins, as sequential puts would
        batch_bytes = sum(len(r) for r in batch.values())
        cap = self.capacity
        if cap is not None and batch_bytes > cap:
            raise TierFullError(f"a batch of {batch_bytes} bytes exceeds capacity_bytes={cap}")
        threshold = self.segment_threshold
        large = [key for key, record in batch.items() if threshold is not None and len(record) >= threshold]
        pending = self.begin_append([batch[key] for key in large], ahead=True) if large else None
        return _StagedPut(batch, batch_bytes, len(encoded), raw_in, batches, large, pending)

    def commit_put(self, *staged: "_StagedPut") -> int:
        """Writer thread: wait until each staged batch's payload is durable, then commit their
        records (pointers or inline) in one transaction with the evictions that make room, a
        later batch's write of a key winning as sequential commits would; returns the sequence
        that made them visible. Together they must fit the capacity. The caller releases each
        ``staged`` afterwards."""
        assert staged, "commit_put commits at least one staged batch"
        if len(staged) == 1:  # the common case: the batch's own maps, no copies
            values, batch, batch_bytes = self.durable_values(staged[0]), staged[0].batch, staged[0].batch_bytes
        else:
            values, batch = {}, {}
            for part in staged:
                values.update(self.durable_values(part))
                batch.update(part.batch)
            batch_bytes = sum(len(r) for r in batch.values())
        cap = self.capacity
        accesses = self.take_accesses()
        victims: List[bytes] = []
        if cap is not None:
            excess = self.lru.total_bytes + self.lru.growth({k: len(r) for k, r in batch.items()}) - cap
            chosen = self.lru.choose_victims(excess, keep=batch)
            # The batch fits the capacity, so every other record together always frees enough.
            assert chosen is not None
            victims = [key for key, _ in chosen]
        victim_set = set(victims)
        reserve = self._next_segment_number is None and any(part.large for part in staged)

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            self._put_access_times(txn, accesses, victim_set)
            # One ledger for the evictions and the puts: when the victims are every earlier record
            # of the segment this batch was just appended to, a ledger of their own would see it
            # emptied and the commit would delete the file under the batch's new records.
            ledger = Ledger(txn, self._db.tables.writable_segments)
            self._delete_records(txn, victims, ledger)
            now = time.time_ns()
            puts, times = [], []
            for key, record in batch.items():
                self._db.io_hook.before("put")
                value = values[key]
                if is_pointer(value):
                    ledger.add(SegmentPointer.unpack(value))
                puts.append((key, value))
                times.append((key, ATIME.pack(now, len(record))))
            self._put_new_records(txn, puts, ledger)
            txn.cursor(db=self._db.tables.atime).putmulti(times)
            ledger.commit()
            self.emptied_segments += ledger.emptied
            self._watcher.segments_changed(ledger)
            number = take_segment_number(txn, self._db.tables, self._path) if reserve else None

            def apply() -> int:
                if number is not None:
                    self._next_segment_number = number
                self.forget(victims, "evicted", evictions=len(victims))
                for key, record in batch.items():
                    self.lru.put(key, len(record))
                compressed = sum(1 for r in batch.values() if codec_of(r) != "raw")
                self._count(
                    puts=sum(part.records for part in staged),
                    put_batches=sum(part.batches for part in staged),
                    put_commits=1,
                    raw_bytes_in=sum(part.raw_in for part in staged),
                    stored_bytes_in=batch_bytes,
                    compressed_records=compressed,
                )
                return self.sequence

            return apply

        sequence = self.write(body, batch_bytes)
        for part in staged:  # committed: the aligned buffers go back to the pool
            release_records(part.batch.values())
        return sequence

    def _put_new_records(self, txn: lmdb.Transaction, puts: List[Tuple[bytes, bytes]], ledger: Ledger) -> None:
        """Put ``chunks`` values, each key's old value (if any) dropped from ``ledger``. Every
        LMDB call releases the GIL and each return waits for it behind the serving process's
        other threads, so new keys (the common case) go in one ``putmulti`` that neither reads
        nor overwrites; only when some key was stored already is each one read back."""
        chunks = self._db.tables.chunks
        consumed, added = txn.cursor(db=chunks).putmulti(puts, overwrite=False)
        assert consumed == len(puts)
        if added == consumed:
            return
        for key, value in puts:
            old = txn.get(key, db=chunks)
            assert old is not None, "every key was just put"
            # The value a refused put left in place; an equal one (the same inline record
            # stored again) needs neither the ledger nor an overwrite.
            if old != value:
                ledger.drop(old)
                txn.put(key, value, db=chunks)

    def durable_values(self, staged: "_StagedPut") -> Dict[bytes, bytes]:
        """key -> the ``chunks`` value of each record (a pointer, or the record itself), once the
        staged batch's segment bytes are synced (raises as ``append_synced``; waits once)."""
        if staged.values is None:
            if staged.pending is None:
                staged.values = staged.batch
            else:
                pointers = self.finish_append(staged.pending)
                values = dict(staged.batch)
                for key, pointer in zip(staged.large, pointers):
                    values[key] = pointer.pack()
                staged.values = values
        return staged.values

    def append_synced(self, records: List[bytes]) -> List[SegmentPointer]:
        """Append ``records`` to this writer's segment (opening one if needed) and sync it; a
        failure marks the tier degraded (puts, and compaction's moves)."""
        pending = self.begin_append(records)
        try:
            return self.finish_append(pending)
        finally:
            pending.release()

    def begin_append(self, records: List[bytes], *, ahead: bool = False) -> PendingAppend:
        """Start appending ``records`` to this writer's segment (``SegmentWriter.begin``; ``ahead``:
        a put, whose blocks are allocated ahead for the puts after it); the caller finishes
        (``finish_append``) and releases it. Failures as ``append_synced``."""
        if self.segment_writer is None:
            self.segment_writer = SegmentWriter(self._path, self.segment_max_bytes, numbers=self._take_segment_number)
        self._db.io_hook.before("put")
        with self._segment_step():
            pending = self.segment_writer.begin(records, ahead=ahead)
        return pending

    def finish_append(self, pending: PendingAppend) -> List[SegmentPointer]:
        """Wait until ``pending``'s bytes are synced; returns its pointers (committable now)."""
        assert self.segment_writer is not None
        with self._segment_step():
            pointers = self.segment_writer.finish(pending)
        return pointers

    @contextlib.contextmanager
    def _segment_step(self) -> Iterator[None]:
        """A step of the segment writer: a failure marks the tier degraded; a rotation it made is
        reported to the watcher once the step succeeded."""
        assert self.segment_writer is not None
        was = self.segment_writer.active
        with self._marking_degraded():
            yield
        if was is not None and self.segment_writer.active != was:
            self._watcher.segment_rotated(was)

    @contextlib.contextmanager
    def _marking_degraded(self) -> Iterator[None]:
        try:
            yield
        except (TierIOError, TierFullError) as exc:
            self.degraded = True
            if not isinstance(exc.__cause__, lmdb.Error):  # a failed numbering commit: _write counted it
                self._count(errors=1)
            raise

    def _take_segment_number(self) -> int:
        """Writer thread, before a new segment is created: its number, taken from the directory's
        counter (committed before the file exists, so no other process or later tier instance ever
        gets the same one): the one an earlier put's commit took ahead, else in a write
        transaction of its own. A number taken ahead and never used is a gap, never a repeat."""
        number, self._next_segment_number = self._next_segment_number, None
        if number is not None:
            return number

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            number = take_segment_number(txn, self._db.tables, self._path)
            return lambda: number

        return self.write(body)

    def delete_keys(self, keys: List[bytes]) -> int:
        accesses = self.take_accesses()
        gone = set(keys)

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            self._put_access_times(txn, accesses, gone)
            existed = [k for k in dict.fromkeys(keys) if txn.get(k, db=self._db.tables.chunks) is not None]
            self._delete_records(txn, existed)
            return lambda: self.forget(existed, "deleted", deletes=len(existed))

        return self.write(body)

    def quarantine_entries(self, entries: List[Tuple[bytes, int, str]]) -> int:
        """Writer thread: move records found corrupt to ``quarantine`` (deleting them instead once it
        holds ``max_quarantine_records``), unless the key was rewritten since (its bytes changed)."""

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            room = QuarantineRoom(self._max_quarantine, txn.stat(self._db.tables.quarantine)["entries"])
            moved: List[bytes] = []
            for key, digest, _reason in entries:
                current = txn.get(key, db=self._db.tables.chunks)
                if current is None or xxhash.xxh3_64_intdigest(current) != digest:
                    continue
                if room.take():
                    txn.put(key, self._quarantine_bytes(current), db=self._db.tables.quarantine)
                moved.append(key)
            self._delete_records(txn, moved)
            return lambda: self.forget(moved, "quarantined", quarantined=len(moved))

        return self.write(body)

    def _quarantine_bytes(self, value: "bytes | memoryview") -> bytes:
        """What the quarantine keeps of a ``chunks`` value: the record (read from its segment when
        the value is a pointer and the segment still has it), else the value itself."""
        if is_pointer(value):
            try:
                return self._segment_reader.read(value)
            except (CorruptRecordError, TierIOError):
                pass
        return bytes(value)

    def evict_to(self, max_bytes: int) -> int:
        accesses = self.take_accesses()
        chosen = self.lru.choose_victims(self.lru.total_bytes - max_bytes)
        victims = [key for key, _ in chosen or ()]  # None only for max_bytes < 0, refused by gc
        victim_set = set(victims)

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            self._put_access_times(txn, accesses, victim_set)
            self._delete_records(txn, victims)
            return lambda: self.forget(victims, "evicted", evictions=len(victims))

        return self.write(body)

    def _delete_records(self, txn: lmdb.Transaction, keys: Sequence[bytes], ledger: Optional[Ledger] = None) -> None:
        """In a write transaction: delete ``keys`` from ``chunks`` and their ``atime`` entries; a
        segment whose last record goes is deleted after the commit (``_write``). With ``ledger``
        the segment changes go into the caller's ledger, which the caller commits."""
        own = ledger is None
        if ledger is None:
            ledger = Ledger(txn, self._db.tables.writable_segments)
        for key in keys:
            old = txn.get(key, db=self._db.tables.chunks)
            if old is not None:
                ledger.drop(old)
            txn.delete(key, db=self._db.tables.chunks)
            txn.delete(key, db=self._db.tables.atime)
        if own:
            ledger.commit()
            self.emptied_segments += ledger.emptied
            self._watcher.segments_changed(ledger)

    def forget(self, keys: Sequence[bytes], reason: str, **counts: int) -> int:
        """After the commit that removed ``keys``: drop them from the LRU, count, report them."""
        for key in keys:
            self.lru.pop(key)
        self._count(**counts)
        self._report_removed(keys, reason)
        return len(keys)

    def _report_removed(self, keys: Sequence[bytes], reason: str) -> None:
        """After a commit: report ``keys`` as removed at the sequence just committed."""
        if keys:
            sequence = self.sequence
            self._removals.publish([Removal(key, sequence, reason) for key in keys])

    def drop_dangling_atime(self, keys: List[bytes]) -> int:
        """Writer thread: delete ``atime`` entries whose key still has no record."""

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            gone = [k for k in keys if txn.get(k, db=self._db.tables.chunks) is None and txn.delete(k, db=self._db.tables.atime)]
            return lambda: self.forget(gone, "quarantined", quarantined=len(gone))

        return self.write(body)

    def check_index(self) -> List[str]:
        """Writer thread (or any thread when read-only): compare the LRU index with the tables."""

        def body(txn: lmdb.Transaction) -> Tuple[Dict[bytes, int], set]:
            sizes = {bytes(k): stored_size(v) for k, v in txn.cursor(db=self._db.tables.chunks).iternext(keys=True, values=True)}
            times = {bytes(k) for k in txn.cursor(db=self._db.tables.atime).iternext(keys=True, values=False)}
            return sizes, times

        sizes, times = self._db.read_txn(body)
        problems = self.lru.reconcile(sizes, self.capacity)
        for key in times - sizes.keys():
            problems.append(f"access time without a record: {key.hex()}")
        return problems
