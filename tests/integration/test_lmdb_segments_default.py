"""Segments on by default (``DEFAULT_SEGMENT_THRESHOLD_BYTES``): every place that opens an LMDB
tier agrees on it, records split exactly at it, caches written with segments off open with the
default and back, a damaged pointer is a miss (not a huge allocation), a read racing the deletion
of its segment is a plain miss, and large records keep LMDB's map small."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from kvtier.engine import EngineConfig
from kvtier.tiers.base import Removal
from kvtier.tiers.lmdb import DEFAULT_SEGMENT_THRESHOLD_BYTES, LmdbTier
from kvtier.tiers.record_format import CodecConfig, encode_record
from kvtier.tools.testing.children import chunk_content, make_batch
from segment_checks import Item, assert_ledger_matches, assert_served, pointers

RAW = CodecConfig(compress=False)


def _values(tier: LmdbTier) -> Dict[bytes, bytes]:
    def body(txn) -> Dict[bytes, bytes]:
        return {bytes(k): bytes(v) for k, v in txn.cursor(db=tier._db.tables.chunks).iternext(keys=True, values=True)}

    return tier._db.read_txn(body)


def _encoded(item: Item) -> int:
    return len(encode_record(item[0], item[1], item[2], RAW))


def test_every_opener_defaults_to_the_one_threshold(tmp_path: Path) -> None:
    with LmdbTier(tmp_path / "c", map_size_bytes=1 << 20) as tier:
        assert tier._writes.segment_threshold == DEFAULT_SEGMENT_THRESHOLD_BYTES == 128 << 10
    assert EngineConfig().lmdb_segment_threshold_bytes == DEFAULT_SEGMENT_THRESHOLD_BYTES
    # None and 0 both mean "every record inside LMDB", from code, TOML and the environment alike
    for value in (None, 0):
        with LmdbTier(tmp_path / f"off-{value}", map_size_bytes=1 << 20, segment_threshold_bytes=value) as tier:
            assert tier._writes.segment_threshold is None
    toml = tmp_path / "kvtier.toml"
    toml.write_text('lmdb_segment_threshold_bytes = "none"\n')
    assert EngineConfig.from_toml(toml).lmdb_segment_threshold_bytes is None
    assert EngineConfig.from_env({"KVTIER_LMDB_SEGMENT_THRESHOLD_BYTES": "1MiB"}).lmdb_segment_threshold_bytes == 1 << 20
    assert EngineConfig.from_env({"KVTIER_LMDB_SEGMENT_THRESHOLD_BYTES": "0"}).lmdb_segment_threshold_bytes == 0
    with pytest.raises(ValueError, match=r"^lmdb_segment_threshold_bytes \(from KVTIER_LMDB_SEGMENT_THRESHOLD_BYTES\)"):
        EngineConfig.from_env({"KVTIER_LMDB_SEGMENT_THRESHOLD_BYTES": "-5"})
    for bad in (-1, 1.5, True, "128KiB"):
        with pytest.raises(ValueError, match=r"^segment_threshold_bytes must be an int >= 0 or None \(None or 0: "
                                              r"every record inside LMDB\), got "):
            LmdbTier(tmp_path / "bad", segment_threshold_bytes=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^lmdb_segment_threshold_bytes must be an int >= 0 or None"):
            EngineConfig(lmdb_segment_threshold_bytes=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "bad").exists()  # refused before any directory exists


@pytest.mark.asyncio
async def test_the_default_splits_records_at_the_threshold_with_private_files(tmp_path: Path) -> None:
    probe = make_batch(1, 0, [1000])[0]
    overhead = _encoded(probe) - 1000  # header bytes of a raw record (the same for every size here)
    at = DEFAULT_SEGMENT_THRESHOLD_BYTES - overhead
    items = make_batch(1, 1, [700, at - 1, at, at + 1, 300_000])
    assert [_encoded(it) >= DEFAULT_SEGMENT_THRESHOLD_BYTES for it in items] == [False, False, True, True, True]
    assert _encoded(items[2]) == DEFAULT_SEGMENT_THRESHOLD_BYTES
    path = tmp_path / "c"
    async with await LmdbTier.open(path, codec=RAW) as tier:
        await tier.put_many(items)
        assert set(pointers(tier)) == {it[0] for it in items[2:]}
        await assert_served(tier, items)
        assert_ledger_matches(tier)
        (segment,) = {p.name for p in pointers(tier).values()}
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        for name in (segment, "segments.lock", "data.mdb"):
            assert stat.S_IMODE(os.stat(path / name).st_mode) == 0o600, name


@pytest.mark.asyncio
async def test_a_cache_written_inline_opens_with_the_default_and_back(tmp_path: Path) -> None:
    path = tmp_path / "c"
    old = make_batch(2, 0, [200_000, 300_000, 5000])
    async with await LmdbTier.open(path, codec=RAW, segment_threshold_bytes=None) as tier:
        await tier.put_many(old)
        assert pointers(tier) == {}
    assert list(path.glob("seg-*.kvs")) == []
    # the default over the old cache: old records served inline, new large ones go to segments,
    # an old key rewritten moves to a segment, deletes and evictions of either kind work
    new = make_batch(2, 1, [200_000, 300_000, 5000])
    async with await LmdbTier.open(path, codec=RAW, capacity_bytes=1 << 20) as tier:
        removed: List[Removal] = []
        tier.subscribe_removals(removed.extend)
        await assert_served(tier, old)
        await tier.put_many(new)
        await tier.put_many(old[:1])
        assert set(pointers(tier)) == {new[0][0], new[1][0], old[0][0]}
        assert await tier.delete_many([old[1][0], new[0][0]]) == 2
        await assert_served(tier, [old[0], old[2], new[1], new[2]])
        more = make_batch(2, 2, [300_000] * 3)
        await tier.put_many(more)  # past the capacity: the least recently used go
        assert {r.reason for r in removed} == {"deleted", "evicted"}
        assert await tier.check() == []
        assert_ledger_matches(tier)
        tail = make_batch(2, 4, [5000])
        await tier.put_many(tail)  # small: inline, beside the segment records
        survivors = [it for it in old + new + more + tail if it[0] in _values(tier)]
        assert any(it[0] in pointers(tier) for it in survivors) and any(it[0] not in pointers(tier) for it in survivors)
        await assert_served(tier, survivors)
        tier._writes.segment_writer.rotate()  # our active segment may go too once empty
    # ... and back: segments off still reads pointers, and deleting them frees their files
    async with await LmdbTier.open(path, codec=RAW, segment_threshold_bytes=None) as tier:
        await assert_served(tier, survivors)
        report = tier.verify()
        assert (report.checked, report.ok) == (len(survivors), len(survivors))
        last = make_batch(2, 3, [300_000])
        await tier.put_many(last)
        assert last[0][0] not in pointers(tier)
        assert await tier.delete_many([it[0] for it in survivors]) == len(survivors)
        assert pointers(tier) == {} and sorted(path.glob("seg-*.kvs")) == []
        await assert_served(tier, last)
    async with await LmdbTier.open(path, readonly=True) as tier:
        await assert_served(tier, last)


# magic | pid | counter | offset | length (u64) | head length (u32): the high byte of each field
LENGTH_HIGH_BYTE, HEAD_HIGH_BYTE = 4 + 4 + 4 + 8 + 7, 4 + 4 + 4 + 8 + 8 + 3


@pytest.mark.asyncio
@pytest.mark.parametrize("field, reason", [(LENGTH_HIGH_BYTE, "is short"), (HEAD_HIGH_BYTE, "with a head of")],
                         ids=["length", "head"])
async def test_a_damaged_pointer_is_a_miss_quarantined_not_a_huge_allocation(tmp_path: Path, field: int, reason: str) -> None:
    # Regressions: a pointer whose length's high byte flipped asked for a buffer of exabytes
    # (MemoryError out of verify and reads); one whose head length cannot be right made every
    # walk of the cache (inspect, verify, the quarantine's ledger) raise. Both are one bad record:
    # a miss, quarantined, reported, and the rest of the cache is served.
    items = make_batch(3, 0, [200_000, 200_000])
    async with await LmdbTier.open(tmp_path / "c", codec=RAW) as tier:
        removed: List[Removal] = []
        tier.subscribe_removals(removed.extend)
        await tier.put_many(items)
        bad = items[0][0]
        value = bytearray(_values(tier)[bad])
        value[field] ^= 0xFF

        def damage(txn) -> None:
            txn.put(bad, bytes(value), db=tier._db.tables.chunks)

        tier._writer.call(lambda: tier._writes.write(lambda txn: (damage(txn), lambda: None)[1]))
        assert {info.key: info.error is not None for info in tier.iter_records()} == {bad: True, items[1][0]: False}
        report = tier.verify(quarantine=False)
        assert [k for k, _ in report.corrupt] == [bad] and reason in report.corrupt[0][1], report.corrupt
        bufs = [bytearray(200_000) for _ in items]
        metas = await tier.get_many_into([(it[0], memoryview(b)) for it, b in zip(items, bufs)])
        assert metas[0] is None and metas[1] == items[1][1] and bytes(bufs[1]) == chunk_content(items[1][0])
        await tier.flush()
        await asyncio.sleep(0.05)
        assert [(r.key, r.reason) for r in removed] == [(bad, "quarantined")]
        assert tier.quarantined_keys() == [bad] and tier.statistics().corrupt >= 1
        assert tier.verify().corrupt == [] and await tier.check() == []
        # the ledger still counts the segment's records right (what frees its file); its live
        # bytes dropped the damaged length, which nobody can know (clamped at 0: compaction only
        # takes the segment sooner)
        assert_ledger_matches(tier, live_bytes_exact=field != LENGTH_HIGH_BYTE)


@pytest.mark.asyncio
async def test_a_read_racing_the_deletion_of_its_segment_is_a_plain_miss(tmp_path: Path) -> None:
    items = make_batch(4, 0, [200_000])
    key = items[0][0]
    async with await LmdbTier.open(tmp_path / "c", codec=RAW) as tier:
        await tier.put_many(items)
        (name,) = {p.name for p in pointers(tier).values()}
        tier._writes.segment_writer.rotate()  # no writer holds it: emptied, it is deleted at once
        reader = tier._reads.segment_reader
        real_using = reader._using

        @contextlib.contextmanager
        def open_after_the_delete(segment: str) -> Iterator[int]:
            # inside the read's transaction (it already holds the pointer): the key is deleted
            # meanwhile and its segment goes, before this process ever opened the file
            reader._using = real_using
            assert segment == name
            assert tier._writer.call(lambda: tier._writes.delete_keys([key])) == 1
            assert not (tmp_path / "c" / name).exists()
            with real_using(segment) as fd:
                yield fd

        reader._using = open_after_the_delete
        assert await tier.get_many_into([(key, memoryview(bytearray(200_000)))]) == [None]
        assert reader._using == real_using  # the race ran
        stats = tier.statistics()
        assert (stats.misses, stats.corrupt) == (1, 0)
        await tier.flush()
        assert tier.quarantined_keys() == []


@pytest.mark.asyncio
async def test_with_the_default_large_records_leave_the_map_small(tmp_path: Path) -> None:
    # the counterpart of test_lmdb_tier's map growth (inline): 4 MiB of 256 KiB records, 1 MiB map
    items = make_batch(5, 0, [256 << 10] * 16)
    async with await LmdbTier.open(tmp_path / "c", map_size_bytes=1 << 20, codec=RAW) as tier:
        for i in range(0, 16, 4):
            await tier.put_many(items[i : i + 4])
        stats = tier.statistics().as_dict()
        assert stats["map_growths"] == 0 and stats["map_size_bytes"] == 1 << 20
        assert len(pointers(tier)) == 16
        await assert_served(tier, items)
    assert (tmp_path / "c" / "data.mdb").stat().st_size <= 1 << 20


@pytest.mark.asyncio
async def test_a_put_whose_evictions_empty_its_own_segment_keeps_the_file(tmp_path: Path) -> None:
    # Regression: the evictions kept a ledger of their own, saw the segment the batch had just been
    # appended to emptied, and the commit deleted that file under the batch: acknowledged records
    # lost (every read "segment ... is missing"). A capacity below the segment size does this on
    # every eviction.
    path = tmp_path / "c"
    first, second = make_batch(6, 0, [300_000] * 3), make_batch(6, 1, [300_000] * 3)
    async with await LmdbTier.open(path, codec=RAW, capacity_bytes=1 << 20) as tier:
        await tier.put_many(first)
        await tier.put_many(second)  # the same segment; evicts every record of the first batch
        assert tier.statistics().evictions == 3
        assert len({p.name for p in pointers(tier).values()}) == 1
        await assert_served(tier, second)
        assert_ledger_matches(tier)
        assert tier.verify().corrupt == []
    async with await LmdbTier.open(path, codec=RAW) as tier:
        await assert_served(tier, second)
