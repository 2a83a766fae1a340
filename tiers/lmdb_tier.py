"""The LMDB disk tier: one LMDB environment per cache directory on local disk (NVMe).

Primitives and the threads they run on:

- ``LmdbTier`` — the ``ChunkTier`` facade. Its async methods are called on the event-loop thread and
  never block it: they hand work to threads and await one future per batch.
  ``await LmdbTier.open(path, ...)`` builds it on a worker thread; ``LmdbTier(path, ...)`` is the
  same, blocking (for tools and the sync helpers).
- the writer thread (``tiers.writer.WriterThread``, one per tier) owns every write transaction:
  each batch — begin, LRU eviction, puts, access-time updates, commit — is one closure; consecutive
  put batches are committed together (one fsync). It is also the only thread that grows the map
  (``MapFullError``: abort, ``set_mapsize`` x2 under the exclusive map lock, retry) and the only one
  that touches the in-memory LRU index.
- the read pool (``read_workers`` threads): encodes put batches (zstd, off the loop), runs read
  transactions, decodes records straight from ``txn.get(key)`` (``buffers=True``) into the caller's
  buffers while the transaction is open.
- the timer thread: ``env.reader_check()`` every ``reader_check_interval_s`` (and once at open), and
  asks the writer to persist access times every ``access_flush_interval_s``.
- sync helpers for tools (blocking, any thread but the writer): ``iter_records``, ``verify``, ``gc``,
  ``quarantined_keys``, ``close_sync``.

Named databases: ``chunks`` (key -> record, see ``tiers.record``), ``atime`` (key -> last access ns
u64 | stored bytes u64, the LRU side table, written in batches), ``quarantine`` (key -> the corrupt
record, at most ``max_quarantine_records`` kept, the rest deleted), ``meta`` (format version).

Capacity (``capacity_bytes``) counts stored record bytes (``statistics()['bytes']``); the data file
is larger by LMDB's page rounding and free pages. A record that fails its checksum on a read is a
miss: counted at once (``statistics()['corrupt']``) and moved to ``quarantine`` by the writer.

One writing process per directory: other processes may open the same directory (``readonly=True``
for pure readers) and LMDB keeps it consistent, but this process's LRU accounting only sees its own
writes. A forked child must open its own tier: every call from another pid raises
``ForkedProcessError``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import lmdb
import xxhash

from kvtier.policy.errors import (
    ClosedError,
    CorruptRecordError,
    ForkedProcessError,
    TierFullError,
    TierIOError,
)

from .base import ChunkMeta, ChunkTier, GetItem, PutItem
from .record import (
    CodecConfig,
    RecordHeader,
    RecordSizeMismatchError,
    decode_record,
    encode_record,
    read_header,
)
from .safedir import ensure_private_dir
from .writer import Job, SharedExclusiveLock, WriterThread, loop_callback

__all__ = ["LmdbTier", "RecordInfo", "VerifyReport"]

log = logging.getLogger(__name__)

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]

FORMAT_VERSION = b"1"
_DB_CHUNKS = b"chunks"
_DB_ATIME = b"atime"
_DB_QUARANTINE = b"quarantine"
_DB_META = b"meta"
_ATIME = struct.Struct("<QQ")  # last access (time_ns), stored record bytes
_MIN_MAP_SIZE = 1 << 20
_ITER_BATCH = 256
# Recorded reads waiting for the writer; past this many a flush is queued at once (bounds memory).
_ACCESS_FLUSH_BACKLOG = 1 << 16

# Process-wide: LMDB forbids opening one environment twice in a process (closing either would drop
# the other's locks). Keyed by (st_dev, st_ino) of the directory; the pid guards against a fork
# inheriting the parent's entries.
_OPEN_DIRS: Dict[Tuple[int, int], int] = {}
_OPEN_DIRS_LOCK = threading.Lock()


@dataclass
class _PutJob(Job):
    """An encoded put batch; consecutive ones are committed together by ``_run_put_group``."""

    encoded: List[Tuple[bytes, bytes]] = field(default_factory=list)
    raw_in: int = 0


@dataclass(frozen=True)
class RecordInfo:
    """One stored record as ``iter_records`` sees it: header (``None`` when it does not parse, then
    ``error`` says why), stored bytes, last access in ns since the epoch (0 if never recorded)."""

    key: bytes
    header: Optional[RecordHeader]
    error: Optional[str]
    stored_bytes: int
    atime_ns: int


@dataclass
class VerifyReport:
    """What ``verify`` found: records checked, records intact, and (key, reason) of each corrupt one."""

    checked: int = 0
    ok: int = 0
    corrupt: List[Tuple[bytes, str]] = field(default_factory=list)
    quarantined: int = 0


class LmdbTier(ChunkTier):
    """Chunk records in one LMDB environment (see the module docstring for threads and tables).

    Arguments (units in the names): ``capacity_bytes`` bounds stored record bytes (``None``: only
    the disk and ``max_map_size_bytes`` bound it); ``map_size_bytes`` is the initial map, grown by
    doubling up to ``max_map_size_bytes``; ``codec`` encodes records; ``read_workers`` threads read and
    encode; ``readonly`` opens for reading only (writes raise ``TierIOError``).
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
            cleared = self._env.reader_check()
            self._counters["stale_readers_cleared"] += cleared
            self._load_index()
        except BaseException:
            with _OPEN_DIRS_LOCK:
                _OPEN_DIRS.pop(self._dir_id, None)
            env = getattr(self, "_env", None)
            if env is not None:
                env.close()
            raise

        self._pool = ThreadPoolExecutor(max_workers=read_workers, thread_name_prefix="kvtier-lmdb-read")
        self._read_workers = read_workers
        self._writer: Optional[WriterThread] = None
        if not self._readonly:
            self._writer = WriterThread(f"kvtier-lmdb-writer:{self._path.name}")
        self._timer_stop = threading.Event()
        self._timer = threading.Thread(target=self._timer_main, name="kvtier-lmdb-timer", daemon=True)
        self._timer.start()

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
        try:
            self._env = lmdb.open(
                str(self._path),
                subdir=True,
                map_size=map_size_bytes,
                max_dbs=4,
                sync=True,
                metasync=False,
                writemap=False,
                readahead=True,
                readonly=self._readonly,
                create=not self._readonly,
                mode=0o600,
                lock=True,
            )
        except lmdb.Error as exc:
            raise TierIOError(f"cannot open LMDB environment at {self._path}: {exc}") from exc
        try:
            if self._readonly:
                # py-lmdb opens each handle in its own read transaction and keeps it (a handle
                # opened in a caller's read transaction dies with it).
                self._chunks = self._env.open_db(_DB_CHUNKS, create=False)
                self._atime = self._env.open_db(_DB_ATIME, create=False)
                self._quarantine = self._env.open_db(_DB_QUARANTINE, create=False)
                self._meta = self._env.open_db(_DB_META, create=False)
                with self._env.begin() as txn:
                    version = txn.get(b"format", db=self._meta)
            else:
                with self._env.begin(write=True) as txn:
                    self._chunks = self._env.open_db(_DB_CHUNKS, txn=txn)
                    self._atime = self._env.open_db(_DB_ATIME, txn=txn)
                    self._quarantine = self._env.open_db(_DB_QUARANTINE, txn=txn)
                    self._meta = self._env.open_db(_DB_META, txn=txn)
                    version = txn.get(b"format", db=self._meta)
                    if version is None:
                        txn.put(b"format", FORMAT_VERSION, db=self._meta)
                        version = FORMAT_VERSION
        except lmdb.NotFoundError as exc:
            self._env.close()
            raise TierIOError(f"{self._path} holds no kvtier LMDB tables (read-only open)") from exc
        except lmdb.Error as exc:
            self._env.close()
            raise TierIOError(f"cannot open tables in {self._path}: {exc}") from exc
        if version != FORMAT_VERSION:
            self._env.close()
            raise TierIOError(f"{self._path} has tier format {version!r}, this kvtier uses {FORMAT_VERSION!r}")

    def _load_index(self) -> None:
        """Rebuild the LRU index: sizes from ``chunks``, order from ``atime`` (older first)."""
        entries: List[Tuple[int, bytes, int]] = []
        with self._env.begin(buffers=True) as txn:
            times = txn.cursor(db=self._atime)
            atimes: Dict[bytes, int] = {}
            for k, v in times.iternext(keys=True, values=True):
                if len(v) == _ATIME.size:
                    atimes[bytes(k)] = _ATIME.unpack(v)[0]
            cur = txn.cursor(db=self._chunks)
            for k, v in cur.iternext(keys=True, values=True):
                key = bytes(k)
                entries.append((atimes.get(key, 0), key, len(v)))
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
                        return body(txn)
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size (no transaction may be open here).
                with self._map_lock.exclusive():
                    self._env.set_mapsize(0)
            except lmdb.Error as exc:
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

        def encode_and_submit() -> None:
            try:
                encoded = [(key, encode_record(key, meta, raw, self._codec)) for key, meta, raw in batch]
                raw_in = sum(memoryview(raw).nbytes for _, _, raw in batch)
                writer.submit(
                    _PutJob(
                        fn=lambda: self._put_encoded(encoded, raw_in),
                        done=done,
                        group=self._run_put_group,
                        weight=sum(len(r) for _, r in encoded),
                        encoded=encoded,
                        raw_in=raw_in,
                    )
                )
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting caller
                done(None, exc)

        try:
            self._pool.submit(encode_and_submit)
        except RuntimeError as exc:
            raise ClosedError(f"LmdbTier at {self._path} is closed") from exc
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
                record = txn.get(key, db=self._chunks)
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
            return [txn.get(k, db=self._chunks) is not None for k in keys]

        return await self._in_pool(lambda: self._read_txn(body))

    async def list_keys(self) -> List[bytes]:
        """Every stored key, from a cursor over keys only. Cancelling drops the answer."""
        self._check_usable()

        def body(txn: lmdb.Transaction) -> List[bytes]:
            cur = txn.cursor(db=self._chunks)
            return [bytes(k) for k in cur.iternext(keys=True, values=False)]

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
        self._timer_stop.set()
        self._timer.join()
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
        stale_readers_cleared, degraded (1.0 / 0.0). Cheap; any thread."""
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

    # ------------------------------------------------------------------------ writer-thread work

    def _write(self, body: Callable[[lmdb.Transaction], Callable[[], T]], nbytes: int = 0) -> T:
        """Writer thread: run ``body`` in one write transaction and commit; ``body`` returns the
        in-memory update to apply once the commit succeeded. MapFullError -> grow and retry."""
        while True:
            try:
                with self._map_lock.shared():
                    with self._env.begin(write=True, buffers=True) as txn:
                        apply = body(txn)
            except lmdb.MapFullError as exc:
                self._grow_map(nbytes, exc)
                continue
            except lmdb.MapResizedError:
                with self._map_lock.exclusive():
                    self._env.set_mapsize(0)
                continue
            except lmdb.Error as exc:
                raise self._write_failed(exc, nbytes) from exc
            self._degraded = False
            return apply()

    def _grow_map(self, nbytes: int, cause: BaseException) -> None:
        current = self._env.info()["map_size"]
        if current >= self._max_map_size:
            self._degraded = True
            self._count(errors=1)
            raise TierFullError(
                f"LMDB map of {self._path} is at max_map_size_bytes={self._max_map_size}"
            ) from cause
        new = min(self._max_map_size, max(current * 2, current + 2 * nbytes))
        with self._map_lock.exclusive():
            self._env.set_mapsize(new)
        self._count(map_growths=1)
        log.info("kvtier lmdb: map of %s grown from %d to %d bytes", self._path, current, new)

    def _write_failed(self, exc: lmdb.Error, nbytes: int) -> TierIOError:
        self._degraded = True
        self._count(errors=1)
        full = "No space" in str(exc) or getattr(exc, "errno", None) == errno.ENOSPC
        if not full:
            # LMDB reports a short write on a full disk as EIO; look at the filesystem.
            try:
                st = os.statvfs(self._path)
                full = st.f_bavail * st.f_frsize < nbytes + (1 << 20)
            except OSError:
                pass
        if isinstance(exc, lmdb.PanicError):
            self._reopen_env()
        if full:
            return TierFullError(f"disk full under {self._path}: {exc}")
        return TierIOError(f"LMDB write failed in {self._path}: {exc}")

    def _reopen_env(self) -> None:
        """After MDB_PANIC the environment must be reopened (writer thread, exclusive lock)."""
        with self._map_lock.exclusive():
            size = self._env.info()["map_size"]
            self._env.close()
            self._open_env(size)

    def _take_accesses(self) -> List[Tuple[bytes, int]]:
        """Writer thread: drain recorded reads and move those keys to the young end of the LRU."""
        taken: Dict[bytes, int] = {}
        while True:
            try:
                key, t = self._accesses.popleft()
            except IndexError:
                break
            taken[key] = t
        out = []
        for key, t in taken.items():
            if key in self._lru:
                self._lru.move_to_end(key)
                out.append((key, t))
        return out

    def _put_access_times(self, txn: lmdb.Transaction, accesses: List[Tuple[bytes, int]], skip: object) -> None:
        for key, t in accesses:
            size = self._lru.get(key)
            if size is not None and key not in skip:  # type: ignore[operator]
                txn.put(key, _ATIME.pack(t, size), db=self._atime)

    def _flush_accesses(self) -> None:
        accesses = self._take_accesses()
        if not accesses:
            return

        def body(txn: lmdb.Transaction) -> Callable[[], None]:
            self._put_access_times(txn, accesses, ())
            return lambda: None

        self._write(body)

    def _run_put_group(self, jobs: List["_PutJob"]) -> None:
        """Writer thread: commit consecutive put batches in one transaction; if that fails, run each
        alone so every caller gets its own outcome."""
        if len(jobs) > 1:
            encoded = [item for j in jobs for item in j.encoded]
            raw_in = sum(j.raw_in for j in jobs)
            try:
                self._put_encoded(encoded, raw_in, batches=len(jobs))
            except Exception:
                pass  # fall through: each batch alone decides its own fate
            else:
                for j in jobs:
                    j.done(None, None)
                return
        for j in jobs:
            j.run()

    def _put_encoded(self, encoded: List[Tuple[bytes, bytes]], raw_in: int, batches: int = 1) -> None:
        batch: Dict[bytes, bytes] = {}
        for key, record in encoded:
            batch[key] = record  # the later write of a key wins, as sequential puts would
        batch_bytes = sum(len(r) for r in batch.values())
        cap = self._capacity
        if cap is not None and batch_bytes > cap:
            raise TierFullError(f"a batch of {batch_bytes} bytes exceeds capacity_bytes={cap}")
        accesses = self._take_accesses()
        victims: List[bytes] = []
        if cap is not None:
            projected = self._total_bytes + batch_bytes - sum(self._lru.get(k, 0) for k in batch)
            if projected > cap:
                for key, size in self._lru.items():  # oldest access first
                    if key in batch:
                        continue
                    victims.append(key)
                    projected -= size
                    if projected <= cap:
                        break
        victim_set = set(victims)

        def body(txn: lmdb.Transaction) -> Callable[[], None]:
            self._put_access_times(txn, accesses, victim_set)
            for key in victims:
                txn.delete(key, db=self._chunks)
                txn.delete(key, db=self._atime)
            now = time.time_ns()
            for key, record in batch.items():
                txn.put(key, record, db=self._chunks)
                txn.put(key, _ATIME.pack(now, len(record)), db=self._atime)

            def apply() -> None:
                for key in victims:
                    self._total_bytes -= self._lru.pop(key)
                for key, record in batch.items():
                    old = self._lru.pop(key, None)
                    if old is not None:
                        self._total_bytes -= old
                    self._lru[key] = len(record)
                    self._total_bytes += len(record)
                compressed = sum(1 for r in batch.values() if read_header(r).codec != "raw")
                self._count(
                    puts=len(encoded),
                    put_batches=batches,
                    put_commits=1,
                    raw_bytes_in=raw_in,
                    stored_bytes_in=batch_bytes,
                    compressed_records=compressed,
                    evictions=len(victims),
                )
                self._notify_removed(victims)

            return apply

        self._write(body, batch_bytes)

    def _delete_keys(self, keys: List[bytes]) -> int:
        accesses = self._take_accesses()
        gone = set(keys)

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            self._put_access_times(txn, accesses, gone)
            existed = [k for k in dict.fromkeys(keys) if txn.delete(k, db=self._chunks)]
            for k in existed:
                txn.delete(k, db=self._atime)

            def apply() -> int:
                for k in existed:
                    size = self._lru.pop(k, None)
                    if size is not None:
                        self._total_bytes -= size
                self._count(deletes=len(existed))
                return len(existed)

            return apply

        return self._write(body)

    def _quarantine_entries(self, entries: List[Tuple[bytes, int, str]]) -> int:
        """Writer thread: move records found corrupt to ``quarantine`` (or delete them once it holds
        ``max_quarantine_records``), unless the key was rewritten since (its bytes changed)."""

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            room = self._max_quarantine - txn.stat(self._quarantine)["entries"]
            moved: List[bytes] = []
            for key, digest, _reason in entries:
                current = txn.get(key, db=self._chunks)
                if current is None or xxhash.xxh3_64_intdigest(current) != digest:
                    continue
                if room > 0:
                    txn.put(key, bytes(current), db=self._quarantine)
                    room -= 1
                txn.delete(key, db=self._chunks)
                txn.delete(key, db=self._atime)
                moved.append(key)

            def apply() -> int:
                for key in moved:
                    size = self._lru.pop(key, None)
                    if size is not None:
                        self._total_bytes -= size
                self._count(quarantined=len(moved))
                self._notify_removed(moved)
                return len(moved)

            return apply

        return self._write(body)

    def _evict_to(self, max_bytes: int) -> int:
        accesses = self._take_accesses()
        victims: List[bytes] = []
        total = self._total_bytes
        for key, size in self._lru.items():
            if total <= max_bytes:
                break
            victims.append(key)
            total -= size
        victim_set = set(victims)

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            self._put_access_times(txn, accesses, victim_set)
            for key in victims:
                txn.delete(key, db=self._chunks)
                txn.delete(key, db=self._atime)

            def apply() -> int:
                for key in victims:
                    self._total_bytes -= self._lru.pop(key)
                self._count(evictions=len(victims))
                self._notify_removed(victims)
                return len(victims)

            return apply

        return self._write(body)

    def _notify_removed(self, keys: List[bytes]) -> None:
        if not keys:
            return
        for listener in list(self._removal_listeners):
            try:
                listener(list(keys))
            except Exception:
                log.exception("kvtier lmdb: removal listener failed")

    def _check_index(self) -> List[str]:
        """Writer thread (or any thread when read-only): compare the LRU index with the tables."""

        def body(txn: lmdb.Transaction) -> Tuple[Dict[bytes, int], set]:
            sizes = {bytes(k): len(v) for k, v in txn.cursor(db=self._chunks).iternext(keys=True, values=True)}
            times = {bytes(k) for k in txn.cursor(db=self._atime).iternext(keys=True, values=False)}
            return sizes, times

        sizes, times = self._read_txn(body)
        problems: List[str] = []
        for key, size in self._lru.items():
            if key not in sizes:
                problems.append(f"indexed but not stored: {key.hex()}")
            elif sizes[key] != size:
                problems.append(f"size differs for {key.hex()}: index {size}, stored {sizes[key]}")
        for key in sizes.keys() - self._lru.keys():
            problems.append(f"stored but not indexed: {key.hex()}")
        for key in times - sizes.keys():
            problems.append(f"access time without a record: {key.hex()}")
        if self._total_bytes != sum(self._lru.values()):
            problems.append("byte count out of step with the index")
        if self._capacity is not None and self._total_bytes > self._capacity:
            problems.append(f"over capacity: {self._total_bytes} > {self._capacity}")
        return problems

    # --------------------------------------------------------------------------------- timer thread

    def _timer_main(self) -> None:
        tick = min(self._reader_check_interval, self._access_flush_interval)
        next_check = time.monotonic() + self._reader_check_interval
        while not self._timer_stop.wait(tick):
            if self._accesses and self._writer is not None:
                try:
                    self._writer.submit(Job(self._flush_accesses, _log_failure))
                except ClosedError:
                    return
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self._reader_check_interval
                try:
                    with self._map_lock.shared():
                        if self._closed:
                            return
                        cleared = self._env.reader_check()
                    if cleared:
                        log.warning("kvtier lmdb: cleared %d stale readers in %s", cleared, self._path)
                        self._count(stale_readers_cleared=cleared)
                except lmdb.Error:
                    log.exception("kvtier lmdb: reader_check failed")

    # ------------------------------------------------------------------------ sync tool helpers

    def iter_records(self) -> Iterator[RecordInfo]:
        """Every record with its parsed header (blocking; for ``kvtier inspect``). Reads in
        transactions of a few hundred records, so a long listing never pins old pages for long."""
        self._check_usable()
        last: Optional[bytes] = None
        while True:

            def body(txn: lmdb.Transaction) -> List[RecordInfo]:
                cur = txn.cursor(db=self._chunks)
                if last is None:
                    positioned = cur.first()
                else:
                    positioned = cur.set_range(last)
                    if positioned and bytes(cur.key()) == last:
                        positioned = cur.next()
                out: List[RecordInfo] = []
                while positioned and len(out) < _ITER_BATCH:
                    key = bytes(cur.key())
                    value = cur.value()
                    try:
                        header: Optional[RecordHeader] = read_header(value)
                        error = None
                    except CorruptRecordError as exc:
                        header, error = None, str(exc)
                    at = txn.get(key, db=self._atime)
                    atime = _ATIME.unpack(at)[0] if at is not None and len(at) == _ATIME.size else 0
                    out.append(RecordInfo(key, header, error, len(value), atime))
                    positioned = cur.next()
                return out

            batch = self._read_txn(body)
            yield from batch
            if len(batch) < _ITER_BATCH:
                return
            last = batch[-1].key

    def verify(self, *, quarantine: bool = True) -> VerifyReport:
        """Decode every record fully (checksum, codec); quarantine the corrupt ones unless told not
        to or read-only. Blocking; for ``kvtier verify`` and stress-test teardown."""
        self._check_usable()
        report = VerifyReport()
        scratch = bytearray(0)
        found: List[Tuple[bytes, int, str]] = []
        for info in self.iter_records():
            report.checked += 1
            if info.header is not None and len(scratch) < info.header.raw_length:
                scratch = bytearray(info.header.raw_length)

            def body(txn: lmdb.Transaction) -> Optional[Tuple[int, str]]:
                record = txn.get(info.key, db=self._chunks)
                if record is None:
                    return None  # deleted meanwhile
                try:
                    n = info.header.raw_length if info.header is not None else 0
                    decode_record(info.key, record, memoryview(scratch)[:n], max_raw_bytes=self._max_raw_bytes)
                except CorruptRecordError as exc:
                    return xxhash.xxh3_64_intdigest(record), str(exc)
                return (0, "")

            outcome = self._read_txn(body)
            if outcome is None:
                continue
            digest, reason = outcome
            if reason:
                report.corrupt.append((info.key, reason))
                found.append((info.key, digest, reason))
            else:
                report.ok += 1
        self._count(corrupt=len(found))
        if found and quarantine and self._writer is not None:
            report.quarantined = self._writer.call(lambda: self._quarantine_entries(found))
        return report

    def gc(self, max_bytes: int) -> int:
        """Evict least-recently-used records until stored bytes <= ``max_bytes``; returns how many
        were evicted. Blocking (runs on the writer thread)."""
        self._check_usable(write=True)
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        assert self._writer is not None
        return self._writer.call(lambda: self._evict_to(max_bytes))

    def corrupt_record_for_tests(self, key: bytes, *, offset_from_end: int = 1) -> None:
        """Fault injection: flip one byte of the stored record ``key`` (``offset_from_end`` bytes
        from its end, i.e. in the payload) in a write transaction of its own. Blocking."""
        self._check_usable(write=True)
        assert self._writer is not None
        key = bytes(key)

        def body(txn: lmdb.Transaction) -> Callable[[], None]:
            value = txn.get(key, db=self._chunks)
            if value is None:
                raise KeyError(key.hex())
            data = bytearray(value)
            if not 1 <= offset_from_end <= len(data):
                raise ValueError(f"offset_from_end must be in 1..{len(data)}")
            data[-offset_from_end] ^= 0xFF
            txn.put(key, bytes(data), db=self._chunks)
            return lambda: None

        self._writer.call(lambda: self._write(body))

    def quarantined_keys(self) -> List[bytes]:
        """Keys held in the quarantine table (blocking)."""
        self._check_usable()

        def body(txn: lmdb.Transaction) -> List[bytes]:
            cur = txn.cursor(db=self._quarantine)
            return [bytes(k) for k in cur.iternext(keys=True, values=False)]

        return self._read_txn(body)


def _log_failure(result: object, exc: Optional[BaseException]) -> None:
    if exc is not None:
        log.warning("kvtier lmdb: background write failed: %s", exc)


def _close_orphan(cf: "asyncio.Future[LmdbTier]") -> None:
    if not cf.cancelled() and cf.exception() is None:
        threading.Thread(target=cf.result().close_sync, daemon=True).start()
