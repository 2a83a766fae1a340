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
- the timer thread (``timer.PeriodicThread``): ``env.reader_check()`` every
  ``reader_check_interval_s`` (and once at open), and asks the writer to persist access times every
  ``access_flush_interval_s``.
- blocking helpers for tools (``maintenance.Maintenance``): ``iter_records``, ``verify``, ``gc``,
  ``quarantined_keys``, and ``close_sync``.

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
import logging
import os
import threading
import time
from collections import OrderedDict, deque
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

from ..base import NO_IO_HOOK, ChunkMeta, ChunkTier, GetItem, IOHook, PutItem
from ..record import CodecConfig, decode_record, encode_record
from ..safedir import ensure_private_dir
from ..writer import Job, SharedExclusiveLock, WriterThread, loop_callback
from .maintenance import Maintenance
from .recovery import CORRUPT_LMDB_ERRORS, check_data_file, verify_structure_at_rest
from .opening import DirectorySnapshot, is_disk_full, lock_for_readonly, open_kvtier_tables, prepare_lock_file
from .tables import index_entries
from .timer import PeriodicThread
from .writes import PutJob

__all__ = ["LmdbTier"]

log = logging.getLogger(__name__)

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]

_MIN_MAP_SIZE = 1 << 20
# Recorded reads waiting for the writer; past this many a flush is queued at once (bounds memory).
_ACCESS_FLUSH_BACKLOG = 1 << 16
# A put batch at least this large is encoded in parallel slices (one per read worker); below it the
# extra pool hop (~100 us) costs more than the second core saves.
_PARALLEL_ENCODE_BYTES = 1 << 20

# the other's locks). Keyed by (st_dev, st_ino) of the directory; the pid guards against a fork
# inheriting the parent's entries.
_OPEN_DIRS: Dict[Tuple[int, int], int] = {}
_OPEN_DIRS_LOCK = threading.Lock()


