"""``FileTier``: one file per chunk, for shared filesystems (NFS, Lustre) where LMDB must not go.

Primitives, and the thread each runs on:

- ``FileTier.open`` (classmethod, event loop): checks or creates the root directory (0700), then
  scans the tree on the tier's I/O pool (one hop) to rebuild the index and remove stale temp files.
- ``FileTier`` (this module): the facade, the read path and quarantine. ``put_many`` /
  ``get_many_into`` / ``delete_many`` / ``contains_many`` / ``list_keys`` / ``check`` / ``close``
  (async, event loop) and ``statistics`` / ``path_for`` (sync, event loop).
- ``index.FileIndex``: the index (key -> size, in LRU order), the sequence, the keys being written
  and every counter, touched only on the event-loop thread, so they need no lock.
- ``writes.FileWrites``: the write path (event loop; its blocking calls through ``FileOps``).
- ``ops.FileOps``: the tier's own ``ThreadPoolExecutor`` (``kvtier-files-*``, ``io_threads``
  workers) and every blocking call on it: the aiofiles file operations (open, write, flush, read,
  close, replace, remove: aiofiles is handed this executor), ``os.fsync`` of files and
  directories, ``mkdir``, the scan at open, and the record codec (``encode_record``/
  ``decode_record``; zstd and the checksums release the GIL). The codec runs one hop per slice of
  a batch (``tiers.codec_pool``: at most one slice per thread, at least 1 MiB each), never one hop
  per small chunk. A get batch under 256 KiB in all decodes on the loop, where the hop would cost
  more than the decode.

On-disk layout: see ``layout``; the scan at open and in ``check``: see ``scan``.

A write goes to a temp file in the record's own directory (``O_EXCL``, mode 0600), is flushed and
``fsync``-ed, then ``os.replace``-d over the final name; the leaf directory is ``fsync``-ed after
the renames so the new names survive a power cut (a completed ``put_many`` is durable), and a newly
created directory is ``fsync``-ed into its parent once. A reader therefore sees the old record, the
new one, or none, never a partial file.

Fault injection: ``_io_hook`` (a ``tiers.base.IOHook``, ``FileOps.io_hook``) is called right before every mkdir, open,
write, fsync, rename, directory fsync, read and remove the tier does after ``open``; the fault
suite makes it raise ``OSError`` as the real call would.

Sharing a root between processes: each process keeps its own index, built at open. Records another
process writes later are not seen until the next open, and capacity is enforced per process. Temp
files are removed at open only when their writer is provably gone (same host, dead pid) or they are
older than ``stale_temp_s``, so opening a root never breaks another live writer's rename.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from kvtier.errors import ClosedError, CorruptRecordError

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
from ..lru import ByteLru
from ..owned_tasks import OwnedTasks, wait_through_cancel
from ..quarantine import DEFAULT_MAX_QUARANTINE_RECORDS, QuarantineRoom, check_max_quarantine_records
from ..record_format import (
    CodecConfig,
    RecordMetaMismatchError,
    RecordSizeMismatchError,
    decode_record,
)
from .index import FileIndex
from .layout import QUARANTINE_DIR, quarantine_name
from .ops import FileOps
from .scan import scan_tree
from .writes import FileWrites, map_os_error

__all__ = ["FileTier"]

# A record is its header plus a payload never larger than the raw bytes (the codec keeps the
# compressed form only when it is smaller), so a read is capped at raw size + this much; a file that
# grew beyond that cannot be a valid record for the buffer and must not make us allocate its size.
_MAX_RECORD_OVERHEAD = 1 << 20

_OPEN_TOKEN = object()


class _Mismatch:
    """An intact record that does not fit the request (buffer size): a miss, but not corruption,
    so the record stays in place for callers that ask correctly."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _decode_slice(
    items: Sequence[Tuple[bytes, bytes, memoryview]],
) -> List[Union[ChunkMeta, CorruptRecordError, _Mismatch]]:
    """Runs on an I/O thread (or on the loop for small batches). Decodes into the callers' buffers;
    the data is already in memory and the output is the caller's, so nothing here allocates the
    chunk's size and no ``max_raw_bytes`` cap is needed."""
    out: List[Union[ChunkMeta, CorruptRecordError, _Mismatch]] = []
    for key, data, buf in items:
        try:
            meta, _ = decode_record(key, data, buf)
        except (RecordSizeMismatchError, RecordMetaMismatchError) as exc:
            out.append(_Mismatch(str(exc)))
            continue
        except CorruptRecordError as exc:
            out.append(exc)
            continue
        out.append(meta)
    return out


