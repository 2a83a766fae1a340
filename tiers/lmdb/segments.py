"""Large records out of LMDB: append-only payload segment files beside ``data.mdb`` (issue 14).

Why: LMDB writes every dirty page through the page cache and syncs twice per commit; large records
written that way run at 0.14-0.31x of the disk's O_DIRECT limit (docs/ARCHITECTURE.md). A record
whose encoded size is at least ``segment_threshold_bytes`` is instead appended, page-aligned, to
this writer's segment file (O_DIRECT where the filesystem takes it, buffered otherwise), the file
is ``fdatasync``'d, and only then does the LMDB transaction store a small *pointer* under the key in
``chunks``. The record bytes are exactly ``tiers.record_format``'s (checksummed with the key), so a
read checks them as it checks inline records.

Promises and how they are kept:

- all or nothing: segment bytes are invisible until the transaction holding their pointers
  commits; a crash in between leaves an orphan tail past the segment's committed end (kept in the
  ``segments`` table), truncated by ``reclaim_orphans`` at the next writable open;
- power loss: segment data and a new segment's directory entry are synced before the commit;
- space returns by segment: the ``segments`` table holds each segment's live bytes, records and
  committed end, changed in the same transaction as the pointers; a segment whose live records
  drop to 0 is deleted after the commit, unless a writer still holds its ``flock`` (its active
  segment, in this or another process). Partly-live segments are not compacted (not built).
- several processes: each writer appends only to its own segment (named by pid and a counter,
  created ``O_EXCL``, ``flock``'d while active); readers open segments by name.

A read that took a pointer just before the segment was deleted (its last record evicted or
deleted meanwhile) and had not opened the file yet is a plain miss: the tier looks again in a
fresh transaction and finds the key gone or rewritten, so it counts, logs and quarantines nothing.
A segment is created and locked under a shared lock of ``segments.lock`` and ``reclaim_orphans``
scans under its exclusive lock, so an open never takes another process's segment in the instant
between its create and its ``flock``.

Primitives: ``SegmentPointer`` (the 28-byte value in ``chunks``), ``SegmentWriter`` (writer thread
only: ``append`` a batch, ``rotate``), ``SegmentReader`` (any thread: ``read`` a pointer's record),
``Ledger`` (inside one write transaction: live-byte deltas into ``segments``), ``remove_dead`` and
``reclaim_orphans`` (writer thread / open).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import lmdb

from kvtier.errors import CorruptRecordError, TierFullError, TierIOError

from ..base import ChunkMeta
from ..files.layout import fsync_dir
from ..record_format import CodecConfig, encode_record_parts

__all__ = [
    "SegmentPointer",
    "SegmentWriter",
    "SegmentReader",
    "AlignedRecord",
    "encode_for_segments",
    "record_bytes",
    "release_records",
    "Ledger",
    "LIVE",
    "is_pointer",
    "stored_size",
    "segment_name",
    "remove_dead",
    "reclaim_orphans",
    "DEFAULT_SEGMENT_MAX_BYTES",
    "DEFAULT_SEGMENT_THRESHOLD_BYTES",
    "check_segment_threshold",
]

log = logging.getLogger(__name__)

_MAGIC = b"KVSG"
_POINTER = struct.Struct("<4sIIQQ")  # magic | writer pid | counter | offset | record length
POINTER_SIZE = _POINTER.size  # 28: an inline record is never this short (its header alone is 58+)
LIVE = struct.Struct("<QQQ")  # live record bytes | live records | committed end offset
_ALIGN = 4096
_NAME = re.compile(r"^seg-([0-9]+)-([0-9]+)\.kvs$")
DEFAULT_SEGMENT_MAX_BYTES = 256 << 20
# Records of at least this many encoded bytes go to segments by default (LmdbTier, EngineConfig, the
# vLLM tier): measured (`python -m kvtier.tools.bench_segments --sizes-kib 16,64,128,256`, five runs,
# docs/ARCHITECTURE.md), segments write 1.06-1.55x the inline tier at 128 KiB and 1.54-2.13x at
# 256 KiB, but 0.62-0.84x at 64 KiB and 0.38-0.53x at 16 KiB (one LMDB transaction beats an extra
# aligned file write and its fdatasync for small records).
DEFAULT_SEGMENT_THRESHOLD_BYTES = 128 << 10
_CREATION_LOCK = "segments.lock"
_WRITE_SLICE = 64 << 20  # bytes staged at once (bounds the aligned staging buffer)
POOLED_BUFFER_BYTES = 256 << 20  # free aligned record buffers kept for reuse (all tiers of the process)
WRITES_IN_FLIGHT = 4  # direct writes in flight per batch (as the bench's O_DIRECT limit)


def check_segment_threshold(value: object, name: str = "segment_threshold_bytes", none: str = "None") -> Optional[int]:
    """The threshold as the writer uses it (``None``: every record inside LMDB; 0 means the same),
    or ``ValueError`` naming ``name`` and the value. One check for every place that takes it
    (``LmdbTier``, ``EngineConfig``, the vLLM tier's config), so they accept and say the same."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be an int >= 0 or {none} ({none} or 0: every record inside LMDB), got {value!r}")
    return value or None


def segment_name(pid: int, counter: int) -> str:
    return f"seg-{pid}-{counter}.kvs"


@dataclass(frozen=True)
class SegmentPointer:
    """Where one record lives: segment (writer pid, counter), byte offset, record length."""

    pid: int
    counter: int
    offset: int
    length: int

    @property
    def name(self) -> str:
        return segment_name(self.pid, self.counter)

    def pack(self) -> bytes:
        return _POINTER.pack(_MAGIC, self.pid, self.counter, self.offset, self.length)

    @staticmethod
    def unpack(value: "bytes | memoryview") -> "SegmentPointer":
        magic, pid, counter, offset, length = _POINTER.unpack(bytes(value))
        if magic != _MAGIC:
            raise CorruptRecordError("segment pointer has a bad magic")
        return SegmentPointer(pid, counter, offset, length)


def is_pointer(value: "bytes | memoryview") -> bool:
    """Whether a ``chunks`` value is a segment pointer (checks the length first: an inline record
    is longer, and its length is known without touching its pages)."""
    return len(value) == POINTER_SIZE and bytes(value[:4]) == _MAGIC


def stored_size(value: "bytes | memoryview") -> int:
    """The record bytes a ``chunks`` value stands for (what capacity counts)."""
    return SegmentPointer.unpack(value).length if is_pointer(value) else len(value)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _BufferPool:
    """Free page-aligned buffers by size, reused: a fresh buffer per record would page-fault and
    zero every page again (that alone cost about as much as the disk write). Holds at most
    ``max_bytes`` of free buffers; any thread."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._free: Dict[int, List[mmap.mmap]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._bytes -= nbytes
                return free.pop()
        return mmap.mmap(-1, nbytes)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._bytes + len(buf) <= self._max_bytes:
                self._free.setdefault(len(buf), []).append(buf)
                self._bytes += len(buf)
                return
        buf.close()


_BUFFERS: Optional[_BufferPool] = _BufferPool(POOLED_BUFFER_BYTES)


class AlignedRecord:
    """An encoded record in a page-aligned buffer, zero-padded to a whole page: the segment writer
    writes it with O_DIRECT as it is (no staging copy). ``len`` is the record's length; the
    buffer returns to the pool when the record is dropped."""

    __slots__ = ("buffer", "_length")

    def __init__(self, parts: Sequence["bytes | memoryview"], length: int) -> None:
        assert _BUFFERS is not None
        self.buffer = _BUFFERS.take(_round_up(length))
        self._length = length
        at = 0
        for part in parts:
            n = memoryview(part).nbytes
            self.buffer[at : at + n] = part
            at += n
        self.buffer[at:] = bytes(len(self.buffer) - at)  # no stale bytes on disk

    def __len__(self) -> int:
        return self._length

    def __bytes__(self) -> bytes:
        return self.buffer[: self._length]

    def view(self) -> memoryview:
        """The record's bytes (without the padding), for readers of its header."""
        return memoryview(self.buffer)[: self._length]

    def release(self) -> None:
        """Back to the pool now (the record is durable and committed; nothing reads it again).
        Not left to ``__del__`` alone: a batch's records may wait in a reference cycle until the
        next garbage collection, and a fresh buffer for each batch costs its page faults again."""
        buf, self.buffer = self.buffer, None
        if buf is not None and _BUFFERS is not None:  # None only while the interpreter shuts down
            _BUFFERS.give(buf)

    def __del__(self) -> None:
        self.release()


def record_bytes(record: "bytes | AlignedRecord") -> "bytes | memoryview":
    """A bytes-like view of an encoded record, aligned or not."""
    return record.view() if isinstance(record, AlignedRecord) else record


def release_records(records: Iterable["bytes | AlignedRecord"]) -> None:
    """After a successful commit: return the aligned records' buffers to the pool."""
    for record in records:
        if isinstance(record, AlignedRecord):
            record.release()


def encode_for_segments(key: bytes, meta: ChunkMeta, raw: "bytes | memoryview", codec: CodecConfig,
                        threshold: int) -> "bytes | AlignedRecord":
    """``encode_record``, placing a record of at least ``threshold`` bytes (one bound for a
    segment) straight in a pooled aligned buffer instead of a fresh ``bytes``."""
    parts = encode_record_parts(key, meta, raw, codec)
    length = sum(memoryview(p).nbytes for p in parts)
    if length < threshold:
        return b"".join(parts)
    return AlignedRecord(parts, length)


class SegmentWriter:
    """This process's active segment (writer thread only). ``append`` writes a batch page-aligned and
    syncs it; the returned pointers may be committed to LMDB once it returns."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES) -> None:
        self._dir = directory
        self._max_bytes = max_bytes
        self._pid = os.getpid()
        self._counter = -1
        self._fd: Optional[int] = None
        self._end = 0
        self.direct: Optional[bool] = None  # whether the active segment took O_DIRECT
        self._staging: Optional[mmap.mmap] = None
        self._lanes: Optional[ThreadPoolExecutor] = None  # helper threads of one append (never state)

    @property
    def active(self) -> Optional[str]:
        return segment_name(self._pid, self._counter) if self._fd is not None else None

    def _open_next(self) -> None:
        with _creation_lock(self._dir, fcntl.LOCK_SH):
            self._create_locked()

    def _create_locked(self) -> None:
        while True:
            self._counter += 1
            path = self._dir / segment_name(self._pid, self._counter)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            try:
                try:
                    fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
                    self.direct = hasattr(os, "O_DIRECT")
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    fd = os.open(path, flags, 0o600)  # tmpfs and others refuse O_DIRECT
                    self.direct = False
            except FileExistsError:
                continue  # a reused pid left this name: take the next counter
            except OSError as exc:
                raise _io_error(exc, f"cannot create segment {path}") from exc
            fcntl.flock(fd, fcntl.LOCK_EX)  # "still being appended": nobody deletes or truncates it
            self._fd, self._end = fd, 0
            fsync_dir(str(self._dir))  # the new name survives a power cut before any pointer to it commits
            return

    def rotate(self) -> None:
        """Close the active segment (its lock goes with it); the next append starts a new one."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def append(self, records: Sequence[bytes]) -> List[SegmentPointer]:
        """Write ``records`` one after another at page-aligned offsets and ``fdatasync``; raises
        ``TierFullError`` / ``TierIOError`` (then nothing committed points at the bytes)."""
        if self._fd is None or self._end >= self._max_bytes:
            self.rotate()
            self._open_next()
        assert self._fd is not None
        pointers: List[SegmentPointer] = []
        start = self._end
        pos = start
        for record in records:
            pointers.append(SegmentPointer(self._pid, self._counter, pos, len(record)))
            pos += _round_up(len(record))
        try:
            self._write_aligned(records, pointers, start, pos)
            os.fdatasync(self._fd)
        except OSError as exc:
            # The tail may hold part of the batch: skip past it, never overwrite what a reader
            # might be reading, and let reclaim_orphans truncate it later.
            self.rotate()
            raise _io_error(exc, f"segment write under {self._dir} failed") from exc
        except BaseException:
            self.rotate()  # same reasoning for any other failure of a lane
            raise
        self._end = pos
        return pointers

    def _write_aligned(self, records: Sequence[bytes], pointers: Sequence[SegmentPointer], start: int, end: int) -> None:
        """pwrite the batch in slices of at most ``_WRITE_SLICE`` bytes from a page-aligned buffer,
        each record's extent its own pwrite with up to ``WRITES_IN_FLIGHT`` in flight (one queue
        of direct writes leaves the disk idle between them; the bare probe's 4 reach its limit)."""
        assert self._fd is not None
        i = 0
        while i < len(records):
            slice_start = pointers[i].offset
            j = i
            while j < len(records) and (j == i or pointers[j].offset + _round_up(len(records[j])) - slice_start <= _WRITE_SLICE):
                j += 1
            slice_end = pointers[j - 1].offset + _round_up(len(records[j - 1]))
            staged = any(not isinstance(records[k], AlignedRecord) for k in range(i, j))
            staging = self._staging_of(slice_end - slice_start) if staged else None
            parts = [range(k, j, WRITES_IN_FLIGHT) for k in range(i, min(j, i + WRITES_IN_FLIGHT))]
            jobs = [lambda part=part: self._write_records(staging, records, pointers, slice_start, part) for part in parts]
            self._run_all(jobs)
            i = j

    def _write_records(self, staging: Optional[mmap.mmap], records: Sequence[bytes], pointers: Sequence[SegmentPointer],
                       slice_start: int, part: Iterable[int]) -> None:
        """One in-flight lane: copy each record of ``part`` to its aligned place (zero-padded: no
        stale bytes on disk) and pwrite that extent."""
        assert self._fd is not None
        for k in part:
            record = records[k]
            n = len(record)
            size = _round_up(n)
            if isinstance(record, AlignedRecord):
                view = memoryview(record.buffer)[:size]
            else:
                assert staging is not None
                at = pointers[k].offset - slice_start
                staging[at : at + n] = record
                staging[at + n : at + size] = bytes(size - n)
                view = memoryview(staging)[at : at + size]
            try:
                done = 0
                while done < size:
                    done += os.pwrite(self._fd, view[done:], pointers[k].offset + done)
            finally:
                view.release()

    def _run_all(self, jobs: List[Callable[[], None]]) -> None:
        """Run ``jobs`` on the lane pool (the last on this thread) and wait for EVERY one before
        raising the first failure: no write of the batch may still be in flight once ``append``
        gives up on the segment."""
        if len(jobs) == 1:
            jobs[0]()
            return
        if self._lanes is None:
            self._lanes = ThreadPoolExecutor(WRITES_IN_FLIGHT - 1, thread_name_prefix="kvtier-segment-write")
        futures = [self._lanes.submit(job) for job in jobs[:-1]]
        first: Optional[BaseException] = None
        try:
            jobs[-1]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the lanes finish
            first = exc
        for fut in futures:
            exc = fut.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first

    def _staging_of(self, nbytes: int) -> mmap.mmap:
        """The reused page-aligned staging buffer (anonymous map), at least ``nbytes`` long: a fresh
        map per batch would page-fault and zero every page again."""
        if self._staging is None or len(self._staging) < nbytes:
            if self._staging is not None:
                self._staging.close()
            self._staging = mmap.mmap(-1, max(nbytes, _ALIGN))
        return self._staging

    def close(self) -> None:
        self.rotate()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._lanes is not None:
            self._lanes.shutdown(wait=True)
            self._lanes = None


class SegmentReader:
    """Reads records out of segments by pointer (any thread). Keeps one read-only fd per segment."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._fds: Dict[str, int] = {}
        # fds of deleted segments: closed only at close(), since a read on another thread may still
        # be in pread on one (closing it there could hand the number to an unrelated open file).
        self._retired: List[int] = []
        self._lock = threading.Lock()

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = os.open(self._dir / name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._fds[name] = fd
            return fd

    def read(self, value: "bytes | memoryview") -> bytes:
        """The record a pointer names. A missing segment or short read is ``CorruptRecordError``
        (a miss, quarantined like a checksum failure); other OS errors are ``TierIOError``."""
        pointer = SegmentPointer.unpack(value)
        try:
            fd = self._fd(pointer.name)
            # A damaged pointer can claim any length: check it against the file before allocating
            # it (a flipped high byte would otherwise ask pread for terabytes: MemoryError).
            size = os.fstat(fd).st_size
            if pointer.offset + pointer.length > size:
                raise CorruptRecordError(
                    f"segment {pointer.name} is short: {max(0, size - pointer.offset)} of {pointer.length} bytes "
                    f"at offset {pointer.offset}"
                )
            data = os.pread(fd, pointer.length, pointer.offset)
        except FileNotFoundError as exc:
            raise CorruptRecordError(f"segment {pointer.name} is missing") from exc
        except OSError as exc:
            raise TierIOError(f"cannot read segment {pointer.name} in {self._dir}: {exc}") from exc
        if len(data) != pointer.length:
            raise CorruptRecordError(
                f"segment {pointer.name} is short: {len(data)} of {pointer.length} bytes at offset {pointer.offset}"
            )
        return data

    def forget(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                fd = self._fds.pop(name, None)
                if fd is not None:
                    self._retired.append(fd)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._retired]:
                os.close(fd)
            self._fds.clear()
            self._retired.clear()


class Ledger:
    """Inside one write transaction: per-segment changes of live bytes and records, and the new
    committed end, written to the ``segments`` table by ``commit``; ``emptied`` lists the segments
    whose last record went (to delete after the commit)."""

    def __init__(self, txn: lmdb.Transaction, table: "lmdb._Database") -> None:
        self._txn = txn
        self._table = table
        self._delta: Dict[str, List[int]] = {}
        self.emptied: List[str] = []

    def add(self, pointer: SegmentPointer) -> None:
        d = self._delta.setdefault(pointer.name, [0, 0, 0])
        d[0] += pointer.length
        d[1] += 1
        d[2] = max(d[2], pointer.offset + _round_up(pointer.length))

    def drop(self, value: "bytes | memoryview") -> None:
        """A ``chunks`` value is going away; counts only when it is a pointer."""
        if is_pointer(value):
            pointer = SegmentPointer.unpack(value)
            d = self._delta.setdefault(pointer.name, [0, 0, 0])
            d[0] -= pointer.length
            d[1] -= 1

    def commit(self) -> None:
        for name, (dbytes, drecords, end) in self._delta.items():
            key = name.encode()
            old = self._txn.get(key, db=self._table)
            live, records, committed = LIVE.unpack(old) if old is not None and len(old) == LIVE.size else (0, 0, 0)
            live, records, committed = max(0, live + dbytes), max(0, records + drecords), max(committed, end)
            if records == 0:
                self._txn.delete(key, db=self._table)
                self.emptied.append(name)
            else:
                self._txn.put(key, LIVE.pack(live, records, committed), db=self._table)


def _locked_elsewhere(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def remove_dead(directory: Path, names: Iterable[str], writer: Optional[SegmentWriter], reader: SegmentReader) -> List[str]:
    """After the commit that emptied ``names``: delete each segment file, unless a writer still
    appends to it (ours is rotated first; another process's keeps its lock: left for later)."""
    removed = []
    for name in names:
        if writer is not None and writer.active == name:
            writer.rotate()
        reader.forget([name])
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            if _locked_elsewhere(fd):
                continue
            os.unlink(path)
            removed.append(name)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def _creation_lock(directory: Path, mode: int) -> Iterator[None]:
    """``segments.lock``: shared while a writer creates and locks a segment, exclusive while an open
    looks for orphans."""
    try:
        fd = os.open(directory / _CREATION_LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise _io_error(exc, f"cannot open {directory / _CREATION_LOCK}") from exc
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


def reclaim_orphans(directory: Path, committed: Dict[str, int]) -> Tuple[int, int]:
    """At a writable open: delete segment files no committed record points into and truncate each
    other one to its committed end (what a crash between ``append`` and the commit left behind),
    skipping segments a live writer holds. ``committed``: segment name -> committed end. Returns
    (files removed, files truncated)."""
    if not any(_NAME.match(name) for name in os.listdir(directory)):
        return 0, 0  # nothing to look at: no lock file created for caches without segments
    with _creation_lock(directory, fcntl.LOCK_EX):
        return _reclaim(directory, committed)


def _reclaim(directory: Path, committed: Dict[str, int]) -> Tuple[int, int]:
    removed = truncated = 0
    for entry in os.scandir(directory):
        if not _NAME.match(entry.name):
            continue
        path = directory / entry.name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if _locked_elsewhere(fd):
                continue
            end = committed.get(entry.name)
            if end is None:
                os.unlink(path)
                removed += 1
            elif os.fstat(fd).st_size > end:
                os.ftruncate(fd, end)
                os.fsync(fd)
                truncated += 1
        finally:
            os.close(fd)
    return removed, truncated


def committed_ends(txn: lmdb.Transaction, table: "lmdb._Database") -> Dict[str, int]:
    """segment name -> committed end offset, from the ``segments`` table."""
    out: Dict[str, int] = {}
    for k, v in txn.cursor(db=table).iternext(keys=True, values=True):
        if len(v) == LIVE.size:
            out[bytes(k).decode(errors="replace")] = LIVE.unpack(v)[2]
    return out


def _io_error(exc: OSError, what: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(f"{what}: disk full: {exc}")
    return TierIOError(f"{what}: {exc}")
