"""Large records out of LMDB: append-only payload segment files beside ``data.mdb``.

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
- power loss: segment data and a new segment's directory entry are synced before the commit; a
  new segment becomes the active one only once its name is synced (a failed sync is
  ``TierIOError``, the file is removed and never appended to); a batch's ``fdatasync`` runs on the writer's
  sync thread once its direct writes are done, and after one failed, every later batch of that
  segment fails too: the error is reported to one sync of the open file only);
- space returns by segment: the ``segments`` table holds each segment's live bytes, records and
  committed end, changed in the same transaction as the pointers; a segment whose live records
  drop to 0 is deleted after the commit, unless a writer still holds its ``flock`` (its active
  segment, in this or another process). A closed segment left mostly dead is compacted
  (``compaction``: its live records move to the active segment, each pointer replaced only where
  the key still holds the old one; the emptied file goes once no older read transaction is open).
  Nothing after a commit can fail it: a file that cannot be deleted is logged and left to the next
  open. Readers close a deleted segment's fd as soon as no read of theirs uses it, so its space
  comes back; at most ``MAX_OPEN_SEGMENTS`` fds stay cached.
- several processes: each writer appends only to its own segment (named by pid and a number from
  the directory's counter in LMDB, so a name never repeats; created ``O_EXCL``, ``flock``'d while
  active); readers open segments by name and check, before each read, that a cached fd is still
  the file the name leads to (device and inode).

A read that took a pointer just before the segment was deleted (its last record evicted or
deleted meanwhile) and had not opened the file yet is a plain miss: the tier looks again in a
fresh transaction and finds the key gone or rewritten, so it counts, logs and quarantines nothing.
A segment is created and locked under a shared lock of ``segments.lock`` and ``reclaim_orphans``
scans under its exclusive lock, so an open never takes another process's segment in the instant
between its create and its ``flock``; it locks each file before it reads the committed ends, so a
live writer's commits are never cut off (``reclaim_orphans`` says why, interleaving by interleaving).

Primitives: ``SegmentPointer`` (the 32-byte value in ``chunks``; 28 bytes in the first layout),
``SegmentWriter`` (writer thread only: ``append`` a batch of ``segment_records.SegmentRecord``, in
runs of adjacent records -- or ``begin`` it, do other work while its direct writes run, and
``finish`` it -- and ``rotate``), ``PendingAppend`` (a begun batch), ``segment_reader.SegmentReader`` (any thread: ``read`` a
pointer's record, ``read_into`` / ``read_many_into`` a caller's buffers; its own module),
``Ledger`` (inside one write transaction: live-byte deltas into ``segments``); a file's life --
``remove_dead`` and ``reclaim_orphans`` (writer thread / open), ``held_by_writer`` and
``segment_files`` (any thread) -- is ``segment_files``'s, and ``SegmentReader.sweep`` (the tier's timer: fds of segments another process deleted).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import lmdb

from kvtier.errors import CorruptRecordError, TierFullError, TierIOError

from ..files.layout import fsync_dir
from ..record_format import MAX_HEADER_BYTES
from .segment_files import close_quietly, creation_lock, io_error
from .segment_records import (  # SegmentRecord .. release_records: re-exported (__all__)
    _ALIGN,
    SegmentRecord,
    _round_up,
    borrows_buffers,
    codec_of,
    encode_for_segments,
    release_records,
)

__all__ = [
    "SegmentPointer",
    "SegmentWriter",
    "PendingAppend",
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
    "write_runs",
    "split_extent",
    "RUN_BYTES",
    "WRITE_RUN_BYTES",
    "WRITES_IN_FLIGHT",
    "DEFAULT_SEGMENT_MAX_BYTES",
    "DEFAULT_SEGMENT_THRESHOLD_BYTES",
    "check_segment_threshold",
    "free_bytes",
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
# A direct *write* covers adjacent records up to this many bytes (a 64 MiB batch: one pwritev per
# lane). Every return from a pwritev waits for the GIL, and in a serving process the GIL is held by
# its scheduler and tokenizer threads, up to the 5 ms switch interval at a time, while the lane's
# share of the disk queue sits empty: fewer, larger writes wait fewer times. Measured (256 MiB
# O_DIRECT over 4 threads, into allocated blocks, then fdatasync; median of 4): beside two CPU-bound
# Python threads 374 MB/s in 4 MiB writes, 668 MB/s in 16 MiB ones; quiet 1733 / 1787 MB/s.
WRITE_RUN_BYTES = 16 << 20
_RUN_RECORDS = max(1, (os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024) // 3)
DEFAULT_SEGMENT_MAX_BYTES = 256 << 20
# Records of at least this many encoded bytes go to segments by default (LmdbTier, EngineConfig, the
# vLLM tier): measured (`python -m kvtier.tools.bench.segments --sizes-kib 16,64,128,256`, five runs,
# docs/ARCHITECTURE.md), segments write 1.06-1.55x the inline tier at 128 KiB and 1.54-2.13x at
# 256 KiB, but 0.62-0.84x at 64 KiB and 0.38-0.53x at 16 KiB (one LMDB transaction beats an extra
# aligned file write and its fdatasync for small records).
DEFAULT_SEGMENT_THRESHOLD_BYTES = 128 << 10
WRITES_IN_FLIGHT = 4  # direct writes in flight per batch (the bench's O_DIRECT limit writes as many)
# A put batch allocates blocks for the ones after it (``SegmentWriter._allocate_batch``): this many
# batches of its size when it is begun alone (the spill keeps up to 4 batches in flight), the rest
# of its segment when it is begun behind another; unless the filesystem has less than
# PREALLOCATE_FREE_FACTOR times that free (then only its own blocks, so a full disk still fails
# just the batch that does not fit, before any byte of it is written).
ALLOCATE_AHEAD_BATCHES = 4
PREALLOCATE_FREE_FACTOR = 2
# Once the active segment is this full, its successor is created ahead (``SegmentWriter``'s spare):
# by then a put's commit has usually taken its number already, so preparing it costs the writer
# thread no transaction of its own.
SPARE_AT_FRACTION = 0.5


def _no_hook(_op: str) -> None:
    pass


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
    writer, skipping names that exist.

    Once the active segment is half full its successor (the *spare*) is created, locked and
    name-synced on an opener thread of its own, so a rotation only switches to it; the spare is
    empty until then (no pointer can name it), and ``close`` removes one never used."""

    def __init__(self, directory: Path, max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES,
                 numbers: Optional[Callable[[], int]] = None) -> None:
        self._dir = directory
        self._max_bytes = max_bytes
        self._numbers = numbers
        self._pid = os.getpid()
        self._counter = -1
        self._fd: Optional[int] = None
        self._end = 0
        self._allocated = 0  # the active segment's bytes with blocks allocated (from its start)
        self._allocate = True  # False once fallocate is unsupported on the active segment's filesystem
        # The last batch begun in the active segment: its unused allocated tail is given back once
        # that batch has ended (truncating waits for the direct writes in flight to the file).
        self._last: Optional["PendingAppend"] = None
        self._newest: Optional["PendingAppend"] = None  # the last batch begun in any segment
        self.direct: Optional[bool] = None  # whether the active segment took O_DIRECT
        # The next segment, created, locked and name-synced on the opener thread while this one
        # fills: (its number, the future of its (fd, direct), None where the name existed).
        self._spare: Optional[Tuple[int, "Future[Optional[Tuple[int, bool]]]"]] = None
        self._opener: Optional[ThreadPoolExecutor] = None  # runs only _create_locked
        self._lanes: Optional[ThreadPoolExecutor] = None  # the direct writes' threads (never state)
        # One thread runs each batch's fdatasync once its writes are done, in that order, so the
        # writer thread meanwhile begins the next batches and commits the ones already synced.
        self._syncer: Optional[ThreadPoolExecutor] = None
        # Segments whose fdatasync failed once (sync thread): no later batch in them is durable,
        # even when its own sync returns 0 (the kernel reports a writeback error only once per
        # open file, and every batch's descriptor is a dup of one).
        self._sync_failed: Set[str] = set()
        # Called with "write" before each direct write (on its lane thread) and "sync" before each
        # fdatasync (on the sync thread): a test's point to observe, hold or fail the payload I/O.
        self.hook: Callable[[str], None] = _no_hook

    @property
    def active(self) -> Optional[str]:
        return segment_name(self._pid, self._counter) if self._fd is not None else None

    @property
    def spare(self) -> Optional[str]:
        """The name of the next segment, when it is being created or was created ahead (empty,
        locked by this writer, no pointer names it): the next rotation makes it the active one."""
        return segment_name(self._pid, self._spare[0]) if self._spare is not None else None

    def _next_number(self) -> int:
        return self._numbers() if self._numbers is not None else self._counter + 1

    def _open_next(self) -> None:
        """Make the next segment the active one: the spare prepared ahead when there is one (its
        errors raised now), else created, locked and name-synced here. Any failure is
        ``TierIOError`` / ``TierFullError`` and leaves no active segment (``_create_locked``)."""
        while True:
            spare, self._spare = self._spare, None
            if spare is not None:
                number, created = spare
                opened = created.result()
            else:
                number = self._next_number()  # an LMDB write: never under segments.lock
                opened = self._create_locked(number)
            if opened is None:
                self._counter = number
                continue  # a file the numbering did not know of (a reused pid): the next number
            fd, self.direct = opened
            self._fd, self._counter, self._end, self._allocate = fd, number, 0, True
            self._allocated, self._last = 0, None
            return

    def _create_locked(self, number: int) -> Optional[Tuple[int, bool]]:
        """Create, lock and name-sync segment ``number``: (fd, whether it took O_DIRECT), or None
        when the name exists. A file whose directory entry was not synced is never appended to (a
        power cut could lose its name while LMDB kept pointers into it): a failed lock or sync
        removes it and raises ``TierIOError`` (or, failing the removal, leaves it without an entry
        in ``segments``: an orphan the next writable open deletes). Any thread: it touches no
        state of the writer."""
        path = self._dir / segment_name(self._pid, number)
        with creation_lock(self._dir, fcntl.LOCK_SH):
            created = self._create(path)
            if created is None:
                return None
            fd = created[0]
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # "still being appended": nobody deletes or truncates it
                fsync_dir(str(self._dir))  # the name survives a power cut before any pointer to it commits
            except OSError as exc:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise io_error(exc, f"cannot lock and sync new segment {path}") from exc
        return created

    def _prepare_spare(self) -> None:
        """Writer thread: take the next segment's number and create its file on the opener thread,
        so the rotation that needs it makes none of those calls. Beside a serving process's
        CPU-bound threads each of them (the create, the lock, the directory's fsync) returns
        behind the GIL, and the rotation held the writer, and the first direct writes of the
        batch that rotated, for 80-220 ms. A numbering that fails here is left to the rotation,
        which takes its number itself and raises then."""
        try:
            number = self._next_number()
        except (TierIOError, TierFullError):
            return
        if self._opener is None:
            self._opener = ThreadPoolExecutor(1, thread_name_prefix="kvtier-segment-open")
        self._spare = (number, self._opener.submit(self._create_locked, number))

    def _drop_spare(self) -> None:
        """Remove the spare's file (empty, locked by this writer: no pointer ever named it); its
        number stays unused, a gap. A spare whose creation failed has nothing to remove."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        number, created = spare
        try:
            opened = created.result()
        except (TierIOError, TierFullError):  # a failed creation removed its file or left an orphan
            return
        if opened is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._dir / segment_name(self._pid, number))
            close_quietly(opened[0])

    def _create(self, path: Path) -> Optional[Tuple[int, bool]]:
        """``O_EXCL`` create (O_DIRECT where the filesystem takes it): (fd, whether it took
        O_DIRECT); ``None`` when the name exists."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600), hasattr(os, "O_DIRECT")
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                return os.open(path, flags, 0o600), False  # tmpfs and others refuse O_DIRECT
        except FileExistsError:
            return None
        except OSError as exc:
            raise io_error(exc, f"cannot create segment {path}") from exc

    def rotate(self) -> None:
        """Close the active segment (its lock goes with it); the next append starts a new one. Blocks
        allocated past its last batch are given back (the file truncated to its end) once that
        batch's writes and sync have ended. Never raises: it runs after commits (``remove_dead``),
        and a failed ``close`` still releases the descriptor and its lock."""
        fd, self._fd = self._fd, None
        last, self._last = self._last, None
        if fd is None:
            return
        if self._allocated <= self._end:
            try:
                os.close(fd)
            except OSError as exc:
                log.warning("kvtier lmdb: closing segment %s failed: %s", self._dir, exc)
            return
        end = self._end

        def trim(_done: object = None) -> None:
            try:
                os.ftruncate(fd, end)
            except OSError as exc:  # the next writable open truncates it (bytes past the committed end)
                log.warning("kvtier lmdb: giving back a segment's unused blocks in %s failed: %s", self._dir, exc)
            finally:
                close_quietly(fd)

        if last is None:
            trim()
        else:  # on the thread that ends the batch (its sync, or its failed write): no write in flight then
            last.durable.add_done_callback(trim)

    def _allocate_batch(self, end: int, ahead: bool) -> None:
        """Allocate blocks up to ``end`` before the batch's direct writes (``fallocate``), so they
        land inside the file's size: extending direct writes to one file are serialised by the
        filesystem (ext4 takes the inode lock exclusively for them), writes into allocated blocks
        run side by side (measured here, 4 in flight: 1.2-1.4 GB/s extending, 1.5-1.7 GB/s
        allocated). A full disk shows here, before any byte of the batch is written. Where the
        filesystem has no ``fallocate`` the writes just extend the file.

        ``ahead`` (puts): blocks for the batches after this one are allocated with its own, because
        ext4's ``fallocate`` first waits for every direct write in flight to the file: allocating
        batch by batch held the writer thread, and the next batch's writes, until the batch before
        was written (20-60 ms a 64 MiB batch here; the disk queue drained at every batch). A batch
        begun with nothing in flight allocates ``ALLOCATE_AHEAD_BATCHES`` batches of its size; one
        begun while another is in flight (then the wait cannot be avoided) the rest of the segment;
        either at most the segment's size plus one batch, for the batch that crosses it. So a
        stream of puts waits at most once a segment. Compaction's moves allocate exactly their
        extents. The unused tail goes back at ``rotate``."""
        assert self._fd is not None
        if not self._allocate or end <= self._allocated:
            return
        start = max(self._end, self._allocated)
        upto = end
        if ahead:  # (begun below the segment's size: end < max + extent, so wanted >= end)
            extent = end - self._end
            streaming = self._newest is not None and not self._newest.durable.done()
            wanted = self._max_bytes + extent
            if not streaming:
                wanted = min(wanted, self._end + ALLOCATE_AHEAD_BATCHES * extent)
            if (free_bytes(self._dir) or 0) >= (wanted - start) * PREALLOCATE_FREE_FACTOR:
                upto = wanted
        try:
            self._allocate = _fallocate(self._fd, start, upto - start)
        except OSError:
            if upto == end:
                raise
            # No room ahead after all: the batch's own blocks, or its TierFullError. The failed
            # call may have allocated (and grown the file) part of the way: rotate gives it back.
            self._allocate = _fallocate(self._fd, start, end - start)
            upto = max(end, os.fstat(self._fd).st_size)
        self._allocated = upto

    def append(self, records: Sequence["SegmentRecord | bytes"]) -> List[SegmentPointer]:
        """Write ``records`` one after another at page-aligned offsets (each record's head page,
        then its payload pages) and ``fdatasync``; raises ``TierFullError`` / ``TierIOError``
        (then nothing committed points at the bytes). ``bytes`` records (one run of a record's
        bytes) are laid out the same way. ``begin`` then ``finish``, waiting in between."""
        pending = self.begin(records)
        try:
            return self.finish(pending)
        finally:
            pending.release()

    def begin(self, records: Sequence["SegmentRecord | bytes"], *, ahead: bool = False) -> "PendingAppend":
        """Lay ``records`` out after everything begun so far, allocate their blocks (``ahead``: and
        blocks for the batches after them, ``_allocate_batch``) and start their direct writes on
        the lane threads; returns at once. ``finish`` waits for them and syncs.
        The batch's range is reserved whatever becomes of it, so a batch begun while this one is
        in flight, or appended after it failed, never overwrites its bytes. The ``PendingAppend``
        holds its own descriptor of the segment (and with it the segment's ``flock``) until
        ``release``: a rotation meanwhile never closes the file under its writes, and no open
        reclaims its bytes as an orphan before their pointers commit. Raises like ``append``."""
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
            self._allocate_batch(pos, ahead)
            fd = os.dup(self._fd)
        except OSError as exc:
            self.rotate()
            raise io_error(exc, f"segment write under {self._dir} failed") from exc
        self._end = pos
        if self._spare is None and pos >= self._max_bytes * SPARE_AT_FRACTION:
            # Before this batch's writes: a number taken in a transaction of its own then commits
            # while no byte of the batch is in flight.
            self._prepare_spare()
        runs = write_runs([p.extent for p in pointers], lanes=WRITES_IN_FLIGHT)
        if self._lanes is None:
            self._lanes = ThreadPoolExecutor(WRITES_IN_FLIGHT, thread_name_prefix="kvtier-segment-write")
            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-segment-sync")
        lanes = [runs[k::WRITES_IN_FLIGHT] for k in range(min(len(runs), WRITES_IN_FLIGHT))]
        futures = [self._lanes.submit(self._write_runs, fd, placed, pointers, lane) for lane in lanes]
        pending = PendingAppend(fd, pointers, futures)
        pending.when_written(self._queue_sync)
        self._last = self._newest = pending
        return pending

    def _queue_sync(self, pending: "PendingAppend") -> None:
        """Once every direct write of ``pending`` succeeded (on the lane thread that finished
        last): its ``fdatasync`` goes to the sync thread."""
        assert self._syncer is not None
        try:
            self._syncer.submit(pending.run_sync, self._sync)
        except RuntimeError as exc:  # shut down by close(): no sync, so never durable
            pending.durable.set_exception(OSError(errno.EIO, f"segment writer closed before the sync: {exc}"))

    def _sync(self, pending: "PendingAppend") -> None:
        """Sync thread: ``fdatasync`` of ``pending``'s segment, unless an earlier sync of that
        segment failed (then this batch fails too: the kernel reported that error to the earlier
        call only, so a 0 here would not mean these bytes are on disk)."""
        name = pending.pointers[0].name if pending.pointers else ""
        if name in self._sync_failed:
            raise OSError(errno.EIO, f"an earlier fdatasync of segment {name} failed")
        try:
            self.hook("sync")
            os.fdatasync(pending.fd)
        except OSError:
            self._sync_failed.add(name)
            raise

    def finish(self, pending: "PendingAppend") -> List[SegmentPointer]:
        """Wait until ``pending``'s direct writes are all done (none may still be in flight once
        the batch is given up) and its ``fdatasync`` (the sync thread's) succeeded; returns its
        pointers, which may then be committed. A failure rotates (if the batch's segment is still
        the active one: later appends go to a fresh file) and raises ``TierFullError`` /
        ``TierIOError``. Writer thread."""
        try:
            pending.wait_durable()
        except OSError as exc:
            # The tail may hold part of the batch: never append there again; reclaim_orphans
            # truncates it later.
            self._give_up(pending)
            raise io_error(exc, f"segment write under {self._dir} failed") from exc
        except BaseException:
            self._give_up(pending)  # same reasoning for any other failure of a lane
            raise
        return pending.pointers

    def _give_up(self, pending: "PendingAppend") -> None:
        if pending.pointers and self.active == pending.pointers[0].name:
            self.rotate()

    def _write_runs(self, fd: int, records: Sequence[SegmentRecord], pointers: Sequence[SegmentPointer],
                    lane: Iterable[range]) -> None:
        """One in-flight lane (up to ``WRITES_IN_FLIGHT`` of them: one queue of direct writes leaves
        the disk idle between them): each run of adjacent records in one ``pwritev`` of its pages."""
        for run in lane:
            self.hook("write")
            _pwritev_all(fd, [piece for k in run for piece in records[k].iovecs()], pointers[run.start].offset)

    def close(self) -> None:
        self.rotate()
        self._drop_spare()
        if self._opener is not None:
            self._opener.shutdown(wait=True)
            self._opener = None
        if self._lanes is not None:
            self._lanes.shutdown(wait=True)  # the last writes queue their syncs first
            self._lanes = None
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None


