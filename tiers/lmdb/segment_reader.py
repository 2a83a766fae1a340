"""Reading segment records by pointer (split from ``segments``, which keeps the files' other
primitives): ``SegmentReader`` (any thread: ``read`` a pointer's record, ``read_into`` /
``read_many_into`` a caller's buffers, ``forget`` / ``sweep`` / ``close`` its fds).

A record read in place has its head in a pooled page and its payload straight in the caller's
page-aligned buffer (``_InPlaceRead``); adjacent records of one file share one vectored read
(``_runs_in_files``); anything else is read into a pooled buffer and decoded from it.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

from kvtier.errors import CorruptRecordError, TierIOError

from ..base import ChunkMeta
from ..record_format import check_payload_in_place, decode_record, decode_split
from .segment_records import _ALIGN, _BUFFERS, _aligned, _byte_view, _round_up
from .segment_files import close_quietly
from .segments import SegmentPointer, _preadv_all, adjacent_runs

__all__ = ["SegmentReader", "MAX_OPEN_SEGMENTS"]

# Read fds a SegmentReader keeps open: 256 segments of the default 256 MiB reach 64 GiB without a
# reopen, and stay well inside the usual 1024-descriptor soft limit.
MAX_OPEN_SEGMENTS = 256


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


T = TypeVar("T")


def _outcome(fn: Callable[[], T]) -> Union[T, Exception]:
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
                    close_quietly(entry.fd)

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
            close_quietly(entry.fd)

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
                       max_raw_bytes: int) -> List[Union[ChunkMeta, Exception, None]]:
        """``read_into`` of a batch; per item its meta or the exception its read raised. Records
        read in place that lie one after another in a segment (as a batch was written) are read
        together, one vectored direct read per run of up to ``RUN_BYTES``: at 256 KiB a request
        per record leaves the disk's throughput on small requests. A run whose read fails is
        retried record by record, so each record gets its own outcome."""
        results: List[Union[ChunkMeta, Exception, None]] = [None] * len(items)
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
