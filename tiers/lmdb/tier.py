"""``LmdbTier``: the ``ChunkTier`` facade over one LMDB environment, wiring the parts that do the work.

Parts, and the threads that may call them:

- ``LmdbTier`` (this module) -- its async methods are called on the event-loop thread and never
  block it: they hand work to threads and await one future per batch. ``await LmdbTier.open(path,
  ...)`` builds it on a worker thread; ``LmdbTier(path, ...)`` is the same, blocking (for tools and
  the sync helpers). The blocking tool calls (``iter_records``, ``verify``, ``gc``,
  ``quarantined_keys``, ``compact_segments_sync``, ``close_sync``) run on any thread of the
  opening process but the writer.
- ``environment.LmdbEnv``: the environment, its tables and the map lock (any thread).
- ``writes.WriterSide``: every write transaction, the LRU index, the sequence and the segment
  writer -- on the writer thread only (``tiers.writer.WriterThread``, one per tier; consecutive put
  batches are committed together, one fsync).
- ``reads.ReaderSide``: the read pool (``read_workers`` threads: encodes put batches, runs read
  transactions, decodes records into the caller's buffers) and the segment reader.
- ``compactor.Compactor``: segment compaction, planned on the read pool or a tool thread
  (``compaction``'s pure rules), moved in writer-thread steps; the writer side tells it of segment
  changes.
- ``maintenance.Maintenance``: the blocking walks behind ``iter_records`` / ``verify``.
- the timer thread (``timer.PeriodicThread``): ``env.reader_check()`` and the segment reader's
  ``sweep`` every ``reader_check_interval_s`` (reader check also once at open), and asks the
  writer to persist access times every ``access_flush_interval_s``.

Capacity (``capacity_bytes``) counts stored record bytes (``statistics()['bytes']``); the data file
is larger by LMDB's page rounding and free pages. A record that fails its checksum on a read is a
miss: counted at once (``statistics()['corrupt']``) and moved to ``quarantine`` by the writer.

A cache directory whose ``data.mdb`` is not an LMDB file, is truncated, or whose tables do not
parse raises ``CorruptCacheError`` at open (see ``recovery``: a truncated file would otherwise make
LMDB touch pages past the end of the file: SIGBUS). LMDB trusts its B-tree pages (no page checksums)
and can crash the process walking damaged ones, so with ``verify_structure=True`` the open first
checks the whole file with py-lmdb's offline verifier when no other process has it open.
``_io_hook`` (a ``tiers.base.IOHook``, the environment's) is called before every put, commit and
read transaction: the fault suite makes it raise.

One writing process per directory: other processes may open the same directory (``readonly=True``
for pure readers) and LMDB keeps it consistent, but this process's LRU accounting only sees its own
writes. A forked child must open its own tier: every call from another pid raises
``ForkedProcessError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import lmdb

from kvtier.errors import ClosedError, ForkedProcessError, TierFullError, TierIOError

from ..base import (
    ChunkMeta,
    ChunkTier,
    Forwarded,
    GetItem,
    IOHook,
    KeySnapshot,
    PutItem,
    RemovalCallback,
    RemovalFeed,
    TierStatistics,
    check_key,
)
from ..codec_pool import wait_threads
from ..owned_tasks import wait_through_cancel
from ..lru import make_byte_index
from ..quarantine import DEFAULT_MAX_QUARANTINE_RECORDS, check_max_quarantine_records
from ..record_format import CodecConfig
from ..safedir import ensure_private_dir
from ..writer import Job, WriterThread, loop_callback
from .compaction import DEFAULT_COMPACTION_LIVE_FRACTION, CompactionReport, check_live_fraction
from .compactor import Compactor
from .environment import Counters, LmdbEnv, claim_directory, release_directory
from .maintenance import Maintenance, RecordInfo, VerifyReport
from .opening import DirectorySnapshot
from .reads import CorruptEntry, ReaderSide
from .segment_reader import SegmentReader
from .segment_records import borrows_buffers
from .segments import DEFAULT_SEGMENT_MAX_BYTES, DEFAULT_SEGMENT_THRESHOLD_BYTES, check_segment_threshold
from .tables import index_entries, read_sequence
from .timer import PeriodicThread
from .writes import PutJob, WriterSide

__all__ = ["LmdbTier", "DEFAULT_READ_WORKERS"]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

_MIN_MAP_SIZE = 1 << 20
# Read threads. A segment record's direct read blocks its thread for the whole I/O, so this is also
# the reads in flight: cold restores of a batch ran at 0.73-0.87x of vLLM's 16 reader threads with
# 4, and at 0.79-1.38x with 8, in alternating runs on this project's virtual disk. Each holds a read
# transaction while its I/O runs (the pointers it read stay valid), and LMDB's 126 reader slots are
# shared by every process on the directory: 8 leaves room for a tensor-parallel group of 8.
DEFAULT_READ_WORKERS = 8
# Recorded reads waiting for the writer; past this many a flush is queued at once (bounds memory).
_ACCESS_FLUSH_BACKLOG = 1 << 16
# Counters with a TierStatistics field of their own, and the LMDB-only ones (in ``extra``).
_COUNTERS = ("puts", "put_batches", "gets", "hits", "misses", "corrupt", "mismatched", "quarantined", "evictions",
             "deletes", "errors", "put_commits", "raw_bytes_in", "stored_bytes_in", "compressed_records",
             "map_growths", "stale_readers_cleared", "compaction_passes", "compacted_records", "compacted_bytes",
             "compacted_segments", "compaction_bytes_freed")


class LmdbTier(ChunkTier):
    """Chunk records in one LMDB environment (see the module docstring for threads and tables).

    Arguments (units in the names): ``capacity_bytes`` bounds stored record bytes (``None``: only
    the disk and ``max_map_size_bytes`` bound it); ``map_size_bytes`` is the initial map, grown by
    doubling up to ``max_map_size_bytes``; ``codec`` encodes records; ``read_workers`` threads read and
    encode (``DEFAULT_READ_WORKERS``); ``readonly`` opens for reading only (writes raise ``TierIOError``);
    ``verify_structure`` checks the whole LMDB file with py-lmdb's offline verifier before LMDB
    touches it, when no other process has it open (``CorruptCacheError`` if damaged);
    ``segment_threshold_bytes``: records of at least this many encoded bytes go to append-only
    segment files beside ``data.mdb`` (``segments``: O_DIRECT, synced before the commit that points
    at them); the default, ``DEFAULT_SEGMENT_THRESHOLD_BYTES`` (128 KiB), is where segments start
    to write faster than LMDB (docs/ARCHITECTURE.md); ``None`` or 0 keeps every record inside LMDB.
    Either setting reads and deletes both kinds, so a cache written with one opens with the other. ``segment_max_bytes``: a writer starts a
    new segment past this size (space returns by whole segment).
    ``segment_compaction_live_fraction``: a closed segment whose live bytes fall below this fraction
    of its size has its live records moved and is deleted (``compaction``; 0 turns it off).
    ``index_in_background``: a writable open leaves building the eviction index (a walk of every
    record's access time) to the writer thread, as its first job: the open then takes the same
    time at any size, writes wait for the index, reads do not; ``statistics()``' ``bytes`` and
    ``count`` are 0 until it is built (``flush`` waits for it).
    """

    name = "lmdb"

    def __init__(
        self,
        path: PathLike,
        *,
        capacity_bytes: Optional[int] = None,
        map_size_bytes: int = 1 << 30,
        max_map_size_bytes: int = 1 << 40,
        codec: CodecConfig = CodecConfig(),
        read_workers: int = DEFAULT_READ_WORKERS,
        reader_check_interval_s: float = 30.0,
        access_flush_interval_s: float = 5.0,
        readonly: bool = False,
        max_quarantine_records: int = DEFAULT_MAX_QUARANTINE_RECORDS,
        max_raw_bytes: int = 1 << 31,
        verify_structure: bool = False,
        segment_threshold_bytes: Optional[int] = DEFAULT_SEGMENT_THRESHOLD_BYTES,
        segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES,
        segment_compaction_live_fraction: float = DEFAULT_COMPACTION_LIVE_FRACTION,
        eviction_policy: str = "lru",
        index_in_background: bool = False,
    ) -> None:
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes <= 0):
            raise ValueError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
        if not isinstance(map_size_bytes, int) or map_size_bytes < _MIN_MAP_SIZE:
            raise ValueError(f"map_size_bytes must be an int >= {_MIN_MAP_SIZE}, got {map_size_bytes!r}")
        if not isinstance(max_map_size_bytes, int) or max_map_size_bytes < map_size_bytes:
            raise ValueError(f"max_map_size_bytes must be an int >= map_size_bytes, got {max_map_size_bytes!r}")
        if not isinstance(codec, CodecConfig):
            raise TypeError(f"codec must be a CodecConfig, got {type(codec).__name__}")
        if not isinstance(read_workers, int) or read_workers < 1:
            raise ValueError(f"read_workers must be an int >= 1, got {read_workers!r}")
        if not reader_check_interval_s > 0:
            raise ValueError(f"reader_check_interval_s must be > 0, got {reader_check_interval_s!r}")
        if not access_flush_interval_s > 0:
            raise ValueError(f"access_flush_interval_s must be > 0, got {access_flush_interval_s!r}")
        check_max_quarantine_records(max_quarantine_records)
        threshold = check_segment_threshold(segment_threshold_bytes)
        if not isinstance(segment_max_bytes, int) or segment_max_bytes < 1 << 20:
            raise ValueError(f"segment_max_bytes must be an int >= {1 << 20}, got {segment_max_bytes!r}")
        live_fraction = check_live_fraction(segment_compaction_live_fraction)
        make_byte_index(eviction_policy)  # an unknown name: ValueError listing the valid ones, before any file
        self._capacity = capacity_bytes
        self._index_error: Optional[BaseException] = None  # a background index load that failed
        self._codec = codec
        self._readonly = bool(readonly)
        self._pid = os.getpid()
        self._closed = False
        self._state_lock = threading.Lock()
        self._removals = RemovalFeed()
        self._closing: "Optional[asyncio.Future[None]]" = None
        counters = Counters(_COUNTERS)

        before = DirectorySnapshot(path)
        self._path = ensure_private_dir(path, create=not self._readonly, files=("data.mdb", "lock.mdb"))
        segment_reader = SegmentReader(self._path)
        self._dir_id = claim_directory(self._path)
        db = LmdbEnv(self._path, counters, readonly=self._readonly, verify_structure=bool(verify_structure),
                     pointers=threshold is not None)
        try:
            # The eviction index is a walk of every record: in the background it is the writer's
            # first job (every write queues behind it), so the open does not grow with the cache.
            background = bool(index_in_background) and not self._readonly
            lru, sequence = db.open_with_index(map_size_bytes, eviction_policy, build_index=not background)
        except BaseException as exc:
            release_directory(self._dir_id)
            if isinstance(exc, TierFullError):
                before.restore()  # a full disk: leave the directory as it was
            raise

        self._db = db
        self._writes = WriterSide(
            db, lru, sequence, self._removals, segment_reader, capacity=capacity_bytes,
            max_map_size=max_map_size_bytes, max_quarantine=max_quarantine_records,
            segment_threshold=threshold, segment_max_bytes=segment_max_bytes)
        self._reads = ReaderSide(db, segment_reader, read_workers=read_workers, max_raw_bytes=max_raw_bytes,
                                 on_corrupt=self._queue_quarantine)
        self._writer: Optional[WriterThread] = None
        self._compactor: Optional[Compactor] = None
        if not self._readonly:
            self._writer = WriterThread(f"kvtier-lmdb-writer:{self._path.name}")
            self._compactor = Compactor(db, self._writes, self._reads, self._writer, live_fraction=live_fraction)
            self._writes.watch(self._compactor)
            if background:
                self._writer.submit(Job(lambda: self._load_index(eviction_policy), _log_failure))
        self._live_fraction = live_fraction
        self._maintenance = Maintenance(db, self._writes, self._reads, self._writer)
        self._timer = PeriodicThread(
            "kvtier-lmdb-timer",
            [
                (float(reader_check_interval_s), self._clear_stale_readers),
                (float(access_flush_interval_s), self._request_access_flush),
            ],
        )

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    async def open(cls, path: PathLike, **kwargs: object) -> "LmdbTier":
        """Open (creating 0700 if needed) the tier at ``path`` on a worker thread; arguments as the
        constructor. Cancelling the await does not stop the open: the tier is then closed in the
        background so the directory is not left locked by an orphan."""
        loop = asyncio.get_running_loop()
        cf = loop.run_in_executor(None, lambda: cls(path, **kwargs))  # type: ignore[arg-type]
        try:
            return await asyncio.shield(cf)
        except asyncio.CancelledError:
            cf.add_done_callback(_close_orphan)
            raise

    # ---------------------------------------------------------------------------------- properties

    @property
    def path(self) -> Path:
        return self._path

    @property
    def readonly(self) -> bool:
        return self._readonly

    # The environment's sequence as of this tier's last commit or snapshot, and ``degraded``: both
    # the writer side's. The fault-injection point is the environment's (puts, commits, reads).
    sequence: Forwarded[int] = Forwarded("_writes", "sequence")
    degraded: Forwarded[bool] = Forwarded("_writes", "degraded")
    _io_hook: Forwarded[IOHook] = Forwarded("_db", "io_hook", settable=True)

    # ------------------------------------------------------------------------------- guards, utils

    def _check_usable(self, write: bool = False) -> None:
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"LmdbTier at {self._path} was opened by pid {self._pid}; open a new one in pid {os.getpid()}"
            )
        if self._closed:
            raise ClosedError(f"LmdbTier at {self._path} is closed")
        if write and self._readonly:
            raise TierIOError(f"LmdbTier at {self._path} is open read-only")
        if write and self._index_error is not None:
            raise TierIOError(f"LmdbTier at {self._path} could not read its eviction index: "
                              f"{self._index_error}") from self._index_error

    def _load_index(self, eviction_policy: str) -> None:
        """Writer thread, its first job (``index_in_background``): build the eviction index. A
        failure leaves the tier readable and refusing writes: without the index it cannot keep
        its capacity."""
        try:
            self._writes.lru = self._db.load_index(eviction_policy)
        except BaseException as exc:
            self._index_error = exc
            raise

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedProcessError(f"LmdbTier at {self._path} belongs to pid {self._pid}")

    def _queue_quarantine(self, entries: List[CorruptEntry]) -> None:
        """Read pool: hand records a read found corrupt to the writer (quarantined there)."""
        if self._writer is not None:
            try:
                self._writer.submit(Job(lambda: self._writes.quarantine_entries(entries), _log_failure))
            except ClosedError:
                pass

    # --------------------------------------------------------------------------------- async API

    async def put_many(self, items: Sequence[PutItem]) -> int:
        """Encode (on the read pool, in slices) and store a batch in one transaction; durable when it
        returns; returns the sequence that made it visible (``ChunkTier`` rules).

        All or nothing. Raises ``TierFullError`` (batch larger than the capacity, disk full, map at
        its limit), ``TierIOError`` (LMDB failed; the tier is then ``degraded``), ``ClosedError``.
        Cancelling it: the batch still lands (or fails) all or nothing; the call returns only once
        nothing reads the raw buffers any more -- once encoding has read them, or, when records go
        to a segment straight from the caller's page-aligned buffers, once the batch has landed or
        failed -- then re-raises ``CancelledError``.
        """
        self._check_usable(write=True)
        batch = []
        for key, meta, raw in items:
            batch.append((check_key(key), meta, raw))
        if not batch:
            return self._writes.sequence
        assert self._writer is not None  # not readonly, checked above
        loop = asyncio.get_running_loop()
        fut: "asyncio.Future[int]" = loop.create_future()
        done = loop_callback(loop, fut)
        writer = self._writer
        raw_in = sum(memoryview(raw).nbytes for _, _, raw in batch)
        encoding = self._reads.encode(batch, self._codec, self._writes.segment_threshold)

        def hand_to_writer(encoded: "concurrent.futures.Future[List[Tuple[bytes, bytes]]]") -> None:
            # On the encoding thread that finished last: the batch goes to the writer even if the
            # caller was cancelled meanwhile (it still lands), and before close_sync's pool shutdown
            # returns (so close commits it).
            exc = encoded.exception()
            if exc is not None:
                done(None, exc)
                return
            records = encoded.result()
            try:
                writer.submit(
                    PutJob(
                        fn=lambda: self._writes.put_encoded(records, raw_in),
                        done=done,
                        group=self._writes.run_put_group,
                        weight=sum(len(r) for _, r in records),
                        encoded=records,
                        raw_in=raw_in,
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting caller
                done(None, exc)

        encoding.add_done_callback(hand_to_writer)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            try:
                await wait_threads(encoding)  # the buffer rule: encoders no longer read the raw buffers
                if borrows_buffers(record for _, record in encoding.result()):
                    await wait_through_cancel(fut)  # nor does the segment writer
            finally:
                if not fut.cancel():  # done already: mark its outcome read, it is nobody's now
                    fut.exception()
            raise

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Decode each record straight into its buffer (read pool; the batch is split across
        ``read_workers`` read transactions). Per item the meta, or ``None``: absent, corrupt (counted,
        quarantined by the writer, reported as removed), or intact but of another size than the
        buffer (``mismatched``).

        Cancelling it: slices not yet started are abandoned, running ones finish into the buffers,
        and only then does the call re-raise ``CancelledError`` (the buffer rule); the hits of a
        cancelled call do not count as uses in the LRU.
        """
        self._check_usable()
        checked = [(check_key(k), v) for k, v in items]
        if not checked:
            return []
        results = await self._reads.get_many_into(checked)
        # The hits count as uses in the batch's order, not in the order its slices happened to
        # finish on the read threads: the LRU's order is then a function of the calls made.
        self._record_accesses([key for (key, _), meta in zip(checked, results) if meta is not None], time.time_ns())
        return results

    def _record_accesses(self, keys: Sequence[bytes], now: int) -> None:
        """Queue ``keys`` as used at ``now`` for the writer, which moves them young in the LRU and
        persists their access times (any thread: a deque's append is atomic)."""
        if self._readonly:
            return
        accesses = self._writes.accesses
        for key in keys:
            accesses.append((key, now))
        if len(accesses) > _ACCESS_FLUSH_BACKLOG and self._writer is not None:
            try:
                self._writer.submit(Job(self._writes.flush_accesses, _log_failure))
            except ClosedError:
                pass

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Move the ``keys`` this tier holds to the young end of its LRU as a read would (applied by
        the writer with the next reads; ``ChunkTier.touch_many``). Any thread of the opening
        process; does nothing once closed or read-only."""
        if not self._closed and os.getpid() == self._pid:
            self._record_accesses([check_key(k) for k in keys], time.time_ns())

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove records in one transaction; returns how many existed (each reported as removed,
        ``"deleted"``). Cancelling it: the transaction still runs; only the answer is dropped."""
        self._check_usable(write=True)
        checked = [check_key(k) for k in keys]
        if not checked:
            return 0
        assert self._writer is not None
        return await self._writer.submit_async(lambda: self._writes.delete_keys(checked))

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Which keys have a record (one read transaction, no checksum). Cancelling drops the answer."""
        self._check_usable()
        checked = [check_key(k) for k in keys]
        if not checked:
            return []

        def body(txn: lmdb.Transaction) -> List[bool]:
            return [txn.get(k, db=self._db.tables.chunks) is not None for k in checked]

        return await self._reads.in_pool(lambda: self._db.read_txn(body))

    async def list_keys(self) -> List[bytes]:
        """Every stored key, read from the ``atime`` side table (see ``tables.index_entries``: walking
        ``chunks`` would read every record from disk). Cancelling drops the answer."""
        return list((await self.snapshot_keys()).keys)

    async def snapshot_keys(self) -> KeySnapshot:
        """Every stored key and the environment's sequence, read in one read transaction: exact,
        including other processes' writes. Cancelling drops the answer."""
        self._check_usable()

        def body(txn: lmdb.Transaction) -> KeySnapshot:
            keys = frozenset(key for _, key, _ in index_entries(txn, self._db.tables))
            return KeySnapshot(keys, read_sequence(txn, self._db.tables))

        snapshot = await self._reads.in_pool(lambda: self._db.read_txn(body))
        self._writes.sequence = max(self._writes.sequence, snapshot.sequence)
        return snapshot

    async def flush(self) -> None:
        """Wait until every write queued so far (puts, quarantines) is committed and persist access
        times. Cancelling the await does not stop the flush."""
        self._check_usable()
        if self._writer is None:
            return
        await self._writer.submit_async(self._writes.flush_accesses)

    async def check(self) -> List[str]:
        """Self-check: reconcile the in-memory LRU index and byte count with the tables; one line
        per disagreement (empty when consistent). Runs after the writes queued so far (on the
        writer thread). Cancelling the await drops the answer only."""
        self._check_usable()
        if self._writer is None:
            return await self._reads.in_pool(self._writes.check_index)
        return await self._writer.submit_async(self._writes.check_index)

    def subscribe_removals(self, callback: RemovalCallback) -> None:
        """Report every record this tier stops serving -- capacity eviction (also by ``gc``),
        quarantine, ``delete_many`` -- as ``Removal`` records with the sequence of the commit that
        removed them, on the loop running now (``ChunkTier`` rules). Removals by other processes
        are not reported: ``snapshot_keys`` finds them."""
        self._removals.subscribe(callback)

    async def close(self) -> None:
        """Let running reads and queued writes finish, persist access times, close the environment.
        Safe to call twice (a second call waits for the first). Runs on a worker thread; cancelling
        the await does not stop the close."""
        self._check_owner()
        if self._closing is None:
            if self._closed:  # closed by close_sync
                return
            self._closing = asyncio.get_running_loop().run_in_executor(None, self.close_sync)
        await asyncio.shield(self._closing)

    def close_sync(self) -> None:
        """Blocking ``close`` for tools and tests without a loop. Safe to call twice."""
        self._check_owner()
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        self._timer.stop()
        self._reads.shutdown()  # encodes hand their batches to the writer before this returns
        if self._writer is not None:
            try:
                self._writer.call(self._writes.flush_accesses)
            except Exception:
                log.exception("kvtier lmdb: could not persist access times at close")
            self._writer.stop()
        if self._writes.segment_writer is not None:
            self._writes.segment_writer.close()
        self._reads.segment_reader.close()
        self._db.close()
        release_directory(self._dir_id)

    async def __aenter__(self) -> "LmdbTier":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __enter__(self) -> "LmdbTier":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close_sync()

    def statistics(self) -> TierStatistics:
        """The shared counters (``TierStatistics``) and, in ``extra``: ``map_size_bytes``,
        ``put_commits``, ``raw_bytes_in``, ``stored_bytes_in``, ``compressed_records``,
        ``map_growths``, ``stale_readers_cleared``, and segment compaction's ``compaction_passes``,
        ``compacted_records`` / ``compacted_bytes`` (records moved), ``compacted_segments`` /
        ``compaction_bytes_freed`` (segment files it emptied and deleted, their sizes). Cheap and
        never waits; any thread of the opening process (it reads the environment's info, which a
        forked child must not touch). The map size is read under the shared map lock, as every
        read transaction: a growth or reopen remaps the environment under the exclusive one, and
        LMDB's info reads the meta pages inside the map (py-lmdb releases the GIL there). When the
        lock is taken (a remap running or waiting), the size this call last read is reported: the
        event loop and vLLM's scheduler call this, and must not wait behind a remap."""
        self._check_owner()
        return TierStatistics.from_counters(
            self._db.counters.snapshot(), self._writes.lru, capacity_bytes=self._capacity,
            degraded=self._writes.degraded, map_size_bytes=self._db.map_size_nowait(self._closed),
        )

    # ------------------------------------------------------------------------- compaction, tools

    async def compact_segments(self, *, live_fraction: Optional[float] = None) -> CompactionReport:
        """Plan a pass over the closed segments below ``live_fraction`` (default: the tier's
        ``segment_compaction_live_fraction``; and over the capacity margin) and move their live
        records, one writer job of at most ``compaction.STEP_BYTES`` at a time (puts queued
        meanwhile run between the steps); returns what it did. Plans and waits on a thread of the
        loop's default executor, never on the loop.

        Cancelling it: the step already handed to the writer still runs to its commit (all or
        nothing: each moved key holds its old pointer or its new one); no further step starts,
        records moved so far stay moved, and their emptied sources are still deleted once no older
        read transaction remains (a timer retries; a crash leaves them to the next open)."""
        fraction = self._compaction_fraction(live_fraction)
        assert self._compactor is not None  # not read-only: checked above
        return await self._compactor.compact(fraction)

    def compact_segments_sync(self, *, live_fraction: Optional[float] = None) -> CompactionReport:
        """Blocking ``compact_segments`` for tools (``kvtier gc``) and tests: plans on the calling
        thread, moves on the writer thread."""
        fraction = self._compaction_fraction(live_fraction)
        assert self._compactor is not None  # not read-only: checked above
        return self._compactor.run_passes(fraction, threading.Event())

    def _compaction_fraction(self, live_fraction: Optional[float]) -> float:
        fraction = self._live_fraction if live_fraction is None else check_live_fraction(live_fraction)
        self._check_usable(write=True)
        return fraction

    def iter_records(self) -> Iterator[RecordInfo]:
        """Every record with its parsed header (blocking; for ``kvtier inspect``). Reads in
        transactions of a few hundred records, so a long listing never pins old pages for long."""
        self._check_usable()
        return self._maintenance.iter_records()

    def verify(self, *, quarantine: bool = True) -> VerifyReport:
        """Decode every record fully (checksum, codec) and check that its key still finds it
        (``maintenance.Maintenance.verify``); quarantine the corrupt ones unless told not to or
        read-only. Blocking; for ``kvtier verify`` and stress-test teardown."""
        self._check_usable()
        return self._maintenance.verify(quarantine=quarantine)

    def gc(self, max_bytes: int) -> int:
        """Evict least-recently-used records until stored bytes <= ``max_bytes``; returns how many
        were evicted. Blocking (runs on the writer thread)."""
        self._check_usable(write=True)
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        assert self._writer is not None
        return self._writer.call(lambda: self._writes.evict_to(max_bytes))

    def quarantined_keys(self) -> List[bytes]:
        """Keys held in the quarantine table (blocking)."""
        self._check_usable()
        return self._maintenance.quarantined_keys()

    # ------------------------------------------------------------------------- timer-thread tasks

    def _request_access_flush(self) -> Optional[bool]:
        """Ask the writer to persist recorded access times (False ends the timer: closing)."""
        if self._writes.accesses and self._writer is not None:
            try:
                self._writer.submit(Job(self._writes.flush_accesses, _log_failure))
            except ClosedError:
                return False
        return None

    def _clear_stale_readers(self) -> Optional[bool]:
        """Free reader slots of dead processes, and close read fds of segments deleted meanwhile
        (``SegmentReader.sweep``: their space comes back; False ends the timer: closing)."""
        try:
            with self._db.map_lock.shared():
                if self._closed:
                    return False
                cleared = self._db.env.reader_check()
            self._reads.segment_reader.sweep()  # fds of segments deleted meanwhile (by any process): space back
            if cleared:
                log.warning("kvtier lmdb: cleared %d stale readers in %s", cleared, self._path)
                self._db.counters.count(stale_readers_cleared=cleared)
        except lmdb.Error:
            log.exception("kvtier lmdb: reader_check failed")
        return None


def _log_failure(result: object, exc: Optional[BaseException]) -> None:
    if exc is not None:
        log.warning("kvtier lmdb: background write failed: %s", exc)


def _close_orphan(cf: "asyncio.Future[LmdbTier]") -> None:
    if not cf.cancelled() and cf.exception() is None:
        threading.Thread(target=cf.result().close_sync, daemon=True).start()
