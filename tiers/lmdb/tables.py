"""The LMDB tier's named databases and the formats of their values.

Primitives (any thread; a write transaction only on the writer thread):

- ``Tables``: the four database handles of one environment, opened (and created) by ``open_tables``.
- ``ATIME``: the value format of the ``atime`` side table (last access ns u64 | stored bytes u64).
- ``index_entries``: every stored key with its last access and size, read from ``atime``.
- ``read_sequence`` / ``bump_sequence``: the environment's mutation sequence (``meta``), bumped by
  every write transaction of every process, so removals and puts are ordered across processes.
- ``take_segment_number``: the next segment number of the directory (``meta``), so segment names
  never repeat, whichever process or tier instance creates them.

Tables: ``chunks`` (key -> record, see ``tiers.record_format``), ``atime`` (key -> last access | stored
bytes, the LRU side table, written in batches), ``quarantine`` (key -> a corrupt record, at most
``max_quarantine_records`` kept), ``segments`` (segment name -> live bytes | records | committed
end, see ``segments``), ``meta`` (format version; ``sequence``, a u64; ``segment_counter``, a u64).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import lmdb

from kvtier.errors import CorruptCacheError, TierIOError

from .segment_files import NAME_PATTERN, segment_files
from .segments import stored_size

__all__ = ["FORMAT_VERSION", "INLINE_FORMAT_VERSION", "READABLE_FORMATS", "ATIME", "Tables", "open_tables", "index_entries", "read_sequence", "bump_sequence",
           "take_segment_number"]

# The tier format in ``meta``: b"1" every record inline; b"2" records may be segment pointers
# (tiers/lmdb/segments.py). A cache is marked b"2" by the first writable open that may write
# pointers, so a kvtier that reads only b"1" refuses it with a clear error instead of taking the
# pointers for corrupt records and quarantining them.
FORMAT_VERSION = b"2"
INLINE_FORMAT_VERSION = b"1"
READABLE_FORMATS = (INLINE_FORMAT_VERSION, FORMAT_VERSION)
_DB_CHUNKS = b"chunks"
_DB_ATIME = b"atime"
_DB_QUARANTINE = b"quarantine"
_DB_META = b"meta"
_DB_SEGMENTS = b"segments"
ATIME = struct.Struct("<QQ")  # last access (time_ns), stored record bytes
_SEQUENCE_KEY = b"sequence"
_SEQUENCE = struct.Struct("<Q")
_SEGMENT_COUNTER_KEY = b"segment_counter"
_MAX_SEGMENT_NUMBER = 0xFFFFFFFF  # a pointer's counter field (segments._POINTER)


@dataclass(frozen=True)
class Tables:
    """The database handles of one open environment."""

    chunks: "lmdb._Database"
    atime: "lmdb._Database"
    quarantine: "lmdb._Database"
    meta: "lmdb._Database"
    # segment name -> live bytes | live records | committed end (``segments.LIVE``); None only in a
    # read-only open of a cache that never had one.
    segments: "Optional[lmdb._Database]" = None

    @property
    def writable_segments(self) -> "lmdb._Database":
        """``segments`` where only a writable open gets (its writer, compactor, orphan reclaim):
        every writable open creates the table."""
        assert self.segments is not None, "a writable open always opens the segments table"
        return self.segments


def open_tables(env: lmdb.Environment, path: object, readonly: bool, *, pointers: bool = False) -> Tables:
    """Open the tables (creating them and the format marker unless ``readonly``) and check the
    format version; ``pointers``: this writer may store segment pointers, so the marker becomes
    ``FORMAT_VERSION`` (b"1" stays b"1" otherwise). LMDB errors propagate to the caller, which
    maps them; a version this kvtier does not read, or a read-only open of a directory without
    tables, is ``TierIOError``."""
    try:
        if readonly:
            # py-lmdb opens each handle in its own read transaction and keeps it (a handle
            # opened in a caller's read transaction dies with it).
            tables = Tables(
                env.open_db(_DB_CHUNKS, create=False),
                env.open_db(_DB_ATIME, create=False),
                env.open_db(_DB_QUARANTINE, create=False),
                env.open_db(_DB_META, create=False),
                _open_optional(env, _DB_SEGMENTS),
            )
            with env.begin() as txn:
                version = txn.get(b"format", db=tables.meta)
        else:
            with env.begin(write=True) as txn:
                tables = Tables(
                    env.open_db(_DB_CHUNKS, txn=txn),
                    env.open_db(_DB_ATIME, txn=txn),
                    env.open_db(_DB_QUARANTINE, txn=txn),
                    env.open_db(_DB_META, txn=txn),
                    env.open_db(_DB_SEGMENTS, txn=txn),
                )
                version = txn.get(b"format", db=tables.meta)
                wanted = FORMAT_VERSION if pointers else INLINE_FORMAT_VERSION
                if version is None or (version == INLINE_FORMAT_VERSION and wanted != version):
                    txn.put(b"format", wanted, db=tables.meta)
                    version = wanted
    except lmdb.NotFoundError as exc:
        raise TierIOError(f"{path} holds no kvtier LMDB tables (read-only open)") from exc
    if version is None:  # only a read-only open gets here without one (a writable open puts it)
        raise CorruptCacheError(f"{path} has kvtier's LMDB tables but its format marker is gone (damaged)")
    if version not in READABLE_FORMATS:
        readable = " and ".join(map(repr, READABLE_FORMATS))
        if not bytes(version).isdigit() or int(version) < int(INLINE_FORMAT_VERSION):
            # kvtier writes decimal versions only: anything else is a damaged marker
            raise CorruptCacheError(f"{path} has a damaged tier format marker {bytes(version)!r} (this kvtier reads {readable})")
        raise TierIOError(f"{path} has tier format {version!r}, this kvtier reads {readable}")
    return tables


def _open_optional(env: lmdb.Environment, name: bytes) -> "Optional[lmdb._Database]":
    try:
        return env.open_db(name, create=False)
    except lmdb.NotFoundError:
        return None


def index_entries(txn: lmdb.Transaction, tables: Tables) -> List[Tuple[int, bytes, int]]:
    """(last access ns, key, stored bytes) of every record, read from the small ``atime`` table.

    Every write keeps ``atime`` in step with ``chunks`` (same keys, the stored size in each
    value), and reading it touches only its own pages. A cursor over ``chunks`` would read the
    whole data file: py-lmdb touches every page of each value it steps over (keys-only
    iteration included), so opening a large cache would read all of it from disk and leave it in
    the page cache. Only when the two tables disagree in size (damage from outside) is
    ``chunks`` walked, the slow and sure way.
    """
    entries: List[Tuple[int, bytes, int]] = []
    times = txn.cursor(db=tables.atime)
    for k, v in times.iternext(keys=True, values=True):
        if len(v) == ATIME.size:
            atime, size = ATIME.unpack(v)
            entries.append((atime, bytes(k), size))
    if len(entries) == txn.stat(tables.chunks)["entries"]:
        return entries
    atimes = {key: atime for atime, key, _ in entries}
    return [
        (atimes.get(bytes(k), 0), bytes(k), stored_size(v))
        for k, v in txn.cursor(db=tables.chunks).iternext(keys=True, values=True)
    ]


def read_sequence(txn: lmdb.Transaction, tables: Tables) -> int:
    """The last mutation sequence committed to this environment (0 for a new one)."""
    value = txn.get(_SEQUENCE_KEY, db=tables.meta)
    return _SEQUENCE.unpack(value)[0] if value is not None and len(value) == _SEQUENCE.size else 0


def bump_sequence(txn: lmdb.Transaction, tables: Tables) -> int:
    """Inside a write transaction: the next sequence, stored; it becomes visible with the commit."""
    sequence = read_sequence(txn, tables) + 1
    txn.put(_SEQUENCE_KEY, _SEQUENCE.pack(sequence), db=tables.meta)
    return sequence


def take_segment_number(txn: lmdb.Transaction, tables: Tables, directory: Path) -> int:
    """Inside a write transaction: a segment number no earlier segment of this directory had (the
    counter in ``meta``, bumped). A cache from before the counter starts past every number its
    ``segments`` table and its files show, so no name it ever used comes back."""
    value = txn.get(_SEGMENT_COUNTER_KEY, db=tables.meta)
    if value is not None and len(value) == _SEQUENCE.size:
        number = _SEQUENCE.unpack(value)[0]
    else:
        names = [bytes(k).decode(errors="replace") for k in txn.cursor(db=tables.segments).iternext(keys=True, values=False)]
        seen = [int(m.group(2)) for m in map(NAME_PATTERN.match, names + segment_files(directory)) if m]
        number = max(seen, default=-1) + 1
    if number > _MAX_SEGMENT_NUMBER:
        raise TierIOError(f"{directory} has used every segment number (pointers hold 32 bits)")
    txn.put(_SEGMENT_COUNTER_KEY, _SEQUENCE.pack(number + 1), db=tables.meta)
    return number
