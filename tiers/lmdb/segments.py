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
  segment, in this or another process). A closed segment left mostly dead is compacted
  (``compaction``: its live records move to the active segment, each pointer replaced only where
  the key still holds the old one; the emptied file goes once no older read transaction is open).
- several processes: each writer appends only to its own segment (named by pid and a counter,
  created ``O_EXCL``, ``flock``'d while active); readers open segments by name.

A read that took a pointer just before the segment was deleted (its last record evicted or
deleted meanwhile) and had not opened the file yet is a plain miss: the tier looks again in a
fresh transaction and finds the key gone or rewritten, so it counts, logs and quarantines nothing.
A segment is created and locked under a shared lock of ``segments.lock`` and ``reclaim_orphans``
scans under its exclusive lock, so an open never takes another process's segment in the instant
between its create and its ``flock``.

Primitives: ``SegmentPointer`` (the 32-byte value in ``chunks``; 28 bytes in the first layout),
``SegmentWriter`` (writer thread only: ``append`` a batch of ``segment_records.SegmentRecord``, in
runs of adjacent records, ``rotate``), ``SegmentReader`` (any thread: ``read`` a pointer's record,
``read_into`` / ``read_many_into`` a caller's buffers),
``Ledger`` (inside one write transaction: live-byte deltas into ``segments``), ``remove_dead`` and
``reclaim_orphans`` (writer thread / open), ``held_by_writer`` and ``segment_files`` (any thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import lmdb

from kvtier.errors import CorruptRecordError, TierFullError, TierIOError

from ..base import ChunkMeta
from ..files.layout import fsync_dir
from ..record_format import MAX_HEADER_BYTES, check_payload_in_place, decode_record, decode_split
from .segment_records import (  # SegmentRecord .. release_records: re-exported (__all__)
    _ALIGN,
    _BUFFERS,
    SegmentRecord,
    _aligned,
    _byte_view,
    _round_up,
    borrows_buffers,
    codec_of,
    encode_for_segments,
    release_records,
)

__all__ = [
    "SegmentPointer",
    "SegmentWriter",
    "SegmentReader",
    "SegmentRecord",
    "encode_for_segments",
    "codec_of",
    "borrows_buffers",
    "release_records",
    "Ledger",
    "LIVE",
    "is_pointer",
    "stored_size",
    "segment_name",
    "adjacent_runs",
    "remove_dead",
    "held_by_writer",
    "segment_files",
    "reclaim_orphans",
    "DEFAULT_SEGMENT_MAX_BYTES",
    "DEFAULT_SEGMENT_THRESHOLD_BYTES",
    "check_segment_threshold",
]

log = logging.getLogger(__name__)

_MAGIC = b"KVSH"  # split layout: the record's head, then its payload from the next page boundary
_MAGIC_CONTIGUOUS = b"KVSG"  # the first layout (the record's bytes in one run): still read, no longer written
_POINTER = struct.Struct("<4sIIQQI")  # magic | writer pid | counter | offset | record length | head length
_POINTER_CONTIGUOUS = struct.Struct("<4sIIQQ")
POINTER_SIZE = _POINTER.size  # 32: an inline record is never this short (its header alone is 58+)
_POINTER_SIZES = {_POINTER.size: _MAGIC, _POINTER_CONTIGUOUS.size: _MAGIC_CONTIGUOUS}
LIVE = struct.Struct("<QQQ")  # live record bytes | live records | committed end offset
_MAX_HEAD = 10 + MAX_HEADER_BYTES  # a record's prefix and largest header
# One vectored direct read or write covers adjacent records up to this many bytes: at 256 KiB a
# record per I/O keeps the virtual disk's queue busy with small requests; runs of records reach
# the throughput of large ones. Bounded by the iovec limit too (at most 3 pieces a record).
RUN_BYTES = 4 << 20
_RUN_RECORDS = max(1, (os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024) // 3)
NAME_PATTERN = _NAME = re.compile(r"^seg-([0-9]+)-([0-9]+)\.kvs$")  # pid, number
DEFAULT_SEGMENT_MAX_BYTES = 256 << 20
# Records of at least this many encoded bytes go to segments by default (LmdbTier, EngineConfig, the
# vLLM tier): measured (`python -m kvtier.tools.bench_segments --sizes-kib 16,64,128,256`, five runs,
# docs/ARCHITECTURE.md), segments write 1.06-1.55x the inline tier at 128 KiB and 1.54-2.13x at
# 256 KiB, but 0.62-0.84x at 64 KiB and 0.38-0.53x at 16 KiB (one LMDB transaction beats an extra
# aligned file write and its fdatasync for small records).
DEFAULT_SEGMENT_THRESHOLD_BYTES = 128 << 10
_CREATION_LOCK = "segments.lock"
WRITES_IN_FLIGHT = 4  # direct writes in flight per batch (as the bench's O_DIRECT limit)
# Read fds a SegmentReader keeps open: 256 segments of the default 256 MiB reach 64 GiB without a
# reopen, and stay well inside the usual 1024-descriptor soft limit.
MAX_OPEN_SEGMENTS = 256


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
    """Where one record lives: segment (writer pid, counter), byte offset, record length, and the
    length of its head (prefix + header). On disk the head starts at ``offset`` and the payload at
    the next page boundary after it, so both can move by direct I/O straight from and into
    page-aligned buffers (a host slot) with no staging copy. ``head == 0``: the first layout, the
    record's bytes in one run from ``offset`` (written by earlier builds; read, never written)."""

    pid: int
    counter: int
    offset: int
    length: int
    head: int = 0

    @property
    def name(self) -> str:
        return segment_name(self.pid, self.counter)

    @property
    def split(self) -> bool:
        return self.head > 0

    @property
    def payload_length(self) -> int:
        return self.length - self.head

    @property
    def extent(self) -> int:
        """Bytes the record takes in its segment (whole pages)."""
        if not self.split:
            return _round_up(self.length)
        return _round_up(self.head) + _round_up(self.payload_length)

    def file_offset(self, at: int) -> int:
        """The segment offset of the record's byte ``at``."""
        if self.split and at >= self.head:
            return self.offset + _round_up(self.head) + at - self.head
        return self.offset + at

    def pack(self) -> bytes:
        if not self.split:
            return _POINTER_CONTIGUOUS.pack(_MAGIC_CONTIGUOUS, self.pid, self.counter, self.offset, self.length)
        return _POINTER.pack(_MAGIC, self.pid, self.counter, self.offset, self.length, self.head)

    @staticmethod
    def unpack(value: "bytes | memoryview", *, check: bool = True) -> "SegmentPointer":
        """``check=False``: the fields as stored, even when the head length cannot be right (for
        the accounting that a damaged pointer must not stop: its size, its segment's ledger)."""
        raw = bytes(value)
        if not is_pointer(raw):
            raise CorruptRecordError("segment pointer has a bad magic or length")
        if len(raw) == _POINTER.size:
            _, pid, counter, offset, length, head = _POINTER.unpack(raw)
            if check and not 0 < head <= min(length, _MAX_HEAD):
                raise CorruptRecordError(f"segment pointer with a head of {head} bytes in a {length}-byte record")
            pointer = SegmentPointer(pid, counter, offset, length, head)
        else:
            _, pid, counter, offset, length = _POINTER_CONTIGUOUS.unpack(raw)
            pointer = SegmentPointer(pid, counter, offset, length)
        if check and offset % _ALIGN:
            # every record starts on a page (a direct read elsewhere would fail with EINVAL)
            raise CorruptRecordError(f"segment pointer to offset {offset}, not on a page boundary")
        return pointer


def is_pointer(value: "bytes | memoryview") -> bool:
    """Whether a ``chunks`` value is a segment pointer (checks the length first: an inline record
    is longer, and its length is known without touching its pages)."""
    magic = _POINTER_SIZES.get(len(value))
    return magic is not None and bytes(value[:4]) == magic


def stored_size(value: "bytes | memoryview") -> int:
    """The record bytes a ``chunks`` value stands for (what capacity counts)."""
    return SegmentPointer.unpack(value, check=False).length if is_pointer(value) else len(value)


class SegmentWriter:
    """This process's active segment (writer thread only). ``append`` writes a batch page-aligned and
    syncs it; the returned pointers may be committed to LMDB once it returns.

    ``numbers`` hands out segment numbers that never repeat in the directory (the tier takes them
    from a counter in its ``meta`` table, bumped in a write transaction of their own): a name is
    never reused, so a reader that keeps a file open by name never meets a new file under an old
    name. Without it (tools and tests driving a writer by hand) numbers count up from 0 in this
    writer, skipping names that exist."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES,
                 numbers: Optional[Callable[[], int]] = None) -> None:
        self._dir = directory
        self._max_bytes = max_bytes
        self._numbers = numbers
        self._pid = os.getpid()
        self._counter = -1
        self._fd: Optional[int] = None
        self._end = 0
        self._allocate = True  # False once fallocate is unsupported on the active segment's filesystem
        self.direct: Optional[bool] = None  # whether the active segment took O_DIRECT
        self._lanes: Optional[ThreadPoolExecutor] = None  # helper threads of one append (never state)

    @property
    def active(self) -> Optional[str]:
        return segment_name(self._pid, self._counter) if self._fd is not None else None

    def _next_number(self) -> int:
        return self._numbers() if self._numbers is not None else self._counter + 1

    def _open_next(self) -> None:
        """Create, lock and name-sync the next segment; only then is it the active one. Any failure
        is ``TierIOError`` / ``TierFullError`` and leaves no active segment: a file whose directory
        entry was not synced is never appended to (a power cut could lose its name while LMDB kept
        pointers into it), it is removed (or, failing that, left without an entry in ``segments``:
        an orphan the next writable open deletes)."""
        while True:
            number = self._next_number()  # an LMDB write: never under segments.lock
            path = self._dir / segment_name(self._pid, number)
            with _creation_lock(self._dir, fcntl.LOCK_SH):
                fd = self._create(path)
                if fd is None:
                    self._counter = number
                    continue  # a reused pid left this name: take the next number
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # "still being appended": nobody deletes or truncates it
                    fsync_dir(str(self._dir))  # the name survives a power cut before any pointer to it commits
                except OSError as exc:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    raise _io_error(exc, f"cannot lock and sync new segment {path}") from exc
            self._fd, self._counter, self._end, self._allocate = fd, number, 0, True
            return

    def _create(self, path: Path) -> Optional[int]:
        """``O_EXCL`` create (O_DIRECT where the filesystem takes it); ``None`` when the name exists."""
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
            return None
        except OSError as exc:
            raise _io_error(exc, f"cannot create segment {path}") from exc
        return fd

    def rotate(self) -> None:
        """Close the active segment (its lock goes with it); the next append starts a new one. Never
        raises: it runs after commits (``remove_dead``), and a failed ``close`` still releases the
        descriptor and its lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError as exc:
                log.warning("kvtier lmdb: closing segment %s failed: %s", self._dir, exc)

    def _allocate_batch(self, end: int) -> None:
        """Allocate the batch's blocks ``[self._end, end)`` before writing them (``fallocate``), so
        the direct writes land inside the file's size: extending direct writes to one file are
        serialised by the filesystem (ext4 takes the inode lock exclusively for them), writes into
        allocated blocks run side by side (measured here, 4 in flight: 1.2-1.4 GB/s extending,
        1.5-1.7 GB/s allocated). A full disk shows here, before any byte of the batch is written.
        Where the filesystem has no ``fallocate`` the writes just extend the file."""
        assert self._fd is not None
        if self._allocate and end > self._end:
            self._allocate = _fallocate(self._fd, self._end, end - self._end)

    def append(self, records: Sequence["SegmentRecord | bytes"]) -> List[SegmentPointer]:
        """Write ``records`` one after another at page-aligned offsets (each record's head page,
        then its payload pages) and ``fdatasync``; raises ``TierFullError`` / ``TierIOError``
        (then nothing committed points at the bytes). ``bytes`` records (one run of a record's
        bytes) are laid out the same way."""
        placed = [r if isinstance(r, SegmentRecord) else SegmentRecord.of_bytes(r) for r in records]
        if self._fd is None or self._end >= self._max_bytes:
            self.rotate()
            self._open_next()
        assert self._fd is not None
        pointers: List[SegmentPointer] = []
        pos = self._end
        for record in placed:
            pointer = SegmentPointer(self._pid, self._counter, pos, len(record), len(record.head))
            pointers.append(pointer)
            pos += pointer.extent
        try:
            self._allocate_batch(pos)
            runs = adjacent_runs([p.extent for p in pointers], lanes=WRITES_IN_FLIGHT)
            lanes = [runs[k::WRITES_IN_FLIGHT] for k in range(min(len(runs), WRITES_IN_FLIGHT))]
            self._run_all([lambda lane=lane: self._write_runs(placed, pointers, lane) for lane in lanes])
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

    def _write_runs(self, records: Sequence[SegmentRecord], pointers: Sequence[SegmentPointer], lane: Iterable[range]) -> None:
        """One in-flight lane (up to ``WRITES_IN_FLIGHT`` of them: one queue of direct writes leaves
        the disk idle between them): each run of adjacent records in one ``pwritev`` of its pages."""
        assert self._fd is not None
        for run in lane:
            _pwritev_all(self._fd, [piece for k in run for piece in records[k].iovecs()], pointers[run.start].offset)

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

    def close(self) -> None:
        self.rotate()
        if self._lanes is not None:
            self._lanes.shutdown(wait=True)
            self._lanes = None


def _in_place(pointer: SegmentPointer, target: memoryview) -> bool:
    """Whether a record can be read with its payload straight into ``target``: the split layout,
    a writable page-aligned buffer of the payload's size (a raw record of a host slot's size; a
    compressed one is smaller than its slot)."""
    return pointer.split and pointer.payload_length == target.nbytes and not target.readonly and _aligned(target)


class _InPlaceRead:
    """One record read in place: its head and its partial last page into pooled pages, the whole
    pages of its payload into the caller's buffer (``pieces``, in file order)."""

    __slots__ = ("pointer", "target", "pieces", "_pages", "_whole")

    def __init__(self, pointer: SegmentPointer, target: memoryview) -> None:
        assert _BUFFERS is not None
        self.pointer, self.target = pointer, target
        self._whole = target.nbytes - target.nbytes % _ALIGN
        head_bytes = _round_up(pointer.head)
        self._pages: Optional[mmap.mmap] = _BUFFERS.take(head_bytes + _round_up(target.nbytes - self._whole))
        view = memoryview(self._pages)
        self.pieces = [view[:head_bytes], target[: self._whole]]
        if len(self._pages) > head_bytes:
            self.pieces.append(view[head_bytes:])

    def finish(self, key: bytes, max_raw_bytes: int) -> ChunkMeta:
        """After the read: the partial last page into place, then the checks (``out`` holds the
        bytes whatever they are; a bad record is an error and a miss)."""
        head = self.pieces[0]
        if len(self.pieces) == 3:
            self.target[self._whole :] = self.pieces[2][: self.target.nbytes - self._whole]
        return check_payload_in_place(key, head[: self.pointer.head], self.target, max_raw_bytes=max_raw_bytes)

    def close(self) -> None:
        pages, self._pages = self._pages, None
        for piece in self.pieces:
            piece.release()
        self.pieces = []
        if pages is not None and _BUFFERS is not None:
            _BUFFERS.give(pages)


def _runs_in_files(direct: List[Tuple[int, SegmentPointer, memoryview]]) -> List[List[Tuple[int, SegmentPointer, memoryview]]]:
    """Reads sorted by (segment, offset) -> runs of records adjacent in one file (``adjacent_runs``)."""
    runs: List[List[Tuple[int, SegmentPointer, memoryview]]] = []
    group: List[Tuple[int, SegmentPointer, memoryview]] = []

    def close_group() -> None:
        for run in adjacent_runs([p.extent for _, p, _ in group]):
            runs.append([group[k] for k in run])

    for item in direct:
        if group and (item[1].name != group[-1][1].name or item[1].offset != group[-1][1].offset + group[-1][1].extent):
            close_group()
            group = []
        group.append(item)
    if group:
        close_group()
    return runs


def _outcome(fn: Callable[[], object]) -> object:
    """``fn()``, or the exception it raised (the caller sorts misses from failures)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - handed back as this record's outcome
        return exc


class _OpenSegment:
    """One cached read descriptor: the file it is (device, inode), the reads using it now, and
    whether it was dropped from the cache (closed when the last of those reads ends)."""

    __slots__ = ("fd", "ident", "users", "retired")

    def __init__(self, fd: int, ident: Tuple[int, int]) -> None:
        self.fd, self.ident, self.users, self.retired = fd, ident, 0, False


class SegmentReader:
    """Reads records out of segments by pointer (any thread). Keeps a read-only fd per segment,
    O_DIRECT where the filesystem takes it: a split record's payload goes from the disk straight
    into the caller's page-aligned buffer, with neither the page cache's copy nor ours.

    Descriptors: at most ``max_open`` stay cached (least recently used closed first), a cached one
    is used only while the name still leads to that file (device and inode checked against a fresh
    ``stat`` before each read: a deleted file's descriptor never serves a pointer), and one dropped
    from the cache -- evicted, ``forget`` (its file deleted), replaced, ``sweep`` -- is closed as
    soon as no read is using it (a count of reads in flight, under the lock): closing it while
    another thread is in ``preadv`` could hand its number to an unrelated file. So the disk space
    of deleted segments comes back as their last read ends, and open fds stay bounded."""

    def __init__(self, directory: Path, max_open: int = MAX_OPEN_SEGMENTS) -> None:
        self._dir = directory
        self._max_open = max_open
        self._open: "OrderedDict[str, _OpenSegment]" = OrderedDict()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _using(self, name: str) -> Iterator[int]:
        """The fd of segment ``name`` for one read (``FileNotFoundError``: the file is gone)."""
        path = self._dir / name
        ident = _identity(os.stat(path))
        with self._lock:
            entry = self._open.get(name)
            if entry is not None and entry.ident != ident:
                self._retire(self._open.pop(name))  # another file has the name now
                entry = None
            if entry is None:
                entry = self._opened(path)
                self._open[name] = entry
                while len(self._open) > self._max_open:
                    self._retire(self._open.popitem(last=False)[1])
            else:
                self._open.move_to_end(name)
            entry.users += 1
        try:
            yield entry.fd
        finally:
            with self._lock:
                entry.users -= 1
                if entry.retired and entry.users == 0:
                    _close_quietly(entry.fd)

    @staticmethod
    def _opened(path: Path) -> _OpenSegment:
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            fd = os.open(path, flags)  # tmpfs and others refuse O_DIRECT
        try:
            return _OpenSegment(fd, _identity(os.fstat(fd)))
        except BaseException:
            os.close(fd)
            raise

    def _retire(self, entry: _OpenSegment) -> None:
        """Under the lock: ``entry`` is out of the cache; close it now unless a read uses it."""
        entry.retired = True
        if entry.users == 0:
            _close_quietly(entry.fd)

    def open_count(self) -> int:
        """Descriptors cached now (retired ones still in a read not counted)."""
        with self._lock:
            return len(self._open)

    def read(self, value: "bytes | memoryview") -> bytes:
        """The record a pointer names, as one run of bytes (``encode_record``'s). A missing segment
        or short read is ``CorruptRecordError`` (a miss, quarantined like a checksum failure);
        other OS errors are ``TierIOError``."""
        pointer = SegmentPointer.unpack(value)
        with self._extent(pointer) as extent:
            if not pointer.split:
                return bytes(extent[: pointer.length])
            payload_at = _round_up(pointer.head)
            return bytes(extent[: pointer.head]) + bytes(extent[payload_at : payload_at + pointer.payload_length])

    def read_into(self, key: bytes, value: "bytes | memoryview", out: memoryview, *, max_raw_bytes: int) -> ChunkMeta:
        """Decode the record a pointer names into ``out`` and return its meta (``decode_record``'s
        checks and errors, plus ``read``'s). When ``out`` is page-aligned and of the payload's
        size (a raw record of a host slot's size), one vectored read puts the head in a pooled
        page and the payload straight into ``out``, checksummed there: nothing of the chunk's size
        is allocated or copied (at 4 MiB, the bytes object and its copy cost a third of a cold
        read). Anything else is read into a pooled buffer and decoded from it. ``out`` is
        unspecified after a failure, as ``get_many_into`` allows for a miss."""
        pointer = SegmentPointer.unpack(value)
        target = _byte_view(out)
        if not _in_place(pointer, target):
            with self._extent(pointer) as extent:
                if not pointer.split:
                    return decode_record(key, extent[: pointer.length], out, max_raw_bytes=max_raw_bytes)[0]
                payload_at = _round_up(pointer.head)
                return decode_split(key, extent[: pointer.head], extent[payload_at : payload_at + pointer.payload_length],
                                    out, max_raw_bytes=max_raw_bytes)[0]
        read = _InPlaceRead(pointer, target)
        try:
            self._read_exactly(pointer, read.pieces)
            return read.finish(key, max_raw_bytes)
        finally:
            read.close()

    def read_many_into(self, items: Sequence[Tuple[bytes, "bytes | memoryview", memoryview]], *,
                       max_raw_bytes: int) -> List[object]:
        """``read_into`` of a batch; per item its meta or the exception its read raised. Records
        read in place that lie one after another in a segment (as a batch was written) are read
        together, one vectored direct read per run of up to ``RUN_BYTES``: at 256 KiB a request
        per record leaves the disk's throughput on small requests. A run whose read fails is
        retried record by record, so each record gets its own outcome."""
        results: List[object] = [None] * len(items)
        direct: List[Tuple[int, SegmentPointer, memoryview]] = []
        for i, (key, value, out) in enumerate(items):
            try:
                pointer = SegmentPointer.unpack(value)
                target = _byte_view(out)
            except Exception as exc:  # noqa: BLE001 - this record's outcome
                results[i] = exc
                continue
            if _in_place(pointer, target):
                direct.append((i, pointer, target))
            else:
                results[i] = _outcome(lambda: self.read_into(key, value, out, max_raw_bytes=max_raw_bytes))
        direct.sort(key=lambda d: (d[1].name, d[1].offset))
        for run in _runs_in_files(direct):
            reads = [_InPlaceRead(pointer, target) for _, pointer, target in run]
            try:
                outcome = _outcome(lambda: self._read_exactly(run[0][1], [p for r in reads for p in r.pieces]))
                for (i, _, _), read in zip(run, reads):
                    key, value, out = items[i]
                    if outcome is None:
                        results[i] = _outcome(lambda: read.finish(key, max_raw_bytes))
                    else:  # one record's damage (a short file) must not fail its neighbours
                        results[i] = outcome if len(run) == 1 else _outcome(
                            lambda: self.read_into(key, value, out, max_raw_bytes=max_raw_bytes))
            finally:
                for read in reads:
                    read.close()
        return results

    @contextlib.contextmanager
    def _extent(self, pointer: SegmentPointer) -> Iterator[memoryview]:
        """The record's whole extent, read into a pooled page-aligned buffer lent for the block."""
        assert _BUFFERS is not None
        self._check_extent(pointer)
        pages = _BUFFERS.take(pointer.extent)
        view = memoryview(pages)
        try:
            self._read_exactly(pointer, [view])
            yield view
        finally:
            view.release()
            _BUFFERS.give(pages)

    def _check_extent(self, pointer: SegmentPointer) -> None:
        """A damaged pointer can claim any length: check its extent against the file before a
        buffer of that size is taken (a flipped high byte would ask for petabytes: MemoryError)."""
        try:
            with self._using(pointer.name) as fd:
                size = os.fstat(fd).st_size
        except FileNotFoundError as exc:
            raise CorruptRecordError(f"segment {pointer.name} is missing") from exc
        except OSError as exc:
            raise TierIOError(f"cannot read segment {pointer.name} in {self._dir}: {exc}") from exc
        if pointer.offset + pointer.extent > size:
            raise CorruptRecordError(
                f"segment {pointer.name} is short: {size} bytes, the record claims {pointer.extent} at offset {pointer.offset}"
            )

    def _read_exactly(self, pointer: SegmentPointer, pieces: List[memoryview]) -> None:
        """Fill ``pieces`` from the record's offset: a missing segment or one that ends first is
        corruption (a miss, quarantined like a checksum failure), any other OS error
        ``TierIOError``."""
        try:
            with self._using(pointer.name) as fd:
                complete = _preadv_all(fd, pieces, pointer.offset)
        except FileNotFoundError as exc:
            raise CorruptRecordError(f"segment {pointer.name} is missing") from exc
        except OSError as exc:
            raise TierIOError(f"cannot read segment {pointer.name} in {self._dir}: {exc}") from exc
        if not complete:
            raise CorruptRecordError(f"segment {pointer.name} is short: it ends inside the record at offset {pointer.offset}")

    def forget(self, names: Iterable[str]) -> None:
        """Segments ``names`` are being deleted: drop their fds (each closed once no read uses it)."""
        with self._lock:
            for name in names:
                entry = self._open.pop(name, None)
                if entry is not None:
                    self._retire(entry)

    def sweep(self) -> int:
        """Drop the fds of segments whose name no longer leads to their file (deleted, by this
        process or another); returns how many. Any thread (the tier's timer): another process's
        deletions are otherwise seen only when this one reads that name again or evicts it."""
        with self._lock:
            cached = [(name, entry) for name, entry in self._open.items()]
        gone = []
        for name, entry in cached:
            try:
                if _identity(os.stat(self._dir / name)) == entry.ident:
                    continue
            except FileNotFoundError:
                pass
            except OSError:
                continue  # cannot tell: the next read decides
            gone.append((name, entry))
        with self._lock:
            for name, entry in gone:
                if self._open.get(name) is entry:
                    self._retire(self._open.pop(name))
        return len(gone)

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._retire(self._open.popitem()[1])


def _identity(st: os.stat_result) -> Tuple[int, int]:
    return st.st_dev, st.st_ino


def _close_quietly(fd: int) -> None:
    """Close a read descriptor; a failure is logged (it is released whatever close says)."""
    try:
        os.close(fd)
    except OSError as exc:
        log.warning("kvtier lmdb: closing a segment read descriptor failed: %s", exc)


class Ledger:
    """Inside one write transaction: per-segment changes of live bytes and records, and the new
    committed end, written to the ``segments`` table by ``commit``; ``emptied`` lists the segments
    whose last record went (to delete after the commit)."""

    def __init__(self, txn: lmdb.Transaction, table: "lmdb._Database") -> None:
        self._txn = txn
        self._table = table
        self._delta: Dict[str, List[int]] = {}
        self.emptied: List[str] = []
        # after ``commit``: name -> (live bytes, live records, committed end) of each touched
        # segment that still has records (what the automatic compaction check looks at)
        self.remaining: Dict[str, Tuple[int, int, int]] = {}

    def add(self, pointer: SegmentPointer) -> None:
        d = self._delta.setdefault(pointer.name, [0, 0, 0])
        d[0] += pointer.length
        d[1] += 1
        d[2] = max(d[2], pointer.offset + pointer.extent)

    def drop(self, value: "bytes | memoryview") -> None:
        """A ``chunks`` value is going away; counts only when it is a pointer."""
        if is_pointer(value):
            pointer = SegmentPointer.unpack(value, check=False)  # a damaged one goes too (quarantine)
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
                self.remaining[name] = (live, records, committed)


def _locked_elsewhere(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def held_by_writer(directory: Path, name: str) -> Optional[bool]:
    """Whether a writer (of any process, this one included) still holds segment ``name``'s lock,
    i.e. may append to it; ``None`` when the file does not exist. Compaction leaves held ones."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        return _locked_elsewhere(fd)
    finally:
        os.close(fd)  # drops the lock the probe may have taken


def segment_files(directory: Path) -> List[str]:
    """Names of the segment files in ``directory``."""
    return sorted(name for name in os.listdir(directory) if _NAME.match(name))


def remove_dead(directory: Path, names: Iterable[str], writer: Optional[SegmentWriter], reader: SegmentReader) -> List[str]:
    """After the commit that emptied ``names``: delete each segment file, unless a writer still
    appends to it (ours is rotated first; another process's keeps its lock: left for later).
    Returns the names deleted. Never raises: it runs after a commit, which must stand whatever
    the files do; a file that cannot be deleted (a permission, an I/O error) is logged and left
    without an entry in ``segments``, an orphan the next writable open deletes."""
    removed = []
    for name in names:
        if writer is not None and writer.active == name:
            writer.rotate()
        reader.forget([name])
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("kvtier lmdb: cannot open emptied segment %s to delete it (left for the next open): %s", path, exc)
            continue
        try:
            if _locked_elsewhere(fd):
                continue
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kvtier lmdb: cannot delete emptied segment %s (left for the next open): %s", path, exc)
        finally:
            _close_quietly(fd)
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
        try:
            fcntl.flock(fd, mode)
        except OSError as exc:
            raise _io_error(exc, f"cannot lock {directory / _CREATION_LOCK}") from exc
        yield
    finally:
        os.close(fd)


def reclaim_orphans(directory: Path, committed: Callable[[], Dict[str, int]]) -> Tuple[int, int]:
    """At a writable open: delete segment files no committed record points into and truncate each
    other one to its committed end (what a crash between ``append`` and the commit left behind),
    skipping segments a live writer holds. ``committed``: reads segment name -> committed end in a
    NEW read transaction (called once, after every file it decides on is locked). Returns (files
    removed, files truncated).

    Why it cannot take a live writer's records, whatever the interleaving (W: a writer in another
    process, R: this reclaim):

    - R holds ``segments.lock`` exclusively throughout; W creates and ``flock``s every new segment
      under it shared. So each file R lists was created, and locked by its writer, before R began.
    - R takes each file's ``flock`` (non-blocking; a file whose lock is held is some writer's active
      segment and is left alone), and only then reads the committed ends, in a transaction begun
      after the last of those locks. A writer appends only to its active segment and commits every
      pointer into it before it releases the lock (``rotate`` comes after the commit; a failed
      append rotates before any commit), so every commit that will ever point into a file R holds
      has happened before R's lock, and so before R's transaction: the end R reads is final, and a
      file R finds without an entry has no committed record and never will.
    - While R holds a file's lock, nobody appends to it (names never repeat, so no writer creates
      it again) and ``remove_dead`` elsewhere leaves it for later. R truncates only bytes past the
      committed end, deletes only files without one, then drops its locks.

    Reading the ends first and locking afterwards (as before) let a writer commit into a segment
    and release it in between (its records cut off), or create, fill and release a new one (deleted
    whole)."""
    if not any(_NAME.match(name) for name in os.listdir(directory)):
        return 0, 0  # nothing to look at: no lock file created for caches without segments
    with _creation_lock(directory, fcntl.LOCK_EX):
        held: List[Tuple[str, int]] = []
        try:
            for name in segment_files(directory):
                try:
                    fd = os.open(directory / name, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    continue  # deleted meanwhile (an emptied segment)
                if _locked_elsewhere(fd):
                    os.close(fd)
                    continue
                held.append((name, fd))
            ends = committed() if held else {}
            return _reclaim(directory, held, ends)
        finally:
            for _, fd in held:
                os.close(fd)


def _reclaim(directory: Path, held: List[Tuple[str, int]], ends: Dict[str, int]) -> Tuple[int, int]:
    removed = truncated = 0
    for name, fd in held:
        end = ends.get(name)
        if end is None:
            os.unlink(directory / name)
            removed += 1
        elif os.fstat(fd).st_size > end:
            os.ftruncate(fd, end)
            os.fsync(fd)
            truncated += 1
    return removed, truncated


def committed_ends(txn: lmdb.Transaction, table: "lmdb._Database") -> Dict[str, int]:
    """segment name -> committed end offset, from the ``segments`` table."""
    out: Dict[str, int] = {}
    for k, v in txn.cursor(db=table).iternext(keys=True, values=True):
        if len(v) == LIVE.size:
            out[bytes(k).decode(errors="replace")] = LIVE.unpack(v)[2]
    return out


def adjacent_runs(extents: Sequence[int], *, lanes: int = 1) -> List[range]:
    """Split records laid out one after another (``extents`` in file order) into runs for one
    vectored I/O each: at most ``RUN_BYTES`` (a larger record alone) and ``_RUN_RECORDS``, and
    small enough that ``lanes`` runs exist when the records allow it (a small batch is not one
    I/O on one lane)."""
    limit = max(_ALIGN, min(RUN_BYTES, sum(extents) // max(1, lanes)))
    runs: List[range] = []
    start, size = 0, 0
    for k, extent in enumerate(extents):
        if k > start and (size + extent > limit or k - start >= _RUN_RECORDS):
            runs.append(range(start, k))
            start, size = k, 0
        size += extent
    if extents:
        runs.append(range(start, len(extents)))
    return runs


def _load_fallocate() -> Optional[Callable[..., int]]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong)
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()


def _fallocate(fd: int, offset: int, length: int) -> bool:
    """Linux ``fallocate(fd, 0, offset, length)`` (never glibc's ``posix_fallocate``, which writes
    zeros where the filesystem lacks it); False where unsupported, ``OSError`` (ENOSPC) otherwise."""
    if _FALLOCATE is None:
        return False
    if _FALLOCATE(fd, 0, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def _pwritev_all(fd: int, views: List[memoryview], offset: int) -> None:
    """``pwritev`` every byte of ``views`` at ``offset``, continuing after a short write."""
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "segment write made no progress")
        offset += n
        views = _advance(views, n)


def _preadv_all(fd: int, views: List[memoryview], offset: int) -> bool:
    """Fill ``views`` from ``offset``; False when the file ends first."""
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            return False
        offset += n
        views = _advance(views, n)
    return True


def _advance(views: List[memoryview], n: int) -> List[memoryview]:
    """``views`` less their first ``n`` bytes (after a short vectored read or write)."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def _io_error(exc: OSError, what: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(f"{what}: disk full: {exc}")
    return TierIOError(f"{what}: {exc}")