class FileTier(ChunkTier):
    """Chunk records as files under ``root``; see the module docstring for layout and threads.

    Build with ``await FileTier.open(root, capacity_bytes=..., codec=...)``; use from one event loop.
    ``capacity_bytes`` bounds the sum of record file sizes (encoded bytes); ``None`` means only the
    filesystem bounds it. Least-recently-read records are evicted before a batch would exceed it.
    """

    name = "files"

    def __init__(
        self,
        root: Path,
        capacity_bytes: Optional[int],
        codec: CodecConfig,
        io_threads: int,
        _token: object = None,
        *,
        max_quarantine_records: int = DEFAULT_MAX_QUARANTINE_RECORDS,
    ) -> None:
        if _token is not _OPEN_TOKEN:
            # An unscanned tier would serve an empty index over a full directory.
            raise TypeError("use 'await FileTier.open(root, ...)'")
        self._root = root
        self._capacity = capacity_bytes
        self._loop = asyncio.get_running_loop()
        self._removals = RemovalFeed()
        self._index = FileIndex(capacity_bytes, self._removals)
        self._files = FileOps(root, io_threads)
        self._writes = FileWrites(self._index, self._files, codec)
        self._tasks = OwnedTasks()
        self._in_flight = 0  # public calls in flight (close waits for them)
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._quarantine_room = QuarantineRoom(max_quarantine_records, 0)

    @classmethod
    async def open(
        cls,
        root: Union[str, "os.PathLike[str]"],
        capacity_bytes: Optional[int] = None,
        codec: Optional[CodecConfig] = None,
        *,
        io_threads: int = 8,
        stale_temp_s: float = 600.0,
        max_quarantine_records: int = DEFAULT_MAX_QUARANTINE_RECORDS,
    ) -> "FileTier":
        """Open (creating it 0700 if absent) the tier at ``root`` and rebuild its index by scanning.

        Raises ``UnsafeDirectoryError`` for a root that is world-writable or owned by another uid,
        ``TierIOError`` when the scan fails. ``io_threads`` is the size of the tier's own pool (the
        disk wants several I/Os in flight); ``stale_temp_s`` is the age beyond which a temp file
        of an unknown writer counts as abandoned; ``max_quarantine_records`` caps the corrupt
        records kept under ``quarantine/`` (``tiers.quarantine``). If ``capacity_bytes`` is below what the root
        already holds, the least recently used records are evicted now.

        Cancelling it: the scan thread runs to its end (it may already have removed stale temps);
        no tier is returned and its thread pool is shut down.
        """
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
                raise TypeError(f"capacity_bytes must be an int or None, not {capacity_bytes!r}")
            if capacity_bytes <= 0:
                raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if stale_temp_s < 0:
            raise ValueError(f"stale_temp_s must be >= 0, got {stale_temp_s}")
        check_max_quarantine_records(max_quarantine_records)
        self = cls(
            Path(os.fspath(root)).absolute(),
            capacity_bytes,
            codec if codec is not None else CodecConfig(),
            io_threads,
            _OPEN_TOKEN,
            max_quarantine_records=max_quarantine_records,
        )
        try:
            try:
                scan = await self._loop.run_in_executor(
                    self._files.pool, scan_tree, self._root, stale_temp_s, True
                )
            except OSError as exc:
                raise map_os_error(exc, f"opening {self._root}") from exc
            self._files.dirs = scan.dirs
            self._quarantine_room.held = scan.quarantined_files
            self._index.stats["temps_removed"] = scan.temps_removed
            lru = self._index.lru = ByteLru((key, size) for key, size, _ in scan.entries)
            if self._capacity is not None and lru.total_bytes > self._capacity:
                victims = self._index.pick_victims(lru.total_bytes - self._capacity)
                await self._writes.remove_files(victims)
        except BaseException:
            self._closed = True
            self._files.pool.shutdown(wait=False)
            raise
        return self

    # ----------------------------------------------------------------------------- public, sync

    @property
    def root(self) -> Path:
        return self._root

    # The last mutation of this instance (a put landing, a removal); whether a write failed
    # underneath since the last that succeeded; the fault-injection point of every file operation.
    sequence: Forwarded[int] = Forwarded("_index", "sequence")
    degraded: Forwarded[bool] = Forwarded("_index", "degraded")
    _io_hook: Forwarded[IOHook] = Forwarded("_files", "io_hook", settable=True)

    def path_for(self, key: bytes) -> Path:
        """Where ``key``'s record lives (whether or not it exists)."""
        return self._files.path_for(key)

    def statistics(self) -> TierStatistics:
        """The shared counters (``TierStatistics``; ``errors`` counts failed batches and failed
        per-file operations) and, in ``extra``: ``temps_removed`` (at open) and
        ``quarantine_held`` (records kept under ``quarantine/``, from every process)."""
        return TierStatistics.from_counters(
            self._index.stats, self._index.lru, capacity_bytes=self._capacity, degraded=self._index.degraded,
            quarantine_held=float(self._quarantine_room.held),
        )

    def subscribe_removals(self, callback: RemovalCallback) -> None:
        """Report every record this instance stops serving -- capacity eviction, quarantine,
        ``delete_many``, a failed put that had replaced it, a file found gone on a read
        (``"external"``) -- as ``Removal`` records, on the loop running now (``ChunkTier`` rules).
        Records other processes remove are found only when read or at the next open."""
        self._removals.subscribe(callback)

    async def snapshot_keys(self) -> KeySnapshot:
        """Every indexed key and this instance's sequence, atomically (the index lives on the loop).
        Cancelling it: no effect."""
        self._check_open()
        return KeySnapshot(frozenset(self._index.lru), self._index.sequence)

    # ---------------------------------------------------------------------------- public, async

    async def put_many(self, items: Sequence[PutItem]) -> int:
        """Encode and store a batch; durable when it returns; returns the sequence that made it
        visible (``ChunkTier`` rules). All or nothing: on error no item of the batch is visible (a
        key the batch overwrote may then be absent -- the old file was already replaced -- and is
        reported as removed, ``"deleted"``). ``TierFullError`` when the batch exceeds
        ``capacity_bytes`` or the filesystem is full (``__cause__`` is the ``OSError``),
        ``TierIOError`` for other I/O errors. Duplicate keys in one batch: the last one wins.

        Cancelling it: the batch runs on as a tier task and still lands all or nothing (``close``
        waits for it); the call returns only once the encoders have finished reading the raw
        buffers, then re-raises ``CancelledError``. A process killed mid-batch may leave temp files,
        which the next ``open`` removes; each rename either happened or did not.
        """
        self._check_open()
        batch = self._validate_puts(items)
        if not batch:
            return self._index.sequence
        encoded: "asyncio.Future[None]" = self._loop.create_future()
        keys = [key for key, _, _ in batch]
        # In flight from this moment: eviction, deletes and quarantine keep off these names until
        # the batch has landed or rolled back. Unmarked by a done callback, which runs even if the
        # task is cancelled before it ever started.
        writing = self._index.writing
        writing.add(keys)
        task = self._tasks.spawn(self._writes.put_batch(batch, encoded))
        task.add_done_callback(lambda _: writing.discard(keys))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The buffer rule: an encoder thread may still be reading the raw buffers.
            await wait_through_cancel(encoded)
            raise

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Read and decode each record into its buffer (which must have exactly the chunk's raw
        size). Per item the record's ``ChunkMeta``, or ``None`` on a miss: not in the index, gone
        from disk (reported as removed, ``"external"``), unreadable (counted in ``errors``), or
        corrupt (moved to ``quarantine/``, dropped from the index, counted in ``corrupt`` and
        ``quarantined``, reported as removed; its bytes are never returned), or intact but of
        another raw size than the buffer (counted in ``mismatched``, left in place). A hit makes
        the record most recently used. Keys missing from the index cost no disk access.

        Cancelling it: file reads (into the tier's own memory) are dropped; decode slices not yet
        started are abandoned and running ones finish into the buffers before the call re-raises
        ``CancelledError`` (the buffer rule); a quarantine already decided still happens.
        """
        self._check_open()
        checked: List[Tuple[bytes, memoryview]] = []
        for key, buf in items:
            check_key(key)
            view = buf if isinstance(buf, memoryview) else memoryview(buf)
            if view.readonly or not view.c_contiguous:
                raise TypeError("get_many_into needs writable, C-contiguous buffers")
            checked.append((key, view))
        results: List[Optional[ChunkMeta]] = [None] * len(checked)
        lru, stats = self._index.lru, self._index.stats
        wanted = [i for i, (key, _) in enumerate(checked) if key in lru]
        stats["gets"] += len(checked)
        if not wanted:
            stats["misses"] += len(checked)
            return results
        async with self._operation():
            reads = await asyncio.gather(
                *(self._read_file(checked[i][0], self._read_limit(checked[i])) for i in wanted)
            )
            found = [(i, data) for i, data in zip(wanted, reads) if data is not None]
            jobs = [(checked[i][0], data, checked[i][1]) for i, data in found]
            decoded = await self._files.decode(_decode_slice, jobs, [buf.nbytes for _, _, buf in jobs])
            corrupt: List[bytes] = []
            for (i, _), outcome in zip(found, decoded):
                key = checked[i][0]
                if isinstance(outcome, CorruptRecordError):
                    corrupt.append(key)
                    continue
                if isinstance(outcome, _Mismatch):
                    stats["mismatched"] += 1
                    continue
                results[i] = outcome
                lru.touch(key)
            if corrupt:
                corrupt = list(dict.fromkeys(corrupt))  # one key asked twice is one bad file
                stats["corrupt"] += len(corrupt)
                await asyncio.shield(self._tasks.spawn(self._quarantine(corrupt)))
        hits = sum(1 for r in results if r is not None)
        stats["hits"] += hits
        stats["misses"] += len(checked) - hits
        return results

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove records; returns how many were in the index (each reported as removed,
        ``"deleted"``). A key with a put in flight is deleted after that put lands. The records are
        misses from the moment the call returns. Cancelling it: while it waits for such a put,
        nothing is deleted; once the index changed, the removals run on as a tier task (``close``
        waits for them)."""
        self._check_open()
        checked = [check_key(key) for key in keys]
        while any(key in self._index.writing for key in checked):
            # Unlinking a name whose put is in flight could remove the new file after its rename
            # and leave the index pointing at nothing; the delete is ordered after the put.
            await self._tasks.wait_all()
        victims = self._index.drop(list(dict.fromkeys(checked)), "deleted")
        self._index.stats["deletes"] += len(victims)
        if victims:
            await asyncio.shield(self._tasks.spawn(self._writes.remove_files(victims)))
        return len(victims)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Move the ``keys`` this tier holds to the young end of its LRU, as a read would
        (``ChunkTier.touch_many``; event-loop thread, like every change of the index)."""
        for key in keys:
            self._index.lru.touch(check_key(key))

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Which keys are in the index (no disk access, no checksum). Cancelling it: no effect."""
        self._check_open()
        return [check_key(key) in self._index.lru for key in keys]

    async def list_keys(self) -> List[bytes]:
        """Every key in the index, least recently used first. Cancelling it: no effect."""
        self._check_open()
        return list(self._index.lru)

    async def flush(self) -> None:
        """Wait until every batch, delete and quarantine handed to the tier so far has finished
        (a cancelled ``put_many`` runs on as a tier task). Cancelling it: no effect on them."""
        self._check_open()
        await self._tasks.wait_all()

    async def check(self) -> List[str]:
        """Reconcile the index with the files (a self-check for tests and tools): rescans the tree
        on an I/O thread and returns one line per disagreement (empty when consistent). Batches in
        flight are waited for first. Cancelling it: the scan thread finishes; nothing changes."""
        self._check_open()
        async with self._operation():
            await self.flush()
            scan = await self._loop.run_in_executor(
                self._files.pool, scan_tree, self._root, float("inf"), False
            )
        on_disk = {key: size for key, size, _ in scan.entries}
        return self._index.lru.reconcile(on_disk, self._capacity, where="on disk")

    async def close(self) -> None:
        """Wait for batches and calls in flight, then release the thread pool. Safe to call twice;
        every later call raises ``ClosedError``.

        Cancelling it: the tier stays closed to new calls; batches in flight still finish on their
        own, and a second ``close`` waits for them.
        """
        self._closed = True
        await self._tasks.wait_all()
        await self._idle.wait()
        # Threads still running work of cancelled reads finish on their own; nothing awaits them.
        self._files.pool.shutdown(wait=False)

    # ------------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"file tier at {self._root} is closed")

    def _validate_puts(self, items: Sequence[PutItem]) -> List[Tuple[bytes, ChunkMeta, memoryview]]:
        batch: Dict[bytes, Tuple[bytes, ChunkMeta, memoryview]] = {}
        for item in items:
            key, meta, raw = item
            check_key(key)
            if not isinstance(meta, ChunkMeta):
                raise TypeError(f"expected ChunkMeta, not {type(meta).__name__}")
            batch.pop(key, None)  # last one wins, and keeps its position
            batch[key] = (key, meta, raw if isinstance(raw, memoryview) else memoryview(raw))
        return list(batch.values())

    def _operation(self) -> "_Operation":
        return _Operation(self)

    # gets --------------------------------------------------------------------------------------

    def _read_limit(self, item: Tuple[bytes, memoryview]) -> int:
        # The index size lets an intact record of the wrong size be read whole (then reported as a
        # mismatch, not quarantined as truncated); the buffer bound caps a file grown from outside.
        return max(self._index.lru.get(item[0], 0) or 0, item[1].nbytes + _MAX_RECORD_OVERHEAD)

    async def _read_file(self, key: bytes, limit: int) -> Optional[bytes]:
        try:
            return await self._files.read(self.path_for(key), limit)
        except FileNotFoundError:
            # Evicted or deleted by us since the index lookup (then no longer indexed), or removed
            # from outside: found gone.
            if key not in self._index.writing:
                self._index.drop([key], "external")
            return None
        except OSError:
            # A read error is a miss for the caller (the chunk is recomputed) but must be visible.
            self._index.stats["errors"] += 1
            return None

    async def _quarantine(self, keys: Sequence[bytes]) -> None:
        """Move corrupt records out of the tree (or delete them once the quarantine holds
        ``max_quarantine_records``) and drop them from the index, reported as quarantined, so they
        are never read again."""
        # A key being written is skipped: a fresh record is being renamed over the bad one, and
        # moving the path now could take the good file instead. Its next read catches a bad one.
        taken = [key for key in keys if key not in self._index.writing]
        self._index.drop(taken, "quarantined")
        self._index.stats["quarantined"] += len(taken)
        moves: List[Tuple[str, Optional[str]]] = []
        for key in taken:
            src = str(self.path_for(key))
            if self._quarantine_room.take():
                dst = str(self._root / QUARANTINE_DIR / quarantine_name(key, secrets.token_hex(4)))
                moves.append((src, dst))
            else:
                moves.append((src, None))
        outcomes = await asyncio.gather(
            *(
                self._files.replace(src, dst) if dst is not None else self._files.remove(src)
                for src, dst in moves
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, OSError) and not isinstance(outcome, FileNotFoundError):
                self._index.stats["errors"] += 1


class _Operation:
    """Counts a public call in flight so that ``close`` can wait for it."""

    __slots__ = ("_tier",)

    def __init__(self, tier: FileTier) -> None:
        self._tier = tier

    async def __aenter__(self) -> None:
        tier = self._tier
        tier._in_flight += 1
        tier._idle.clear()

    async def __aexit__(self, *exc: object) -> None:
        tier = self._tier
        tier._in_flight -= 1
        if tier._in_flight == 0:
            tier._idle.set()
