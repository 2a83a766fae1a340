"""Encoded records bound for a segment file, in the memory layout the direct write takes.

Why a module of its own: ``segments`` owns the files (append, read, ledger, reclaim); this owns the
bytes in memory -- a record's head in a zero-padded pooled page, its payload either borrowed from
the caller's page-aligned buffer or copied into a pooled aligned one -- and the pool of page-aligned
buffers both sides reuse (a fresh buffer per record would page-fault and zero every page again).

Primitives: ``SegmentRecord``, ``encode_for_segments``, ``codec_of``, ``borrows_buffers``,
``release_records``; the pool ``_BUFFERS`` and the alignment helpers ``_aligned``, ``_byte_view``,
``_round_up`` (used by ``segments``). Any thread.
"""

from __future__ import annotations

import mmap
import threading
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from ..base import ChunkMeta
from ..record_format import CodecConfig, encode_record_parts, header_end_of, read_head, read_header

__all__ = ["SegmentRecord", "encode_for_segments", "codec_of", "borrows_buffers", "release_records",
           "POOLED_BUFFER_BYTES"]

_ALIGN = 4096
POOLED_BUFFER_BYTES = 256 << 20  # free aligned buffers kept for reuse (all tiers of the process)


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
        try:
            buf.close()
        except BufferError:
            pass  # a view of it is still alive (an exception's frame): the map goes with it


_BUFFERS: Optional[_BufferPool] = _BufferPool(POOLED_BUFFER_BYTES)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


def _aligned(view: memoryview) -> bool:
    """Whether direct I/O may use ``view`` as it is: its first byte on a page boundary."""
    return view.nbytes > 0 and _address(view) % _ALIGN == 0


def _byte_view(data: "bytes | bytearray | memoryview") -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class SegmentRecord:
    """An encoded record bound for a segment, as the direct write takes it: its head (prefix +
    header) in a zero-padded pooled page, and its payload either *borrowed* -- the caller's own
    page-aligned buffer (a host slot, a raw record), written straight from there -- or copied into
    a pooled page-aligned buffer (compressed planes, or a buffer off a page boundary). A payload
    whose length is not a whole number of pages has its last partial page copied into a padded
    pooled page. ``len`` is the record's length; ``release`` returns the pooled buffers (after the
    batch committed: nothing reads them again) and drops the borrowed view.

    A borrowed payload is read by the segment writer after ``put_many`` handed the batch over, so
    the caller's buffer must not change until the put has ended -- ``put_many``'s buffer rule, kept
    by waiting for the batch's write even when the call is cancelled."""

    __slots__ = ("head", "_length", "_pages", "_borrowed")
    _pages: Optional[mmap.mmap]  # None once released

    def __init__(self, head: bytes, payload: Sequence["bytes | bytearray | memoryview"]) -> None:
        assert _BUFFERS is not None
        self.head = head
        views = [_byte_view(part) for part in payload]
        n = sum(v.nbytes for v in views)
        self._length = len(head) + n
        self._borrowed: Optional[memoryview] = None
        head_bytes = _round_up(len(head))
        if len(views) == 1 and _aligned(views[0]) and n >= _ALIGN:
            whole = n - n % _ALIGN
            self._borrowed = views[0][:whole]
            tail = views[0][whole:]
            self._pages = _BUFFERS.take(head_bytes + _round_up(tail.nbytes))
            self._pages[head_bytes : head_bytes + tail.nbytes] = tail
            self._pages[head_bytes + tail.nbytes :] = bytes(len(self._pages) - head_bytes - tail.nbytes)
        else:
            self._pages = _BUFFERS.take(head_bytes + _round_up(n))
            at = head_bytes
            for v in views:
                self._pages[at : at + v.nbytes] = v
                at += v.nbytes
            self._pages[at:] = bytes(len(self._pages) - at)  # no stale bytes on disk
        self._pages[: len(head)] = head
        self._pages[len(head) : head_bytes] = bytes(head_bytes - len(head))

    @staticmethod
    def of_bytes(record: "bytes | memoryview") -> "SegmentRecord":
        """A record given as one run of bytes (``encode_record``'s, or one read back to move it)."""
        view = _byte_view(record)
        end = header_end_of(view)
        return SegmentRecord(bytes(view[:end]), [view[end:]])

    def __len__(self) -> int:
        return self._length

    @property
    def borrows(self) -> bool:
        """Whether the write reads the caller's buffer (until the batch's put has ended)."""
        return self._borrowed is not None

    def iovecs(self) -> List[memoryview]:
        """The record's extent as page-aligned pieces, in file order (head page(s), payload)."""
        assert self._pages is not None, "released"
        pages = memoryview(self._pages)
        head_bytes = _round_up(len(self.head))
        if self._borrowed is None:
            return [pages]
        out = [pages[:head_bytes], self._borrowed]
        if len(pages) > head_bytes:
            out.append(pages[head_bytes:])
        return out

    def codec(self) -> str:
        return read_head(self.head, self._length).codec

    def release(self) -> None:
        """Back to the pool now (the record is durable and committed; nothing reads it again).
        Not left to ``__del__`` alone: a batch's records may wait in a reference cycle until the
        next garbage collection, and a fresh buffer for each batch costs its page faults again."""
        pages, self._pages = self._pages, None
        self._borrowed = None
        if pages is not None and _BUFFERS is not None:  # None only while the interpreter shuts down
            _BUFFERS.give(pages)

    def __del__(self) -> None:
        self.release()


def codec_of(record: "bytes | SegmentRecord") -> str:
    """The codec of an encoded record, inline or bound for a segment."""
    return record.codec() if isinstance(record, SegmentRecord) else read_header(record).codec


def borrows_buffers(records: Iterable["bytes | SegmentRecord"]) -> bool:
    """Whether any of an encoded batch's records will be written straight from a caller's buffer."""
    return any(isinstance(r, SegmentRecord) and r.borrows for r in records)


def release_records(records: Iterable["bytes | SegmentRecord"]) -> None:
    """After a successful commit: return the segment records' buffers to the pool."""
    for record in records:
        if isinstance(record, SegmentRecord):
            record.release()


def encode_for_segments(key: bytes, meta: ChunkMeta, raw: "bytes | memoryview", codec: CodecConfig,
                        threshold: int) -> "bytes | SegmentRecord":
    """``encode_record``, giving a record of at least ``threshold`` bytes (one bound for a segment)
    as a ``SegmentRecord`` (a raw payload in a page-aligned buffer is borrowed, not copied)
    instead of a fresh ``bytes``."""
    parts = encode_record_parts(key, meta, raw, codec)
    length = sum(memoryview(p).nbytes for p in parts)
    if length < threshold:
        return b"".join(parts)
    prefix, body, digest, *payload = parts
    return SegmentRecord(b"".join((prefix, body, digest)), payload)