class PendingAppend:
    """One batch's direct writes in flight (``SegmentWriter.begin``): its own descriptor of the
    segment, its pointers (not to be committed before ``SegmentWriter.finish`` returned them),
    the lanes' futures, and ``durable``, done once the batch's ``fdatasync`` returned (or with
    the first failure: of a write, or of the sync). ``release`` (after the commit of its
    pointers, or after giving up) closes the descriptor; idempotent."""

    def __init__(self, fd: int, pointers: List[SegmentPointer], futures: List["Future[None]"]) -> None:
        self.fd = fd
        self.pointers = pointers
        self.futures = futures
        self.durable: "Future[None]" = Future()
        self._released = False

    def when_written(self, then: Callable[["PendingAppend"], None]) -> None:
        """Call ``then(self)`` once every write succeeded (on the thread that finished the last
        one); a failed write completes ``durable`` with it instead."""
        left = [len(self.futures)]
        lock = threading.Lock()

        def one_done(_fut: "Future[None]") -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                self.wait_written()
            except BaseException as exc:  # noqa: BLE001 - the batch's outcome, raised by finish
                self.durable.set_exception(exc)
                return
            then(self)

        if not self.futures:
            then(self)
        for fut in self.futures:
            fut.add_done_callback(one_done)

    def run_sync(self, sync: Callable[["PendingAppend"], None]) -> None:
        """Sync thread: ``sync(self)``, its outcome into ``durable``."""
        try:
            sync(self)
        except BaseException as exc:  # noqa: BLE001 - the batch's outcome, raised by finish
            self.durable.set_exception(exc)
        else:
            self.durable.set_result(None)

    def wait_written(self) -> None:
        """Wait for every lane (none is left running), then raise the first lane's failure, if
        any. Any thread; the bytes are written, not yet synced (``SegmentWriter.finish`` syncs)."""
        first: Optional[BaseException] = None
        for fut in self.futures:
            failed = fut.exception()
            if failed is not None and first is None:
                first = failed
        if first is not None:
            raise first

    def wait_durable(self) -> None:
        """Wait until the batch is synced; raise its first failure. Every write has ended then."""
        self.wait_written()
        self.durable.result()

    def release(self) -> None:
        if not self._released:
            self._released = True
            for fut in self.futures:  # never close the descriptor under a write still in flight
                fut.exception()
            self.durable.exception()  # nor under its fdatasync
            try:
                os.close(self.fd)
            except OSError as exc:
                log.warning("kvtier lmdb: closing a segment descriptor failed: %s", exc)


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


