"""The LMDB tier's reader side: the read pool and the read path.

``ReaderSide`` owns the read pool (``read_workers`` threads), which runs read transactions and
decodes records straight from ``txn.get(key)`` (``buffers=True``) into the caller's buffers while
the transaction is open (segment records are read by the ``SegmentReader``, direct reads, on the
same threads), and the encode pool (``encode_threads``), which encodes put batches off the loop
(zstd, checksums). Its methods are called from any thread but the writer (``get_many_into`` and
``in_pool`` on the event-loop thread); they never write: a record found corrupt is handed to
``on_corrupt`` (the facade queues its quarantine on the writer thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import lmdb
import xxhash

from kvtier.errors import ClosedError, CorruptRecordError, RecordSizeMismatchError

from ..base import ChunkMeta, GetItem, PutItem
from ..codec_pool import MIN_SLICE_BYTES, map_slices, wait_threads
from ..record_format import CodecConfig, decode_record, encode_record
from .environment import LmdbEnv
from .readahead import advise_willneed
from .segment_reader import SegmentReader
from .segment_records import encode_for_segments
from .segments import adjacent_runs, is_pointer, split_extent

__all__ = ["ReaderSide", "CorruptEntry"]

log = logging.getLogger(__name__)

# Slices a put batch's encode is cut into, at most: encoding is CPU work, where a slice beyond the
# cores only adds a thread hop (the read threads exist for the I/Os in flight, not for this).
ENCODE_SLICES = 4


def encode_threads(read_workers: int) -> int:
    """Threads that encode put batches: as many as the read threads, but no more than the cores
    this process may run on. Sharing the read pool's 8 threads, the slices of every batch in
    flight ran at once on 2 cores, so the first batch's encode ended only with the others' and its
    direct writes began that late; on no more threads than cores, taken in order, the first
    batch is encoded first. Reads never queue behind an encode either."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(read_workers, cores))


T = TypeVar("T")
R = TypeVar("R")
# (key, xxh3 of the stored value, why): a record a read found bad, quarantined only if the key
# still holds that value.
CorruptEntry = Tuple[bytes, int, str]


def _nbytes(buf: object) -> int:
    try:
        return memoryview(buf).nbytes  # type: ignore[arg-type]
    except TypeError:  # not a buffer: its read fails alone, it weighs like a small record
        return 1


