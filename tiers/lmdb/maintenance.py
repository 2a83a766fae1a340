"""The LMDB tier's maintenance walks: list and verify a cache (blocking; for tools and tests).

``Maintenance`` (any thread of the opening process but the writer; its writes go to the writer
thread): ``iter_records`` (every record with its parsed header, for ``kvtier inspect``), ``verify``
(decode every record, quarantine the corrupt ones, for ``kvtier verify`` and stress teardown),
``quarantined_keys``. Long walks read in transactions of ``_ITER_BATCH`` records, so they never pin
old pages for long. ``LmdbTier`` wires it to the environment, the writer side (quarantines) and
the reader side (its segment reader, the recheck of what a walk found bad).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple, TypeVar

import lmdb
import xxhash

from kvtier.errors import CorruptRecordError

from ..record_format import RecordHeader, decode_record, read_header, validate_record
from ..writer import WriterThread
from .environment import LmdbEnv
from .reads import ReaderSide
from .segments import SegmentPointer, is_pointer, stored_size
from .tables import ATIME
from .writes import WriterSide

__all__ = ["Maintenance", "RecordInfo", "VerifyReport"]

T = TypeVar("T")

_ITER_BATCH = 256


@dataclass(frozen=True)
class RecordInfo:
    """One stored record as ``iter_records`` sees it: header (``None`` when it does not parse, then
    ``error`` says why), stored bytes, last access in ns since the epoch (0 if never recorded), and
    the segment file its pointer names (``None``: inside LMDB)."""

    key: bytes
    header: Optional[RecordHeader]
    error: Optional[str]
    stored_bytes: int
    atime_ns: int
    segment: Optional[str] = None


@dataclass
class VerifyReport:
    """What ``verify`` found: records checked, records intact, and (key, reason) of each corrupt one."""

    checked: int = 0
    ok: int = 0
    corrupt: List[Tuple[bytes, str]] = field(default_factory=list)
    quarantined: int = 0


class Maintenance:
    """Blocking tool walks of ``LmdbTier``: any thread of the opening process but the writer (see
    the module docstring). ``writer`` is None when the tier is read-only (nothing is quarantined
    then)."""

    def __init__(self, db: LmdbEnv, writes: WriterSide, reads: ReaderSide, writer: Optional[WriterThread]) -> None:
        self._db = db
        self._writes = writes
        self._reads = reads
        self._writer = writer

    def _scan(self, visit: Callable[[lmdb.Transaction, bytes, memoryview], T]) -> Iterator[T]:
        """``visit(txn, key, value)`` for every record of ``chunks`` in cursor order, inside read
        transactions of ``_ITER_BATCH`` records each (so a long scan never pins old pages for long);
        yields the results. ``value`` is only valid inside ``visit``."""
        last: Optional[bytes] = None
        while True:

            def body(txn: "lmdb.Transaction[memoryview]") -> Tuple[List[T], Optional[bytes]]:
                cur = txn.cursor(db=self._db.tables.chunks)
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
                    value = cur.value()
                    if self._db.lockless:  # see LmdbEnv.open: only a private copy is checked
                        value = memoryview(bytes(value))
                    out.append(visit(txn, key, value))
                    positioned = cur.next()
                return out, key

            batch, last = self._db.read_txn(body)
            yield from batch
            if len(batch) < _ITER_BATCH:
                return

    def _stored_record(self, value: memoryview) -> "bytes | memoryview":
        """A ``chunks`` value's record: read from its segment for a pointer (``CorruptRecordError``
        when the segment lost it), else the value itself."""
        return self._reads.segment_reader.read(value) if is_pointer(value) else value

    def iter_records(self) -> Iterator[RecordInfo]:
        """Every record with its parsed header (blocking; for ``kvtier inspect``). Reads in
        transactions of a few hundred records, so a long listing never pins old pages for long."""

        def visit(txn: lmdb.Transaction, key: bytes, value: memoryview) -> RecordInfo:
            try:
                header: Optional[RecordHeader] = read_header(self._stored_record(value))
                error = None
            except CorruptRecordError as exc:
                header, error = None, str(exc)
            at = txn.get(key, db=self._db.tables.atime)
            atime = ATIME.unpack(at)[0] if at is not None and len(at) == ATIME.size else 0
            segment = SegmentPointer.unpack(value, check=False).name if is_pointer(value) else None
            return RecordInfo(key, header, error, stored_size(value), atime, segment)

        yield from self._scan(visit)

    def verify(self, *, quarantine: bool = True) -> VerifyReport:
        """Decode every record fully (checksum, codec) in the transaction that lists it, and check
        that its key still finds it (a damaged B-tree page can list a record that no lookup
        reaches: a miss forever, reported as bad). Quarantine the corrupt ones unless told not to or
        read-only. Blocking; for ``kvtier verify`` and stress-test teardown."""
        report = VerifyReport()
        scratch = bytearray(0)

        def visit(txn: lmdb.Transaction, key: bytes, value: memoryview) -> Tuple[bytes, int, str]:
            nonlocal scratch
            try:
                record = self._stored_record(value)
                # The header's raw length sizes the scratch buffer only once the size cap and the
                # checksum passed: a lying header must not make us allocate what it claims.
                header = validate_record(key, record, max_raw_bytes=self._reads.max_raw_bytes)
                if len(scratch) < header.raw_length:
                    scratch = bytearray(header.raw_length)
                decode_record(key, record, memoryview(scratch)[: header.raw_length], max_raw_bytes=self._reads.max_raw_bytes)
            except CorruptRecordError as exc:
                if txn.get(key, db=self._db.tables.chunks) is None:  # a damaged key: bad, not rechecked
                    return key, 0, str(exc)
                return key, xxhash.xxh3_64_intdigest(value), str(exc)
            if txn.get(key, db=self._db.tables.chunks) is None:
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

        if found:
            # A key another process deleted, evicted or rewrote after this scan's transaction began
            # (its segment file deleted meanwhile) is gone, not corrupt: reported by neither. Only
            # records their key reached in the scan's transaction are rechecked (``found``).
            still = self._reads.still_stored(found)
            gone = {k for k, _, _ in found} - {k for k, _, _ in still}
            report.corrupt = [(k, why) for k, why in report.corrupt if k not in gone]
            report.checked -= len(gone)
            found = still

        # ``atime`` lists the stored keys (list_keys, the index at open): an entry whose key has no
        # record -- a key byte damaged in ``chunks`` -- is offered as a hit that always misses.
        def dangling(txn: lmdb.Transaction) -> List[bytes]:
            keys = (bytes(k) for k in txn.cursor(db=self._db.tables.atime).iternext(keys=True, values=False))
            return [k for k in keys if txn.get(k, db=self._db.tables.chunks) is None]

        orphans = self._db.read_txn(dangling)
        for key in orphans:
            report.checked += 1
            report.corrupt.append((key, "in the access-time table, but no record has this key (damaged table)"))
        self._db.counters.count(corrupt=len(report.corrupt))
        if quarantine and self._writer is not None:
            if found:
                report.quarantined = self._writer.call(lambda: self._writes.quarantine_entries(found))
            if orphans:
                report.quarantined += self._writer.call(lambda: self._writes.drop_dangling_atime(orphans))
        return report

    def quarantined_keys(self) -> List[bytes]:
        """Keys held in the quarantine table (blocking)."""

        def body(txn: lmdb.Transaction) -> List[bytes]:
            cur = txn.cursor(db=self._db.tables.quarantine)
            return [bytes(k) for k in cur.iternext(keys=True, values=False)]

        return self._db.read_txn(body)
