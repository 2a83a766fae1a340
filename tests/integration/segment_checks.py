"""Checks shared by the segment tests (test_lmdb_segments.py, test_lmdb_compaction.py): what the
``chunks`` pointers, the ``segments`` table and the files on disk say, and bitwise read-backs of
``children`` chunks (the fault suite's). They read the tier's tables directly, on purpose."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier, segments
from kvtier.tiers.lmdb.segments import LIVE, SegmentPointer, is_pointer
from kvtier.tools.testing.children import chunk_content

Item = Tuple[bytes, ChunkMeta, memoryview]


def skip_without_fallocate(directory: Path) -> None:
    """Skip the test where the filesystem of ``directory`` has no fallocate (segment writes then
    just extend the file: there is no allocation to check)."""
    probe = os.open(directory / "fallocate-probe", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not segments._fallocate(probe, 0, 4096):
            pytest.skip("this filesystem has no fallocate: segment writes extend the file")
    finally:
        os.close(probe)


def segment_files(path: Path) -> Dict[str, int]:
    """Segment file name -> size on disk (a file a background compaction deletes between the
    listing and its stat is left out: it is gone)."""
    sizes = {}
    for p in path.glob("seg-*.kvs"):
        try:
            sizes[p.name] = p.stat().st_size
        except FileNotFoundError:
            pass
    return sizes


def _pointers_in(tier: LmdbTier, txn) -> Dict[bytes, SegmentPointer]:
    cur = txn.cursor(db=tier._db.tables.chunks)
    return {bytes(k): SegmentPointer.unpack(v) for k, v in cur.iternext(keys=True, values=True) if is_pointer(v)}


def _ledger_in(tier: LmdbTier, txn) -> Dict[str, Tuple[int, int, int]]:
    cur = txn.cursor(db=tier._db.tables.segments)
    return {bytes(k).decode(): LIVE.unpack(v) for k, v in cur.iternext(keys=True, values=True)}


def pointers(tier: LmdbTier) -> Dict[bytes, SegmentPointer]:
    return tier._db.read_txn(lambda txn: _pointers_in(tier, txn))


def ledger(tier: LmdbTier) -> Dict[str, Tuple[int, int, int]]:
    return tier._db.read_txn(lambda txn: _ledger_in(tier, txn))


async def read_items(tier: LmdbTier, items: List[Item]) -> List[Tuple[object, bytes]]:
    bufs = [bytearray(it[2].nbytes) for it in items]
    metas = await tier.get_many_into([(it[0], memoryview(b)) for it, b in zip(items, bufs)])
    return [(m, bytes(b)) for m, b in zip(metas, bufs)]


async def assert_served(tier: LmdbTier, items: List[Item]) -> None:
    """Every item reads back with its meta and ``chunk_content(key)``, bitwise."""
    for (meta, data), it in zip(await read_items(tier, items), items):
        assert meta == it[1]
        assert data == chunk_content(it[0])


def assert_ledger_matches(tier: LmdbTier, *, live_bytes_exact: bool = True) -> None:
    """The segments table says exactly what the pointers say, and no pointer reaches past its
    segment's committed end. Both read in one transaction: a background compaction step may commit
    at any time. ``live_bytes_exact=False`` (after a damaged pointer was dropped: its true length
    is unknowable): the record counts exactly, live bytes at most the pointers' sum."""
    found, table = tier._db.read_txn(lambda txn: (_pointers_in(tier, txn), _ledger_in(tier, txn)))
    expected: Dict[str, List[int]] = {}
    for p in found.values():
        e = expected.setdefault(p.name, [0, 0])
        e[0] += p.length
        e[1] += 1
    if live_bytes_exact:
        assert {n: (live, recs) for n, (live, recs, _) in table.items()} == {n: tuple(v) for n, v in expected.items()}
    else:
        assert {n: recs for n, (_, recs, _) in table.items()} == {n: v[1] for n, v in expected.items()}
        assert all(table[n][0] <= v[0] for n, v in expected.items())
    for p in found.values():
        assert p.offset + p.extent <= table[p.name][2]