class LmdbTier(ChunkTier, Maintenance):
    """Chunk records in one LMDB environment (see the module docstring for threads and tables).

    Arguments (units in the names): ``capacity_bytes`` bounds stored record bytes (``None``: only
    the disk and ``max_map_size_bytes`` bound it); ``map_size_bytes`` is the initial map, grown by
    doubling up to ``max_map_size_bytes``; ``codec`` encodes records; ``read_workers`` threads read and
    encode; ``readonly`` opens for reading only (writes raise ``TierIOError``);
    ``verify_structure`` checks the whole LMDB file with py-lmdb's offline verifier before LMDB
    touches it, when no other process has it open (``CorruptCacheError`` if damaged).
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
        read_workers: int = 2,
        reader_check_interval_s: float = 30.0,
        access_flush_interval_s: float = 5.0,
        readonly: bool = False,
        max_quarantine_records: int = 64,
        max_raw_bytes: int = 1 << 31,
        verify_structure: bool = False,
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
        if not isinstance(max_quarantine_records, int) or max_quarantine_records < 0:
            raise ValueError(f"max_quarantine_records must be an int >= 0, got {max_quarantine_records!r}")

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
        self._counters: Dict[str, int] = {
            k: 0
            for k in (
                "puts",
                "put_batches",
                "put_commits",
                "raw_bytes_in",
                "stored_bytes_in",
                "compressed_records",
                "gets",
                "hits",
                "misses",
                "corrupt",
                "mismatched",
                "quarantined",
                "evictions",
                "deletes",
                "errors",
                "map_growths",
                "stale_readers_cleared",
            )
        }
        self._degraded = False
        # Owned by the writer thread once it starts: key -> stored bytes, oldest access first.
        self._lru: "OrderedDict[bytes, int]" = OrderedDict()
        self._total_bytes = 0
        self._accesses: Deque[Tuple[bytes, int]] = deque()
        self._removal_listeners: List[Callable[[List[bytes]], None]] = []
        self._io_hook: IOHook = NO_IO_HOOK

        before = DirectorySnapshot(path)
        self._path = ensure_private_dir(path, create=not self._readonly, files=("data.mdb", "lock.mdb"))
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
        # Read-only: no lock file is created (that would be a write); otherwise it is allocated
        # before LMDB maps it, so a full disk is TierFullError instead of SIGBUS.
        use_lock = lock_for_readonly(self._path) if self._readonly else True
        if use_lock and not self._readonly:
            prepare_lock_file(self._path)
        if self._verify_structure and not hasattr(self, "_env"):  # not on a reopen after MDB_PANIC
            verify_structure_at_rest(self._path, create_lock=not self._readonly)
        try:
            self._env = lmdb.open(
                str(self._path),
                subdir=True,
                map_size=map_size_bytes,
                max_dbs=4,
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
            self._tables = open_kvtier_tables(self._env, self._path, self._readonly)
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

    def _load_index(self) -> None:
        """Rebuild the LRU index: (last access, key, stored bytes), older first."""
        for attempt in range(3):
            try:
                with self._env.begin(buffers=True) as txn:
                    entries = index_entries(txn, self._tables)
                break
            except lmdb.MapResizedError:
                if attempt == 2:
                    raise
                self._env.set_mapsize(0)  # another process grew the map since we opened it
        entries.sort()
        self._lru = OrderedDict((key, size) for _, key, size in entries)
        self._total_bytes = sum(size for _, _, size in entries)

    # ---------------------------------------------------------------------------------- properties

    @property
    def path(self) -> Path:
        return self._path

    @property
    def degraded(self) -> bool:
        """True after a write failed underneath (disk full, I/O error) until a later write succeeds.
        Reads keep working while degraded."""
        return self._degraded

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capacity_bytes(self) -> Optional[int]:
        return self._capacity

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

    async def put_many(self, items: Sequence[PutItem]) -> None:
        """Encode (on the read pool) and store a batch in one transaction; durable when it returns.

        All or nothing. Raises ``TierFullError`` (batch larger than the capacity, disk full, map at
        its limit), ``TierIOError`` (LMDB failed; the tier is then ``degraded``), ``ClosedError``.
        Cancelling the await stops nothing: the raw buffers are still read until encoding is done
        and the batch may still land, so keep them unchanged (the slots pinned) until then.
        """
        self._check_usable(write=True)
        batch = []
        for key, meta, raw in items:
            if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= 511:
                raise ValueError(f"keys must be 1..511 bytes, got {key!r:.60}")
            batch.append((bytes(key), meta, raw))
        if not batch:
            return
        assert self._writer is not None  # not readonly, checked above
        loop = asyncio.get_running_loop()
        fut: "asyncio.Future[None]" = loop.create_future()
        done = loop_callback(loop, fut)
        writer = self._writer

        # Encoding (zstd of the byte planes) is CPU work that releases the GIL: a batch worth
        # splitting is cut into one contiguous slice per read worker, encoded in parallel, and the
        # last slice to finish hands the whole batch, in order, to the writer.
        raw_in = sum(memoryview(raw).nbytes for _, _, raw in batch)
        parts = min(self._read_workers, len(batch)) if raw_in >= _PARALLEL_ENCODE_BYTES else 1
        step = -(-len(batch) // parts)
        slices = [batch[i : i + step] for i in range(0, len(batch), step)]
        encoded_slices: List[Optional[List[Tuple[bytes, bytes]]]] = [None] * len(slices)
        failures: List[BaseException] = []
        join = threading.Lock()
        remaining = [len(slices)]

        def finish_slice(index: int, encoded: Optional[List[Tuple[bytes, bytes]]], exc: Optional[BaseException]) -> None:
            with join:
                encoded_slices[index] = encoded
                if exc is not None:
                    failures.append(exc)
                remaining[0] -= 1
                if remaining[0]:
                    return
            if failures:
                done(None, failures[0])
                return
            try:
                records = [item for part in encoded_slices for item in part]  # type: ignore[union-attr]
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

        def encode_slice(index: int, part: List[Tuple[bytes, ChunkMeta, object]]) -> None:
            try:
                encoded = [(key, encode_record(key, meta, raw, self._codec)) for key, meta, raw in part]
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting caller
                finish_slice(index, None, exc)
            else:
                finish_slice(index, encoded, None)

        for index, part in enumerate(slices):
            try:
                self._pool.submit(encode_slice, index, part)
            except RuntimeError as exc:
                closed = ClosedError(f"LmdbTier at {self._path} is closed")
                if index == 0:
                    raise closed from exc
                for rest in range(index, len(slices)):  # never started: they fail the batch
                    finish_slice(rest, None, closed)
                break
        await fut

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Decode each record straight into its buffer (read pool; the batch is split across
        ``read_workers`` read transactions). Per item the meta, or ``None``: absent, corrupt (counted,
        quarantined by the writer), or intact but of another size than the buffer (``mismatched``).

        Cancelling the await does not stop reads already running: they finish into the buffers, so
        keep the buffers reserved until the tier is done with them (``flush()`` after a cancel).
        """
        self._check_usable()
        items = [(bytes(k), v) for k, v in items]
        if not items:
            return []
        n = min(self._read_workers, len(items))
        step = -(-len(items) // n)
        slices = [items[i : i + step] for i in range(0, len(items), step)]
        parts = await asyncio.gather(*(self._in_pool(lambda s=s: self._read_slice(s)) for s in slices))
        return [meta for part in parts for meta in part]

    def _read_slice(self, items: List[GetItem]) -> List[Optional[ChunkMeta]]:
        corrupt: List[Tuple[bytes, int, str]] = []
        now = time.time_ns()

        def body(txn: lmdb.Transaction) -> List[Optional[ChunkMeta]]:
            results: List[Optional[ChunkMeta]] = []
            corrupt.clear()
            for key, buf in items:
                record = txn.get(key, db=self._tables.chunks)
                if record is None:
                    results.append(None)
                    continue
                try:
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
        hits = sum(1 for r in results if r is not None)
        self._count(gets=len(items), hits=hits, misses=len(items) - hits, corrupt=len(corrupt))
        if not self._readonly:
            for (key, _), meta in zip(items, results):
                if meta is not None:
                    self._accesses.append((key, now))
            if len(self._accesses) > _ACCESS_FLUSH_BACKLOG and self._writer is not None:
                try:
                    self._writer.submit(Job(self._flush_accesses, _log_failure))
                except ClosedError:
                    pass
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

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove records in one transaction; returns how many existed. Cancelling the await does
        not stop the transaction."""
        self._check_usable(write=True)
        keys = [bytes(k) for k in keys]
        if not keys:
            return 0
        assert self._writer is not None
        return await self._writer.submit_async(lambda: self._delete_keys(keys))

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Which keys have a record (one read transaction, no checksum). Cancelling drops the answer."""
        self._check_usable()
        keys = [bytes(k) for k in keys]
        if not keys:
            return []

        def body(txn: lmdb.Transaction) -> List[bool]:
            return [txn.get(k, db=self._tables.chunks) is not None for k in keys]

        return await self._in_pool(lambda: self._read_txn(body))

    async def list_keys(self) -> List[bytes]:
        """Every stored key, read from the ``atime`` side table (see ``tables.index_entries``: walking
        ``chunks`` would read every record from disk). Cancelling drops the answer."""
        self._check_usable()

        def body(txn: lmdb.Transaction) -> List[bytes]:
            return [key for _, key, _ in index_entries(txn, self._tables)]

        return await self._in_pool(lambda: self._read_txn(body))

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

    def subscribe_removals(self, callback: Callable[[List[bytes]], None]) -> None:
        """Call ``callback(keys)`` whenever the tier itself drops records (capacity eviction, ``gc``,
        quarantine), not for ``delete_many``. It runs on the writer thread, after the commit: hand
        the keys to your loop with ``call_soon_threadsafe`` and return quickly."""
        self._removal_listeners.append(callback)

    async def close(self) -> None:
        """Let running reads and queued writes finish, persist access times, close the environment.
        Safe to call twice. Runs on a worker thread; cancelling the await does not stop the close."""
        if os.getpid() != self._pid:
            raise ForkedProcessError(f"LmdbTier at {self._path} belongs to pid {self._pid}")
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        await asyncio.shield(loop.run_in_executor(None, self.close_sync))

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

    def statistics(self) -> Dict[str, float]:
        """Counters (floats): records, bytes, capacity_bytes (0: none), map_size_bytes, puts,
        put_batches, put_commits, raw_bytes_in, stored_bytes_in, compressed_records, gets, hits,
        misses, corrupt, mismatched, quarantined, evictions, deletes, errors, map_growths,
        stale_readers_cleared, degraded (1.0 / 0.0). Cheap; any thread of the opening process (it
        reads the environment's info, which a forked child must not touch)."""
        if os.getpid() != self._pid:
            raise ForkedProcessError(f"LmdbTier at {self._path} belongs to pid {self._pid}")
        with self._counters_lock:
            stats: Dict[str, float] = {k: float(v) for k, v in self._counters.items()}
        stats["records"] = float(len(self._lru))
        stats["bytes"] = float(self._total_bytes)
        stats["capacity_bytes"] = float(self._capacity or 0)
        try:
            stats["map_size_bytes"] = float(self._env.info()["map_size"]) if not self._closed else 0.0
        except lmdb.Error:
            stats["map_size_bytes"] = 0.0
        stats["degraded"] = 1.0 if self._degraded else 0.0
        return stats

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
        """Free reader slots of dead processes (False ends the timer: closing)."""
        try:
            with self._map_lock.shared():
                if self._closed:
                    return False
                cleared = self._env.reader_check()
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