class ReaderSide:
    """The read pool and what runs on it (see the module docstring). Any thread but the writer;
    ``get_many_into`` / ``in_pool`` / ``encode`` on the event-loop thread."""

    def __init__(self, db: LmdbEnv, segment_reader: SegmentReader, *, read_workers: int, max_raw_bytes: int,
                 on_corrupt: Callable[[List[CorruptEntry]], None]) -> None:
        self._db = db
        self._count = db.counters.count
        self.segment_reader = segment_reader
        self.read_workers = read_workers
        self.max_raw_bytes = max_raw_bytes
        self._on_corrupt = on_corrupt
        self._pool = ThreadPoolExecutor(max_workers=read_workers, thread_name_prefix="kvtier-lmdb-read")
        self._encoders = ThreadPoolExecutor(max_workers=encode_threads(read_workers),
                                            thread_name_prefix="kvtier-lmdb-encode")

    def _closed(self) -> ClosedError:
        return ClosedError(f"LmdbTier at {self._db.path} is closed")

    def shutdown(self) -> None:
        """Wait for the running reads and encodes (closing thread)."""
        self._pool.shutdown(wait=True)
        self._encoders.shutdown(wait=True)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the read pool, unawaited (any thread); ``ClosedError`` once closing."""
        try:
            self._pool.submit(fn)
        except RuntimeError as exc:  # shut down by close()
            raise self._closed() from exc

    async def in_pool(self, fn: Callable[[], T]) -> T:
        """``fn`` on the read pool (event-loop thread). Cancelling drops the answer only."""
        loop = asyncio.get_running_loop()
        try:
            cf = loop.run_in_executor(self._pool, fn)
        except RuntimeError as exc:  # shut down by close()
            raise self._closed() from exc
        return await cf

    def map_or_here(self, fn: Callable[[T], R], items: Sequence[T]) -> List[R]:
        """``fn`` of each item on the read pool (several in flight), or on this thread once the
        pool is shut down (closing). Any thread but a pool thread."""
        try:
            return list(self._pool.map(fn, items))
        except RuntimeError:  # the pool is shut down: closing, the last step reads alone
            return [fn(item) for item in items]

    def encode(self, batch: List[PutItem], codec: CodecConfig, threshold: Optional[int]
               ) -> "concurrent.futures.Future[List[Tuple[bytes, bytes]]]":
        """Encode a put batch on the pool, in slices (event-loop thread); the future's result is
        the (key, record) pairs in order. A record for a segment may borrow the caller's buffer
        (``segment_records.encode_for_segments``)."""
        try:
            return map_slices(
                self._encoders,
                lambda part: [(key, encode_record(key, meta, raw, codec) if threshold is None
                               else encode_for_segments(key, meta, raw, codec, threshold)) for key, meta, raw in part],
                batch,
                [memoryview(raw).nbytes for _, _, raw in batch],
                workers=min(self.read_workers, ENCODE_SLICES),
                min_slice_bytes=MIN_SLICE_BYTES,
            )
        except RuntimeError as exc:  # the pool is shut down: close() ran
            raise self._closed() from exc

    async def get_many_into(self, checked: List[GetItem]) -> List[Optional[ChunkMeta]]:
        """Decode each record into its buffer, the batch split into slices of one read run each
        (``segments.adjacent_runs`` of the records' extents, at least ``read_workers`` of them),
        one read transaction each, that the read pool's threads take in turn (event-loop thread).
        Cancelling it: slices not yet started are abandoned, running ones finish into the buffers,
        and only then does it re-raise ``CancelledError``."""
        sizes = [_nbytes(buf) for _, buf in checked]
        # A slice is cut where the segment reader would cut its vectored read (a record's extent:
        # its head page, then its payload pages), so a batch written in order is read with one
        # preadv a slice: slices of plain bytes straddled runs and cost a second, short read
        # (and, in a busy process, a second wait for the GIL). Several slices per worker: one
        # that finishes takes the next, so the batch does not wait on its slowest quarter.
        ranges = adjacent_runs([split_extent(size) for size in sizes], lanes=self.read_workers)
        try:
            reading = map_slices(
                self._pool,
                self._read_slice,
                checked,
                sizes,
                workers=len(ranges),
                min_slice_bytes=1,
                ranges=ranges,
            )
        except RuntimeError as exc:  # the pool is shut down: close() ran
            raise self._closed() from exc
        return await wait_threads(reading, abandon_unstarted=True)

    def _read_slice(self, items: List[GetItem]) -> List[Optional[ChunkMeta]]:
        """Read pool: one read transaction for ``items``; counts, and hands the corrupt ones on."""
        corrupt: List[CorruptEntry] = []
        max_raw_bytes = self.max_raw_bytes

        def body(txn: "lmdb.Transaction[memoryview]") -> List[Optional[ChunkMeta]]:
            results: List[Optional[ChunkMeta]] = []
            corrupt.clear()
            records = [txn.get(key, db=self._db.tables.chunks) for key, _ in items]
            # the whole slice's pages in flight
            advise_willneed(r for r in records if r is not None and not is_pointer(r))
            if self._db.lockless:  # a writer may reuse these pages mid-read: check only a private copy
                records = [None if r is None else memoryview(bytes(r)) for r in records]
            # segment records first, all together (adjacent ones share a read); outcomes by index
            in_segments = [(i, r) for i, r in enumerate(records) if r is not None and is_pointer(r)]
            outcomes = dict(zip((i for i, _ in in_segments), self.segment_reader.read_many_into(
                [(items[i][0], r, items[i][1]) for i, r in in_segments], max_raw_bytes=max_raw_bytes)))
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
                        meta, _ = decode_record(key, record, buf, max_raw_bytes=max_raw_bytes)
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

        results = self._db.read_txn(body)
        if corrupt:
            corrupt[:] = self.still_stored(corrupt)
        hits = sum(1 for r in results if r is not None)
        self._count(gets=len(items), hits=hits, misses=len(items) - hits, corrupt=len(corrupt))
        if corrupt:
            for key, _, reason in corrupt:
                log.warning("kvtier lmdb: corrupt record %s in %s: %s", key.hex(), self._db.path, reason)
            self._on_corrupt(list(corrupt))
        return results

    def still_stored(self, corrupt: List[CorruptEntry]) -> List[CorruptEntry]:
        """Of the records a read found bad, those whose key still holds the same value. A pointer
        read just before its segment file was deleted (the key deleted, evicted or overwritten
        meanwhile, by this process or another) finds the file gone: a plain miss, not corruption
        to count, log or quarantine. Any thread but the writer."""

        def body(txn: lmdb.Transaction) -> List[CorruptEntry]:
            out = []
            for entry in corrupt:
                current = txn.get(entry[0], db=self._db.tables.chunks)
                if current is not None and xxhash.xxh3_64_intdigest(current) == entry[1]:
                    out.append(entry)
            return out

        return self._db.read_txn(body)