def split_extent(payload_nbytes: int) -> int:
    """The segment bytes of a split record (``SegmentPointer.extent``) whose payload is
    ``payload_nbytes``, its head taking one page (every header of a KV chunk does)."""
    return _ALIGN + _round_up(payload_nbytes)


def write_runs(extents: Sequence[int], *, lanes: int) -> List[range]:
    """Split a batch's records (``extents`` in file order) into runs for one vectored direct write
    each, balanced over ``lanes``: a multiple of ``lanes`` runs (runs per lane: the whole number
    nearest to the batch's bytes over ``lanes * WRITE_RUN_BYTES``, at least 1), each ending at the
    record where the batch's bytes so far first reach its share, and at most ``_RUN_RECORDS``
    records; a batch of no more records than that is written a record a run. Dealt round-robin,
    every lane then writes about as many bytes: runs cut at a fixed bound leave some lanes a run
    more (16 records of 4 MiB plus a head page fit 3 to a 16 MiB run: 6 runs, so two lanes wrote
    twice as long as the others)."""
    total = sum(extents)
    unit = lanes * WRITE_RUN_BYTES
    count = lanes * max(1, (total + unit // 2) // unit)
    if len(extents) <= count:  # a small batch: every record its own write, side by side
        return [range(k, k + 1) for k in range(len(extents))]
    runs: List[range] = []
    start, done = 0, 0
    for k, extent in enumerate(extents):
        if k > start and k - start >= _RUN_RECORDS:
            runs.append(range(start, k))
            start = k
        done += extent
        if done * count >= total * (len(runs) + 1):  # this run's share of the batch is reached
            runs.append(range(start, k + 1))
            start = k + 1
    if start < len(extents):
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


def free_bytes(directory: Path) -> Optional[int]:
    """Bytes free for this user on the filesystem of ``directory`` (``None`` when it cannot tell)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


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
