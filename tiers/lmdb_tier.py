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

A cache directory whose ``data.mdb`` is not an LMDB file, is truncated, or whose tables do not
parse raises ``CorruptCacheError`` at open (a truncated file would otherwise make LMDB touch pages
past the end of the file: SIGBUS). LMDB trusts its B-tree pages (no page checksums) and can crash
the process (SIGSEGV, SIGBUS, an assertion's abort) walking damaged ones, so with
``verify_structure=True`` the open first checks the whole file with py-lmdb's offline verifier
(``lmdb.verify``, pure Python, never hands the bytes to liblmdb; ~10,000 records per second), when
no other process has the environment open. ``quarantine_cache_dir`` renames a damaged directory
aside so a fresh one can be made (the engine does both by default). ``_io_hook`` (a ``tiers.base.IOHook``) is
called before every put, commit and read transaction: the fault suite makes it raise.

One writing process per directory: other processes may open the same directory (``readonly=True``
for pure readers) and LMDB keeps it consistent, but this process's LRU accounting only sees its own
writes. A forked child must open its own tier: every call from another pid raises
``ForkedProcessError``.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
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

from .base import NO_IO_HOOK, ChunkMeta, ChunkTier, GetItem, IOHook, PutItem
from .record import (
    CodecConfig,
    RecordHeader,
    RecordSizeMismatchError,
    decode_record,
    encode_record,
    read_header,
    validate_record,
)
from .safedir import ensure_private_dir
from .writer import Job, SharedExclusiveLock, WriterThread, loop_callback

__all__ = ["LmdbTier", "RecordInfo", "VerifyReport", "CorruptCacheError", "quarantine_cache_dir"]

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
# A put batch at least this large is encoded in parallel slices (one per read worker); below it the
# extra pool hop (~100 us) costs more than the second core saves.
_PARALLEL_ENCODE_BYTES = 1 << 20
# LMDB's on-disk meta pages (64-bit builds, LMDB 0.9): pages 0 and 1 each hold a 16-byte page header
# then MDB_meta: magic u32 | version u32 | address | mapsize | 2 x MDB_db (48 bytes; the first one's
# md_pad is the page size) | last_pg | txnid.
_MDB_MAGIC = 0xBEEFC0DE
_MDB_DATA_VERSION = 1
_META_MAGIC = struct.Struct("<II")  # at 16
_META_PSIZE = struct.Struct("<I")  # at 40
_META_TAIL = struct.Struct("<QQ")  # last_pg, txnid at 136
# LMDB errors that mean "these bytes are not a sound LMDB environment", as opposed to a busy lock,
# a permission or a full disk: they make the directory a candidate for quarantine.
_CORRUPT_LMDB_ERRORS = (
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.BadTxnError,
    lmdb.BadValsizeError,
    lmdb.BadDbiError,
    lmdb.IncompatibleError,
    lmdb.PanicError,
)


class CorruptCacheError(TierIOError):
    """The cache directory's LMDB environment is damaged (not an LMDB file, truncated, pages that do
    not parse). Nothing in it can be trusted; ``quarantine_cache_dir`` moves it aside."""


def _check_data_file(directory: Path) -> None:
    """Refuse a ``data.mdb`` that LMDB would map and then read past its end (SIGBUS): a file shorter
    than its meta pages or than the last page the newest meta page says is in use.

    The meta pages are read before the size, so a live writer in another process (which only grows
    the file, and writes the pages a meta page names before the meta page itself) is never taken for
    truncation. Anything that is not even an LMDB header is left to LMDB, which names it.
    """
    path = directory / "data.mdb"
    try:
        with open(path, "rb") as f:
            head = f.read(64 * 1024 + 160)
            size = os.fstat(f.fileno()).st_size
            if len(head) < 160:
                if size == 0:
                    return  # an empty file: LMDB initialises it as a new environment
                raise CorruptCacheError(f"{path} is truncated: {size} bytes, not even one meta page")
            magic, version = _META_MAGIC.unpack_from(head, 16)
            if magic != _MDB_MAGIC or version != _MDB_DATA_VERSION:
                return  # not an LMDB file at all, or another version: LMDB says which
            (psize,) = _META_PSIZE.unpack_from(head, 40)
            if psize < 512 or psize > 65536 or psize & (psize - 1):
                raise CorruptCacheError(f"{path} has a corrupt meta page (page size {psize})")
            f.seek(psize)
            meta1 = f.read(160)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TierIOError(f"cannot read {path}: {exc}") from exc
    metas = [head[:160]]
    if len(meta1) == 160:
        metas.append(meta1)
    newest: Optional[Tuple[int, int]] = None  # (txnid, last_pg)
    for meta in metas:
        magic, version = _META_MAGIC.unpack_from(meta, 16)
        if magic != _MDB_MAGIC or version != _MDB_DATA_VERSION:
            continue
        last_pg, txnid = _META_TAIL.unpack_from(meta, 136)
        if newest is None or txnid > newest[0]:
            newest = (txnid, last_pg)
    assert newest is not None  # meta page 0 passed the same check above
    needed = max(2, newest[1] + 1) * psize
    if size < needed:
        raise CorruptCacheError(
            f"{path} is truncated: {size} bytes, but its meta page uses {needed} "
            f"(last page {newest[1]}, page size {psize})"
        )


def _verify_structure_at_rest(directory: Path) -> None:
    """Check ``data.mdb`` with py-lmdb's offline verifier when no other process has the environment
    open; raise ``CorruptCacheError`` listing what it found.

    "No other process" is LMDB's own test: the exclusive lock on byte 0 of ``lock.mdb`` that every
    opener tries first. It is held while the verifier reads, so an opener elsewhere waits for it (as
    it would for any first opener). A live environment is not checked: another process may be
    writing it, and it is being served, so it cannot be damaged in a way LMDB has not met already.
    The caller must not have the environment open in this process (closing our descriptor drops
    every fcntl lock this process holds on the file): ``_OPEN_DIRS`` guarantees it for tiers.
    """
    data = directory / "data.mdb"
    if not data.exists():
        return
    try:
        from lmdb import verify as lmdb_verify
    except ImportError:  # py-lmdb before 3.0: no offline verifier
        log.debug("kvtier lmdb: lmdb.verify unavailable, %s opened unverified", directory)
        return
    fd = -1
    try:
        fd = os.open(directory / "lock.mdb", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
        except OSError:
            return  # open in another process: see the docstring
        try:
            problems = lmdb_verify.verify(str(directory))
        except lmdb_verify.VerifyError:
            return  # cannot even begin (not an LMDB file...): lmdb.open names it
        except (OSError, ValueError, struct.error, IndexError) as exc:
            problems = [f"the verifier stopped: {exc!r}"]
    except OSError as exc:
        log.debug("kvtier lmdb: cannot verify %s at rest (%s)", directory, exc)
        return
    finally:
        if fd >= 0:
            os.close(fd)
    if problems:
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CorruptCacheError(f"the LMDB file {data} is damaged: {shown}{more}")


def quarantine_cache_dir(path: PathLike) -> Path:
    """Rename a damaged cache directory aside, to ``<dir>.corrupt-<UTC time>-<pid>`` next to it, and
    return the new path. Blocking. The directory is kept (mode unchanged) for inspection; nothing in
    it is read again. Raises ``TierIOError`` when the rename fails."""
    src = Path(os.fspath(path)).expanduser().absolute()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dst = src.with_name(f"{src.name}.corrupt-{stamp}-{os.getpid()}")
    n = 0
    while dst.exists():
        n += 1
        dst = src.with_name(f"{src.name}.corrupt-{stamp}-{os.getpid()}-{n}")
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise TierIOError(f"cannot move the damaged cache directory {src} aside: {exc}") from exc
    log.error("kvtier lmdb: damaged cache directory %s moved aside to %s", src, dst)
    return dst

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
            except _CORRUPT_LMDB_ERRORS as exc:
                raise CorruptCacheError(f"the LMDB environment in {self._path} is damaged: {exc}") from exc
            except lmdb.Error as exc:
                raise TierIOError(f"cannot read the index of {self._path}: {exc}") from exc
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
        _check_data_file(self._path)
        if self._verify_structure and not hasattr(self, "_env"):  # not on a reopen after MDB_PANIC
            _verify_structure_at_rest(self._path)
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
        except _CORRUPT_LMDB_ERRORS as exc:
            raise CorruptCacheError(f"cannot open LMDB environment at {self._path}: {exc}") from exc
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
        except _CORRUPT_LMDB_ERRORS as exc:
            self._env.close()
            raise CorruptCacheError(f"the tables in {self._path} are damaged: {exc}") from exc
        except lmdb.Error as exc:
            self._env.close()
            raise TierIOError(f"cannot open tables in {self._path}: {exc}") from exc
        if version != FORMAT_VERSION:
            self._env.close()
            raise TierIOError(f"{self._path} has tier format {version!r}, this kvtier uses {FORMAT_VERSION!r}")

    def _load_index(self) -> None:
        """Rebuild the LRU index: (last access, key, stored bytes), older first."""
        with self._env.begin(buffers=True) as txn:
            entries = self._index_entries(txn)
        entries.sort()
        self._lru = OrderedDict((key, size) for _, key, size in entries)
        self._total_bytes = sum(size for _, _, size in entries)

    def _index_entries(self, txn: lmdb.Transaction) -> List[Tuple[int, bytes, int]]:
        """(last access ns, key, stored bytes) of every record, read from the small ``atime`` table.

        Every write keeps ``atime`` in step with ``chunks`` (same keys, the stored size in each
        value), and reading it touches only its own pages. A cursor over ``chunks`` would read the
        whole data file: py-lmdb touches every page of each value it steps over (keys-only
        iteration included), so opening a large cache would read all of it from disk and leave it in
        the page cache. Only when the two tables disagree in size (damage from outside) is
        ``chunks`` walked, the slow and sure way.
        """
        entries: List[Tuple[int, bytes, int]] = []
        times = txn.cursor(db=self._atime)
        for k, v in times.iternext(keys=True, values=True):
            if len(v) == _ATIME.size:
                atime, size = _ATIME.unpack(v)
                entries.append((atime, bytes(k), size))
        if len(entries) == txn.stat(self._chunks)["entries"]:
            return entries
        atimes = {key: atime for atime, key, _ in entries}
        return [
            (atimes.get(bytes(k), 0), bytes(k), len(v))
            for k, v in txn.cursor(db=self._chunks).iternext(keys=True, values=True)
        ]

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
                    _PutJob(
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
        """Every stored key, read from the ``atime`` side table (see ``_index_entries``: walking
        ``chunks`` would read every record from disk). Cancelling drops the answer."""
        self._check_usable()

        def body(txn: lmdb.Transaction) -> List[bytes]:
            return [key for _, key, _ in self._index_entries(txn)]

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

    # ------------------------------------------------------------------------ writer-thread work

    def _write(self, body: Callable[[lmdb.Transaction], Callable[[], T]], nbytes: int = 0) -> T:
        """Writer thread: run ``body`` in one write transaction and commit; ``body`` returns the
        in-memory update to apply once the commit succeeded. MapFullError -> grow and retry."""
        while True:
            try:
                with self._map_lock.shared():
                    with self._env.begin(write=True, buffers=True) as txn:
                        apply = body(txn)
                        self._io_hook.before("commit")  # raising here aborts the transaction
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
                self._io_hook.before("put")
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

    def _scan(self, visit: Callable[[lmdb.Transaction, bytes, memoryview], T]) -> Iterator[T]:
        """``visit(txn, key, value)`` for every record of ``chunks`` in cursor order, inside read
        transactions of ``_ITER_BATCH`` records each (so a long scan never pins old pages for long);
        yields the results. ``value`` is only valid inside ``visit``."""
        last: Optional[bytes] = None
        while True:

            def body(txn: lmdb.Transaction) -> Tuple[List[T], Optional[bytes]]:
                cur = txn.cursor(db=self._chunks)
                if last is None:
                    positioned = cur.first()
                else:
                    positioned = cur.set_range(last)
                    if positioned and bytes(cur.key()) == last:
                        positioned = cur.next()
                out: List[T] = []
                key: Optional[bytes] = None
                while positioned and len(out) < _ITER_BATCH:
                    key = bytes(cur.key())
                    out.append(visit(txn, key, cur.value()))
                    positioned = cur.next()
                return out, key

            batch, last = self._read_txn(body)
            yield from batch
            if len(batch) < _ITER_BATCH:
                return

    def iter_records(self) -> Iterator[RecordInfo]:
        """Every record with its parsed header (blocking; for ``kvtier inspect``). Reads in
        transactions of a few hundred records, so a long listing never pins old pages for long."""
        self._check_usable()

        def visit(txn: lmdb.Transaction, key: bytes, value: memoryview) -> RecordInfo:
            try:
                header: Optional[RecordHeader] = read_header(value)
                error = None
            except CorruptRecordError as exc:
                header, error = None, str(exc)
            at = txn.get(key, db=self._atime)
            atime = _ATIME.unpack(at)[0] if at is not None and len(at) == _ATIME.size else 0
            return RecordInfo(key, header, error, len(value), atime)

        yield from self._scan(visit)

    def verify(self, *, quarantine: bool = True) -> VerifyReport:
        """Decode every record fully (checksum, codec) in the transaction that lists it, and check
        that its key still finds it (a damaged B-tree page can list a record that no lookup
        reaches: a miss forever, reported as bad). Quarantine the corrupt ones unless told not to or
        read-only. Blocking; for ``kvtier verify`` and stress-test teardown."""
        self._check_usable()
        report = VerifyReport()
        scratch = bytearray(0)

        def visit(txn: lmdb.Transaction, key: bytes, value: memoryview) -> Tuple[bytes, int, str]:
            nonlocal scratch
            try:
                # The header's raw length sizes the scratch buffer only once the size cap and the
                # checksum passed: a lying header must not make us allocate what it claims.
                header = validate_record(key, value, max_raw_bytes=self._max_raw_bytes)
                if len(scratch) < header.raw_length:
                    scratch = bytearray(header.raw_length)
                decode_record(key, value, memoryview(scratch)[: header.raw_length], max_raw_bytes=self._max_raw_bytes)
            except CorruptRecordError as exc:
                return key, xxhash.xxh3_64_intdigest(value), str(exc)
            if txn.get(key, db=self._chunks) is None:
                return key, 0, "listed by the cursor but not found by its key (damaged B-tree page)"
            return key, 0, ""

        found: List[Tuple[bytes, int, str]] = []
        for key, digest, reason in self._scan(visit):
            report.checked += 1
            if reason:
                report.corrupt.append((key, reason))
                if digest:
                    found.append((key, digest, reason))  # quarantined by key: only reachable ones
            else:
                report.ok += 1

        # ``atime`` lists the stored keys (list_keys, the index at open): an entry whose key has no
        # record -- a key byte damaged in ``chunks`` -- is offered as a hit that always misses.
        def dangling(txn: lmdb.Transaction) -> List[bytes]:
            keys = (bytes(k) for k in txn.cursor(db=self._atime).iternext(keys=True, values=False))
            return [k for k in keys if txn.get(k, db=self._chunks) is None]

        orphans = self._read_txn(dangling)
        for key in orphans:
            report.checked += 1
            report.corrupt.append((key, "in the access-time table, but no record has this key (damaged table)"))
        self._count(corrupt=len(report.corrupt))
        if quarantine and self._writer is not None:
            if found:
                report.quarantined = self._writer.call(lambda: self._quarantine_entries(found))
            if orphans:
                report.quarantined += self._writer.call(lambda: self._drop_dangling_atime(orphans))
        return report

    def _drop_dangling_atime(self, keys: List[bytes]) -> int:
        """Writer thread: delete ``atime`` entries whose key still has no record."""

        def body(txn: lmdb.Transaction) -> Callable[[], int]:
            gone = [k for k in keys if txn.get(k, db=self._chunks) is None and txn.delete(k, db=self._atime)]

            def apply() -> int:
                for key in gone:
                    size = self._lru.pop(key, None)
                    if size is not None:
                        self._total_bytes -= size
                self._count(quarantined=len(gone))
                self._notify_removed(gone)
                return len(gone)

            return apply

        return self._write(body)

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
