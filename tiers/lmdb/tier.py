"""``LmdbTier``: the ``ChunkTier`` facade over one LMDB environment, its opening and its read path.

Primitives and the threads they run on:

- ``LmdbTier`` -- its async methods are called on the event-loop thread and never block it: they
  hand work to threads and await one future per batch. ``await LmdbTier.open(path, ...)`` builds it
  on a worker thread; ``LmdbTier(path, ...)`` is the same, blocking (for tools and the sync helpers).
- the writer thread (``tiers.writer.WriterThread``, one per tier) owns every write transaction and
  the LRU index (``writes.WriterSide``); consecutive put batches are committed together (one fsync).
- the read pool (``read_workers`` threads): encodes put batches (zstd, off the loop), runs read
  transactions, decodes records straight from ``txn.get(key)`` (``buffers=True``) into the caller's
  buffers while the transaction is open.
- the timer thread (``timer.PeriodicThread``): ``env.reader_check()`` and the segment reader's
  ``sweep`` every ``reader_check_interval_s`` (reader check also once at open), and asks the writer to persist access times every
  ``access_flush_interval_s``.
- blocking helpers for tools (``maintenance.Maintenance``): ``iter_records``, ``verify``, ``gc``,
  ``quarantined_keys``, ``compact_segments_sync``, and ``close_sync``; ``compact_segments`` (async)
  and the automatic passes are ``compaction.Compaction``'s (planned on the read pool, moved in
  writer-thread steps).

Capacity (``capacity_bytes``) counts stored record bytes (``statistics()['bytes']``); the data file
is larger by LMDB's page rounding and free pages. A record that fails its checksum on a read is a
miss: counted at once (``statistics()['corrupt']``) and moved to ``quarantine`` by the writer.

A cache directory whose ``data.mdb`` is not an LMDB file, is truncated, or whose tables do not
parse raises ``CorruptCacheError`` at open (see ``recovery``: a truncated file would otherwise make
LMDB touch pages past the end of the file: SIGBUS). LMDB trusts its B-tree pages (no page checksums)
and can crash the process walking damaged ones, so with ``verify_structure=True`` the open first
checks the whole file with py-lmdb's offline verifier when no other process has it open.
``_io_hook`` (a ``tiers.base.IOHook``) is called before every put, commit and read transaction: the
fault suite makes it raise.

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
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import lmdb
import xxhash

from kvtier.errors import (
    ClosedError,
    CorruptCacheError,
    CorruptRecordError,
    ForkedProcessError,
    RecordSizeMismatchError,
    TierFullError,
    TierIOError,
)

from ..base import (
    NO_IO_HOOK,
    ChunkMeta,
    ChunkTier,
    GetItem,
    IOHook,
    KeySnapshot,
    PutItem,
    RemovalCallback,
    RemovalFeed,
    TierStatistics,
    check_key,
)
from ..codec_pool import MIN_SLICE_BYTES, map_slices, wait_threads
from ..owned_tasks import wait_through_cancel
from ..lru import make_byte_index
from ..quarantine import DEFAULT_MAX_QUARANTINE_RECORDS, check_max_quarantine_records
from ..record_format import CodecConfig, decode_record, encode_record
from ..safedir import ensure_private_dir
from ..writer import Job, SharedExclusiveLock, WriterThread, loop_callback
from .compaction import DEFAULT_COMPACTION_LIVE_FRACTION, STEP_BYTES as COMPACTION_STEP_BYTES, check_live_fraction
from .maintenance import Maintenance
from .readahead import advise_willneed
from .segment_records import borrows_buffers, encode_for_segments
from .recovery import CORRUPT_LMDB_ERRORS, check_data_file, verify_structure_at_rest
from .opening import DirectorySnapshot, is_disk_full, lock_for_readonly, open_kvtier_tables, prepare_lock_file
from .tables import index_entries, read_sequence
from .timer import PeriodicThread
from .segment_reader import SegmentReader
from .segments import (
    DEFAULT_SEGMENT_MAX_BYTES,
    DEFAULT_SEGMENT_THRESHOLD_BYTES,
    SegmentWriter,
    check_segment_threshold,
    committed_ends,
    is_pointer,
    reclaim_orphans,
)
from .writes import PutJob

__all__ = ["LmdbTier", "DEFAULT_READ_WORKERS"]

log = logging.getLogger(__name__)

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]

_MIN_MAP_SIZE = 1 << 20
# Read (and encode) threads. A segment record's direct read blocks its thread for the whole I/O, so
# this is also the reads in flight: 4, as the bench's O_DIRECT read limit (2 left cold 256 KiB
# restores at ~0.6x of that limit, 4 brought them to ~0.9x in the same runs).
DEFAULT_READ_WORKERS = 4
# Recorded reads waiting for the writer; past this many a flush is queued at once (bounds memory).
_ACCESS_FLUSH_BACKLOG = 1 << 16
# Counters with a TierStatistics field of their own, and the LMDB-only ones (in ``extra``).
_COUNTERS = ("puts", "put_batches", "gets", "hits", "misses", "corrupt", "mismatched", "quarantined", "evictions",
             "deletes", "errors", "put_commits", "raw_bytes_in", "stored_bytes_in", "compressed_records",
             "map_growths", "stale_readers_cleared", "compaction_passes", "compacted_records", "compacted_bytes",
             "compacted_segments", "compaction_bytes_freed")

# the other's locks). Keyed by (st_dev, st_ino) of the directory; the pid guards against a fork
# inheriting the parent's entries.
_OPEN_DIRS: Dict[Tuple[int, int], int] = {}
_OPEN_DIRS_LOCK = threading.Lock()


class LmdbTier(ChunkTier, Maintenance):
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
        self._compaction_live_fraction = check_live_fraction(segment_compaction_live_fraction)
        self._compaction_step_bytes = COMPACTION_STEP_BYTES
        self._compaction_scheduled = False
        self._compaction_wanted = False
        self._compaction_offered: Dict[str, float] = {}
        self._compacting = False
        self._next_automatic_at = 0.0
        self._offered_at_open = False
        self._retiring: List[Tuple[int, str, int]] = []
        self._retire_timer = False
        self._segment_threshold = threshold
        self._segment_max_bytes = segment_max_bytes
        self._segment_writer: Optional[SegmentWriter] = None
        self._emptied_segments: List[str] = []

        self._capacity = capacity_bytes
        self._max_map_size = max_map_size_bytes
        self._codec = codec
        self._readonly = bool(readonly)
        self._max_quarantine = max_quarantine_records
        self._max_raw_bytes = max_raw_bytes
        self._verify_structure = bool(verify_structure)
        self._reader_check_interval = float(reader_check_interval_s)
        self._access_flush_interval = float(access_flush_interval_s)
        self._pid = os.getpid()
        self._closed = False
        self._state_lock = threading.Lock()
        self._map_lock = SharedExclusiveLock()
        self._counters_lock = threading.Lock()
        self._counters: Dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._degraded = False
        # Owned by the writer thread once it starts: key -> stored bytes, first victim first.
        self._eviction_policy = eviction_policy
        self._lru = make_byte_index(eviction_policy)  # an unknown name: ValueError listing the valid ones
        self._sequence = 0
        self._accesses: Deque[Tuple[bytes, int]] = deque()
        self._removals = RemovalFeed()
        self._io_hook: IOHook = NO_IO_HOOK
        self._closing: "Optional[asyncio.Future[None]]" = None

        before = DirectorySnapshot(path)
        self._path = ensure_private_dir(path, create=not self._readonly, files=("data.mdb", "lock.mdb"))
        self._segment_reader = SegmentReader(self._path)
        st = os.stat(self._path)
        self._dir_id = (st.st_dev, st.st_ino)
        with _OPEN_DIRS_LOCK:
            owner = _OPEN_DIRS.get(self._dir_id)
            if owner == self._pid:
                raise ValueError(f"{self._path} is already open in this process; share that LmdbTier")
            _OPEN_DIRS[self._dir_id] = self._pid
        try:
            self._open_env(map_size_bytes)
            try:
                cleared = self._env.reader_check()
                self._counters["stale_readers_cleared"] += cleared
                self._load_index()
                if not self._readonly:
                    self._reclaim_segment_orphans()
            except CORRUPT_LMDB_ERRORS as exc:
                raise CorruptCacheError(f"the LMDB environment in {self._path} is damaged: {exc}") from exc
            except lmdb.Error as exc:
                raise TierIOError(f"cannot read the index of {self._path}: {exc}") from exc
        except BaseException as exc:
            with _OPEN_DIRS_LOCK:
                _OPEN_DIRS.pop(self._dir_id, None)
            env = getattr(self, "_env", None)
            if env is not None:
                env.close()
            if isinstance(exc, TierFullError):
                before.restore()  # a full disk: leave the directory as it was
            raise

        self._pool = ThreadPoolExecutor(max_workers=read_workers, thread_name_prefix="kvtier-lmdb-read")
        self._read_workers = read_workers
        self._writer: Optional[WriterThread] = None
        if not self._readonly:
            self._writer = WriterThread(f"kvtier-lmdb-writer:{self._path.name}")
        self._timer = PeriodicThread(
            "kvtier-lmdb-timer",
            [
                (self._reader_check_interval, self._clear_stale_readers),
                (self._access_flush_interval, self._request_access_flush),
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

    def _open_env(self, map_size_bytes: int) -> None:
        check_data_file(self._path)
        # The lock file is allocated before LMDB maps it, so a full disk is TierFullError instead
        # of SIGBUS. A read-only open uses it too (creating it if it can): reads outside LMDB's
        # reader table let a writer reuse their pages mid-read. Where it cannot, every read copies
        # the record out of the map before checking it (``_lockless``).
        if self._readonly:
            use_lock = lock_for_readonly(self._path)
            if not use_lock:
                log.info("kvtier lmdb: %s: cannot use or create lock.mdb (a read-only mount, no permission "
                         "or no space): reading without LMDB's lock, each record copied, then checked", self._path)
        else:
            prepare_lock_file(self._path)
            use_lock = True
        self._lockless = not use_lock
        if self._verify_structure and not hasattr(self, "_env"):  # not on a reopen after MDB_PANIC
            verify_structure_at_rest(self._path, create_lock=not self._readonly)
        try:
            self._env = lmdb.open(
                str(self._path),
                subdir=True,
                map_size=map_size_bytes,
                max_dbs=5,
                # Both fsyncs on every commit: DESIGN promises that a put whose wait_durable() said
                # True survives a power cut, and with metasync=False the last commit's meta page
                # may not be on disk yet (LMDB then opens at the transaction before).
                sync=True,
                metasync=True,
                writemap=False,
                readahead=True,
                readonly=self._readonly,
                create=not self._readonly,
                mode=0o600,
                lock=use_lock,
            )
        except CORRUPT_LMDB_ERRORS as exc:
            raise CorruptCacheError(f"cannot open LMDB environment at {self._path}: {exc}") from exc
        except lmdb.Error as exc:
            if is_disk_full(exc):
                raise TierFullError(f"no space left to open the LMDB environment at {self._path}: {exc}") from exc
            raise TierIOError(f"cannot open LMDB environment at {self._path}: {exc}") from exc
        try:
            # compaction moves pointers too, but only in a cache that already holds them (b"2")
            self._tables = open_kvtier_tables(self._env, self._path, self._readonly,
                                              pointers=self._segment_threshold is not None)
        except CORRUPT_LMDB_ERRORS as exc:
            self._env.close()
            raise CorruptCacheError(f"the tables in {self._path} are damaged: {exc}") from exc
        except lmdb.Error as exc:
            self._env.close()
            if is_disk_full(exc):
                raise TierFullError(f"no space left to create the tables in {self._path}: {exc}") from exc
            raise TierIOError(f"cannot open tables in {self._path}: {exc}") from exc
        except BaseException:
            self._env.close()
            raise
        self._map_size_read = float(self._env.info()["map_size"])  # statistics() while a remap runs

    def _read_at_open(self, body: Callable[[lmdb.Transaction], T]) -> T:
        """``body`` in a new read transaction while opening (LMDB errors propagate to the caller,
        which maps them), adopting a map another process grew since we opened it."""
        for attempt in range(3):
            try:
                with self._env.begin(buffers=True) as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                if attempt == 2:
                    raise
                self._env.set_mapsize(0)
        raise AssertionError("unreachable")

    def _load_index(self) -> None:
        """Rebuild the LRU index: (last access, key, stored bytes), older first."""
        entries, self._sequence = self._read_at_open(
            lambda txn: (index_entries(txn, self._tables), read_sequence(txn, self._tables)))
        entries.sort()
        self._lru = make_byte_index(self._eviction_policy, ((key, size) for _, key, size in entries))

    def _reclaim_segment_orphans(self) -> None:
        """Truncate or delete what a crash between a segment append and its commit left behind. The
        committed ends are read by ``reclaim_orphans`` itself, in a transaction begun only once it
        holds every file it decides on (its docstring says why nothing a live writer committed, or
        will commit, is touched)."""
        try:
            removed, truncated = reclaim_orphans(
                self._path, lambda: self._read_at_open(lambda txn: committed_ends(txn, self._tables.segments)))
        except OSError as exc:
            raise TierIOError(f"cannot reclaim orphan segments in {self._path}: {exc}") from exc
        if removed or truncated:
            log.warning("kvtier lmdb: %s: removed %d orphan segments, truncated %d orphan tails",
                        self._path, removed, truncated)

    # ---------------------------------------------------------------------------------- properties

    @property
    def path(self) -> Path:
        return self._path

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def closed(self) -> bool:
        return self._closed

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

    def _count(self, **deltas: int) -> None:
        with self._counters_lock:
            for k, v in deltas.items():
                self._counters[k] += v

    def _submit_to_pool(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the read pool, unawaited (any thread); ``ClosedError`` once closing."""
        try:
            self._pool.submit(fn)
        except RuntimeError as exc:  # shut down by close()
            raise ClosedError(f"LmdbTier at {self._path} is closed") from exc

    async def _in_pool(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            cf = loop.run_in_executor(self._pool, fn)
        except RuntimeError as exc:  # shut down by close()
            raise ClosedError(f"LmdbTier at {self._path} is closed") from exc
        return await cf

    def _read_txn(self, body: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``body`` in a read transaction under the shared map lock (any thread but the writer)."""
        for attempt in range(3):
            try:
                with self._map_lock.shared():
                    with self._env.begin(buffers=True) as txn:
                        self._io_hook.before("read")
                        return body(txn)
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size (no transaction may be open here).
                with self._map_lock.exclusive():
                    self._env.set_mapsize(0)
            except lmdb.Error as exc:
                self._count(errors=1)
                raise TierIOError(f"LMDB read failed in {self._path}: {exc}") from exc
        raise TierIOError(f"LMDB map of {self._path} keeps being resized by another process")

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
            return self._sequence
        assert self._writer is not None  # not readonly, checked above
        loop = asyncio.get_running_loop()
        fut: "asyncio.Future[int]" = loop.create_future()
        done = loop_callback(loop, fut)
        writer = self._writer
        raw_in = sum(memoryview(raw).nbytes for _, _, raw in batch)
        codec = self._codec
        threshold = self._segment_threshold
        try:
            encoding = map_slices(
                self._pool,
                lambda part: [(key, encode_record(key, meta, raw, codec) if threshold is None
                               else encode_for_segments(key, meta, raw, codec, threshold)) for key, meta, raw in part],
                batch,
                [memoryview(raw).nbytes for _, _, raw in batch],
                workers=self._read_workers,
                min_slice_bytes=MIN_SLICE_BYTES,
            )
        except RuntimeError as exc:  # the pool is shut down: close() ran
            raise ClosedError(f"LmdbTier at {self._path} is closed") from exc

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
                        fn=lambda: self._put_encoded(records, raw_in),
                        done=done,
                        group=self._run_put_group,
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
        try:
            reading = map_slices(
                self._pool,
                self._read_slice,
                checked,
                [1] * len(checked),
                workers=self._read_workers,
                min_slice_bytes=1,
            )
        except RuntimeError as exc:  # the pool is shut down: close() ran
            raise ClosedError(f"LmdbTier at {self._path} is closed") from exc
        results = await wait_threads(reading, abandon_unstarted=True)
        # The hits count as uses in the batch's order, not in the order its slices happened to
        # finish on the read threads: the LRU's order is then a function of the calls made.
        self._record_accesses([key for (key, _), meta in zip(checked, results) if meta is not None], time.time_ns())
        return results

    def _read_slice(self, items: List[GetItem]) -> List[Optional[ChunkMeta]]:
        corrupt: List[Tuple[bytes, int, str]] = []

        def body(txn: lmdb.Transaction) -> List[Optional[ChunkMeta]]:
            results: List[Optional[ChunkMeta]] = []
            corrupt.clear()
            records = [txn.get(key, db=self._tables.chunks) for key, _ in items]
            # the whole slice's pages in flight
            advise_willneed(r for r in records if r is not None and not is_pointer(r))
            if self._lockless:  # a writer may reuse these pages mid-read: check only a private copy
                records = [None if r is None else memoryview(bytes(r)) for r in records]
            # segment records first, all together (adjacent ones share a read); outcomes by index
            in_segments = [i for i, r in enumerate(records) if r is not None and is_pointer(r)]
            outcomes = dict(zip(in_segments, self._segment_reader.read_many_into(
                [(items[i][0], records[i], items[i][1]) for i in in_segments], max_raw_bytes=self._max_raw_bytes)))
            for i, ((key, buf), record) in enumerate(zip(items, records)):
                if record is None:
                    results.append(None)
                    continue
                try:
                    if i in outcomes:
                        meta = outcomes[i]
                        if isinstance(meta, BaseException):
                            raise meta
                    else:
                        meta, _ = decode_record(key, record, buf, max_raw_bytes=self._max_raw_bytes)
                except RecordSizeMismatchError as exc:
                    log.warning("kvtier lmdb: %s for key %s", exc, key.hex())
                    results.append(None)
                    self._count(mismatched=1)
                except CorruptRecordError as exc:
                    corrupt.append((key, xxhash.xxh3_64_intdigest(record), str(exc)))
                    results.append(None)
                else:
                    results.append(meta)
            return results

        results = self._read_txn(body)
        if corrupt:
            corrupt[:] = self._still_stored(corrupt)
        hits = sum(1 for r in results if r is not None)
        self._count(gets=len(items), hits=hits, misses=len(items) - hits, corrupt=len(corrupt))
        if corrupt:
            for key, _, reason in corrupt:
                log.warning("kvtier lmdb: corrupt record %s in %s: %s", key.hex(), self._path, reason)
            if self._writer is not None:
                entries = list(corrupt)
                try:
                    self._writer.submit(Job(lambda: self._quarantine_entries(entries), _log_failure))
                except ClosedError:
                    pass
        return results

    def _record_accesses(self, keys: Sequence[bytes], now: int) -> None:
        """Queue ``keys`` as used at ``now`` for the writer, which moves them young in the LRU and
        persists their access times (any thread: a deque's append is atomic)."""
        if self._readonly:
            return
        for key in keys:
            self._accesses.append((key, now))
        if len(self._accesses) > _ACCESS_FLUSH_BACKLOG and self._writer is not None:
            try:
                self._writer.submit(Job(self._flush_accesses, _log_failure))
            except ClosedError:
                pass

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Move the ``keys`` this tier holds to the young end of its LRU as a read would (applied by
        the writer with the next reads; ``ChunkTier.touch_many``). Any thread of the opening
        process; does nothing once closed or read-only."""
        if not self._closed and os.getpid() == self._pid:
            self._record_accesses([check_key(k) for k in keys], time.time_ns())

    def _still_stored(self, corrupt: List[Tuple[bytes, int, str]]) -> List[Tuple[bytes, int, str]]:
        """Of the records a read found bad, those whose key still holds the same value. A pointer
        read just before its segment file was deleted (the key deleted, evicted or overwritten
        meanwhile, by this process or another) finds the file gone: a plain miss, not corruption
        to count, log or quarantine."""

        def body(txn: lmdb.Transaction) -> List[Tuple[bytes, int, str]]:
            out = []
            for entry in corrupt:
                current = txn.get(entry[0], db=self._tables.chunks)
                if current is not None and xxhash.xxh3_64_intdigest(current) == entry[1]:
                    out.append(entry)
            return out

        return self._read_txn(body)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove records in one transaction; returns how many existed (each reported as removed,
        ``"deleted"``). Cancelling it: the transaction still runs; only the answer is dropped."""
        self._check_usable(write=True)
        checked = [check_key(k) for k in keys]
        if not checked:
            return 0
        assert self._writer is not None
        return await self._writer.submit_async(lambda: self._delete_keys(checked))

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Which keys have a record (one read transaction, no checksum). Cancelling drops the answer."""
        self._check_usable()
        checked = [check_key(k) for k in keys]
        if not checked:
            return []

        def body(txn: lmdb.Transaction) -> List[bool]:
            return [txn.get(k, db=self._tables.chunks) is not None for k in checked]

        return await self._in_pool(lambda: self._read_txn(body))

    async def list_keys(self) -> List[bytes]:
        """Every stored key, read from the ``atime`` side table (see ``tables.index_entries``: walking
        ``chunks`` would read every record from disk). Cancelling drops the answer."""
        return list((await self.snapshot_keys()).keys)

    async def snapshot_keys(self) -> KeySnapshot:
        """Every stored key and the environment's sequence, read in one read transaction: exact,
        including other processes' writes. Cancelling drops the answer."""
        self._check_usable()

        def body(txn: lmdb.Transaction) -> KeySnapshot:
            keys = frozenset(key for _, key, _ in index_entries(txn, self._tables))
            return KeySnapshot(keys, read_sequence(txn, self._tables))

        snapshot = await self._in_pool(lambda: self._read_txn(body))
        self._sequence = max(self._sequence, snapshot.sequence)
        return snapshot

    @property
    def sequence(self) -> int:
        """The environment's sequence as of this tier's last commit or snapshot."""
        return self._sequence

    async def flush(self) -> None:
        """Wait until every write queued so far (puts, quarantines) is committed and persist access
        times. Cancelling the await does not stop the flush."""
        self._check_usable()
        if self._writer is None:
            return
        await self._writer.submit_async(self._flush_accesses)

    async def check(self) -> List[str]:
        """Self-check: reconcile the in-memory LRU index and byte count with the tables; one line
        per disagreement (empty when consistent). Runs after the writes queued so far (on the
        writer thread). Cancelling the await drops the answer only."""
        self._check_usable()
        if self._writer is None:
            return await self._in_pool(self._check_index)
        return await self._writer.submit_async(self._check_index)

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
        if os.getpid() != self._pid:
            raise ForkedProcessError(f"LmdbTier at {self._path} belongs to pid {self._pid}")
        if self._closing is None:
            if self._closed:  # closed by close_sync
                return
            self._closing = asyncio.get_running_loop().run_in_executor(None, self.close_sync)
        await asyncio.shield(self._closing)

    def close_sync(self) -> None:
        """Blocking ``close`` for tools and tests without a loop. Safe to call twice."""
        if os.getpid() != self._pid:
            raise ForkedProcessError(f"LmdbTier at {self._path} belongs to pid {self._pid}")
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        self._timer.stop()
        self._pool.shutdown(wait=True)  # encodes hand their batches to the writer before this returns
        if self._writer is not None:
            try:
                self._writer.call(self._flush_accesses)
            except Exception:
                log.exception("kvtier lmdb: could not persist access times at close")
            self._writer.stop()
        if self._segment_writer is not None:
            self._segment_writer.close()
        self._segment_reader.close()
        with self._map_lock.exclusive():
            self._env.close()
        with _OPEN_DIRS_LOCK:
            if _OPEN_DIRS.get(self._dir_id) == self._pid:
                del _OPEN_DIRS[self._dir_id]

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
        if os.getpid() != self._pid:
            raise ForkedProcessError(f"LmdbTier at {self._path} belongs to pid {self._pid}")
        with self._counters_lock:
            counters = dict(self._counters)
        with self._map_lock.shared_nowait() as held:
            if held and not self._closed:
                try:
                    self._map_size_read = float(self._env.info()["map_size"])
                except lmdb.Error:
                    self._map_size_read = 0.0
        map_size = self._map_size_read if not self._closed else 0.0
        return TierStatistics.from_counters(
            counters, self._lru, capacity_bytes=self._capacity, degraded=self._degraded, map_size_bytes=map_size
        )

    # ------------------------------------------------------------------------- timer-thread tasks

    def _request_access_flush(self) -> Optional[bool]:
        """Ask the writer to persist recorded access times (False ends the timer: closing)."""
        if self._accesses and self._writer is not None:
            try:
                self._writer.submit(Job(self._flush_accesses, _log_failure))
            except ClosedError:
                return False
        return None

    def _clear_stale_readers(self) -> Optional[bool]:
        """Free reader slots of dead processes, and close read fds of segments deleted meanwhile
        (``SegmentReader.sweep``: their space comes back; False ends the timer: closing)."""
        try:
            with self._map_lock.shared():
                if self._closed:
                    return False
                cleared = self._env.reader_check()
            self._segment_reader.sweep()  # fds of segments deleted meanwhile (by any process): space back
            if cleared:
                log.warning("kvtier lmdb: cleared %d stale readers in %s", cleared, self._path)
                self._count(stale_readers_cleared=cleared)
        except lmdb.Error:
            log.exception("kvtier lmdb: reader_check failed")
        return None


def _log_failure(result: object, exc: Optional[BaseException]) -> None:
    if exc is not None:
        log.warning("kvtier lmdb: background write failed: %s", exc)


def _close_orphan(cf: "asyncio.Future[LmdbTier]") -> None:
    if not cf.cancelled() and cf.exception() is None:
        threading.Thread(target=cf.result().close_sync, daemon=True).start()
