"""The LMDB tier's segment payload path (tiers/lmdb/segments.py): records at or above
``segment_threshold_bytes`` live in append-only segment files, LMDB holds pointers. Round trips
above and below the threshold, mixed caches, corruption, eviction freeing segments, reopen,
orphan tails, a second process, and kill -9 during segment batches."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from kvtier.tiers.base import ChunkMeta, Removal
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig
from kvtier.tiers.lmdb.segments import LIVE, SegmentPointer, committed_ends, is_pointer
from kvtier.tools.testing.fault_child import (
    check_cache,
    chunk_content,
    make_batch,
    run_kill_chains,
    summarize_kills,
)
from kvtier.tools.testing.faults import corrupt_stored_record

THRESHOLD = 16 << 10
Item = Tuple[bytes, ChunkMeta, memoryview]


def _items(seed: int, batch: int, sizes: List[int]) -> List[Item]:
    return make_batch(seed, batch, sizes)


def _segment_files(path: Path) -> Dict[str, int]:
    return {p.name: p.stat().st_size for p in path.glob("seg-*.kvs")}


def _pointers(tier: LmdbTier) -> Dict[bytes, SegmentPointer]:
    def body(txn) -> Dict[bytes, SegmentPointer]:
        cur = txn.cursor(db=tier._tables.chunks)
        return {bytes(k): SegmentPointer.unpack(v) for k, v in cur.iternext(keys=True, values=True) if is_pointer(v)}

    return tier._read_txn(body)


def _ledger(tier: LmdbTier) -> Dict[str, Tuple[int, int, int]]:
    def body(txn) -> Dict[str, Tuple[int, int, int]]:
        cur = txn.cursor(db=tier._tables.segments)
        return {bytes(k).decode(): LIVE.unpack(v) for k, v in cur.iternext(keys=True, values=True)}

    return tier._read_txn(body)


async def _read(tier: LmdbTier, items: List[Item]) -> List[Tuple[object, bytes]]:
    bufs = [bytearray(it[2].nbytes) for it in items]
    metas = await tier.get_many_into([(it[0], memoryview(b)) for it, b in zip(items, bufs)])
    return [(m, bytes(b)) for m, b in zip(metas, bufs)]


async def _assert_served(tier: LmdbTier, items: List[Item]) -> None:
    for (meta, data), it in zip(await _read(tier, items), items):
        assert meta == it[1]
        assert data == chunk_content(it[0])


def _assert_ledger_matches(tier: LmdbTier) -> None:
    """The segments table says exactly what the pointers say, and no file holds bytes past its
    committed end or lacks an entry (after an open, which reclaims orphans)."""
    expected: Dict[str, List[int]] = {}
    for p in _pointers(tier).values():
        e = expected.setdefault(p.name, [0, 0])
        e[0] += p.length
        e[1] += 1
    ledger = _ledger(tier)
    assert {n: (live, recs) for n, (live, recs, _) in ledger.items()} == {n: tuple(v) for n, v in expected.items()}
    for p in _pointers(tier).values():
        assert p.offset + p.length <= ledger[p.name][2]


@pytest.mark.asyncio
async def test_round_trip_bitwise_above_and_below_the_threshold(tmp_path: Path) -> None:
    sizes = [700, THRESHOLD - 200, THRESHOLD, 65536, 131072, 3000, 200_000]
    items = _items(1, 0, sizes)
    async with await LmdbTier.open(tmp_path / "c", segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(items)
        await _assert_served(tier, items)
        pointers = _pointers(tier)
        # the records whose encoded size is at or above the threshold went to the segment
        big = {info.key for info in tier.iter_records() if info.stored_bytes >= THRESHOLD}
        assert set(pointers) == big and 3 <= len(big) < len(items)
        assert len({p.name for p in pointers.values()}) == 1
        assert all(p.offset % 4096 == 0 for p in pointers.values())
        stats = tier.statistics()
        assert stats.bytes == sum(info.stored_bytes for info in tier.iter_records())
        assert await tier.check() == []
        _assert_ledger_matches(tier)
        report = tier.verify()
        assert (report.checked, report.ok, report.corrupt) == (len(items), len(items), [])
        assert {info.key for info in tier.iter_records() if info.header is not None} == {it[0] for it in items}
        assert os.stat(tmp_path / "c" / next(iter(pointers.values())).name).st_mode & 0o777 == 0o600
    # reopen: served as before, by a tier with segments off too (mixed caches read either way)
    async with await LmdbTier.open(tmp_path / "c", segment_threshold_bytes=None) as tier:
        await _assert_served(tier, items)
        assert await tier.check() == []
        more = _items(1, 1, [200_000])
        await tier.put_many(more)  # segments off: inline
        assert more[0][0] not in _pointers(tier)
        await _assert_served(tier, items + more)
    async with await LmdbTier.open(tmp_path / "c", readonly=True) as tier:
        await _assert_served(tier, items + more)


@pytest.mark.asyncio
async def test_overwrite_delete_and_eviction_free_segments(tmp_path: Path) -> None:
    path = tmp_path / "c"
    async with await LmdbTier.open(
        path,
        segment_threshold_bytes=THRESHOLD,
        segment_max_bytes=1 << 20,
        capacity_bytes=3 << 20,
        codec=CodecConfig(compress=False),
    ) as tier:
        removed: List[Removal] = []
        tier.subscribe_removals(removed.extend)
        batches = [_items(2, b, [200_000] * 3) for b in range(8)]  # ~600 KB each, 1 MiB segments
        for batch in batches[:4]:
            await tier.put_many(batch)
        first_segments = set(_segment_files(path))
        assert len(first_segments) >= 2
        # the same keys again: new pointers, the old bytes are dead
        await tier.put_many(batches[0])
        _assert_ledger_matches(tier)
        # delete batch 1 and 2, then fill past the capacity: the LRU evicts, whole segments go
        assert await tier.delete_many([k for k, _, _ in batches[1] + batches[2]]) == 6
        for batch in batches[4:]:
            await tier.put_many(batch)
        await asyncio.sleep(0)
        stats = tier.statistics()
        assert stats.bytes <= 3 << 20 and stats.evictions > 0
        assert {r.reason for r in removed} == {"deleted", "evicted"}
        assert await tier.check() == []
        _assert_ledger_matches(tier)
        live = {p.name for p in _pointers(tier).values()}
        files = set(_segment_files(path))
        # every file is live or this writer's active segment; emptied ones were deleted
        assert files - live <= {tier._segment_writer.active}
        assert not (first_segments & files) - live
        served = [it for b in batches for it in b if it[0] in set(_pointers(tier))]
        await _assert_served(tier, served)
        assert tier.gc(0) == len(served)
        assert _pointers(tier) == {} and _ledger(tier) == {}
        assert set(_segment_files(path)) <= {tier._segment_writer.active}
    async with await LmdbTier.open(path) as tier:
        assert _segment_files(path) == {} or all(size == 0 for size in _segment_files(path).values())


@pytest.mark.asyncio
async def test_corrupt_segment_bytes_are_a_miss_quarantined_and_reported(tmp_path: Path) -> None:
    items = _items(3, 0, [65536, 65536, 700])
    async with await LmdbTier.open(tmp_path / "c", segment_threshold_bytes=THRESHOLD) as tier:
        removed: List[Removal] = []
        tier.subscribe_removals(removed.extend)
        await tier.put_many(items)
        bad = items[0][0]
        await asyncio.to_thread(corrupt_stored_record, tier, bad, offset_from_end=10)
        results = await _read(tier, items)
        assert results[0][0] is None
        assert [r[0] for r in results[1:]] == [items[1][1], items[2][1]]
        await tier.flush()
        await asyncio.sleep(0.05)
        assert [(r.key, r.reason) for r in removed] == [(bad, "quarantined")]
        assert tier.quarantined_keys() == [bad]
        assert tier.statistics().corrupt == 1
        assert bad not in _pointers(tier)
        _assert_ledger_matches(tier)
        assert await tier.check() == []
        # a missing segment file: every pointer into it is a miss, found by verify too
        other = _items(3, 1, [65536])
        await tier.put_many(other)
        victim = _pointers(tier)[other[0][0]].name
        tier._segment_writer.rotate()
        tier._segment_reader.forget([victim])
        os.unlink(tmp_path / "c" / victim)
        report = tier.verify(quarantine=True)
        assert {k for k, _ in report.corrupt} == {items[1][0], other[0][0]}
        assert all("missing" in reason for _, reason in report.corrupt)
        assert await _read(tier, other) == [(None, bytes(65536))]
        _assert_ledger_matches(tier)


@pytest.mark.asyncio
async def test_open_truncates_an_orphan_tail_and_deletes_orphan_segments(tmp_path: Path) -> None:
    path = tmp_path / "c"
    items = _items(4, 0, [65536, 65536])
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(items)
        (name,) = set(_segment_files(path))
        end = _ledger(tier)[name][2]
    # what a crash between append and commit leaves: bytes past the committed end, a whole file
    with open(path / name, "ab") as f:
        f.write(b"x" * 10000)
    (path / "seg-999999-0.kvs").write_bytes(b"y" * 8192)
    (path / "not-a-segment.bin").write_bytes(b"z")
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD) as tier:
        assert _segment_files(path) == {name: end}
        assert (path / "not-a-segment.bin").exists()
        await _assert_served(tier, items)
        more = _items(4, 1, [65536])
        await tier.put_many(more)  # a new segment of this process: the old one is never appended to
        assert _pointers(tier)[more[0][0]].name != name
        await _assert_served(tier, items + more)


@pytest.mark.asyncio
async def test_a_second_process_reads_segments_by_name_and_appends_its_own(tmp_path: Path) -> None:
    path = tmp_path / "c"
    items = _items(5, 0, [65536, 700, 131072])
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(items)
    child = (
        "import asyncio, sys\n"
        "from kvtier.tiers.lmdb import LmdbTier\n"
        "from kvtier.tools.testing.fault_child import make_batch, chunk_content\n"
        "async def main():\n"
        "    items = make_batch(5, 0, [65536, 700, 131072])\n"
        "    async with await LmdbTier.open(sys.argv[1], segment_threshold_bytes=16384) as t:\n"
        "        bufs = [bytearray(it[2].nbytes) for it in items]\n"
        "        ms = await t.get_many_into([(it[0], memoryview(b)) for it, b in zip(items, bufs)])\n"
        "        assert all(m is not None and bytes(b) == chunk_content(it[0]) for m, b, it in zip(ms, bufs, items))\n"
        "        await t.put_many(make_batch(5, 1, [65536]))\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(os.sys.executable, "-c", child, str(path))
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    async with await LmdbTier.open(path) as tier:
        theirs = _items(5, 1, [65536])
        await _assert_served(tier, items + theirs)
        names = {p.name for p in _pointers(tier).values()}
        assert len(names) == 2  # one segment per writing process
        _assert_ledger_matches(tier)


def test_kill9_during_segment_batches_loses_no_acknowledged_chunk(tmp_path: Path) -> None:
    # the spill child's sizes are 700..131072 bytes: with this threshold most go to segments
    results = run_kill_chains(
        tmp_path, 6, mode="tier", base_seed=777, child_args=("--segment-threshold-bytes", "8192")
    )
    problems = [f"seed {r.seed} delay {r.delay_s:.2f}s: {p}" for r in results for p in r.problems]
    print(f"segments: {summarize_kills(results)}")
    assert not problems, "\n".join(problems[:20])
    assert sum(r.acked_batches for r in results) > 0
    for directory in {p.parent for p in tmp_path.glob("chain-*/data.mdb")}:
        check = check_cache(str(directory))  # reopens (reclaiming orphans), verifies, reads all
        assert not check.problems and check.intact == check.records > 0
        with LmdbTier(directory, map_size_bytes=1 << 20) as tier:
            pointers = _pointers(tier)
            assert pointers, "not vacuous: segment records survived"
            _assert_ledger_matches(tier)
            ends = tier._read_txn(lambda txn: committed_ends(txn, tier._tables.segments))
            assert _segment_files(directory) == {n: ends[n] for n in _segment_files(directory)}
            assert set(_segment_files(directory)) == set(ends)


@pytest.mark.asyncio
async def test_engine_config_turns_segments_on_and_a_restart_loads_bitwise(tmp_path: Path) -> None:
    from kvtier.engine import EngineConfig, OffloadEngine
    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

    layout = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
    config = EngineConfig(
        cache_dir=str(tmp_path / "cache"),
        host_capacity_bytes=1 << 20,
        lmdb_map_size_bytes=32 << 20,
        pressure_poll_interval_s=3600.0,
        compression_enabled=False,
        lmdb_segment_threshold_bytes=1,
    )
    device = make_cpu_device(layout, num_blocks=256)
    async with OffloadEngine(layout, device, config, fingerprint=b"seg") as engine:
        scenario = OffloadScenario(engine, seed=0)
        prompt = scenario.tokens(33)
        await scenario.produce(prompt, expect_stored={0: {0, 1}, 1: {2, 3, 6, 7}})
        await engine.flush()
    with LmdbTier(tmp_path / "cache", map_size_bytes=32 << 20) as tier:
        assert len(_pointers(tier)) == 6  # every chunk went to a segment
    async with OffloadEngine(layout, device, config, fingerprint=b"seg") as engine:
        consumer = OffloadScenario(engine)
        consumer.producer_bytes = scenario.producer_bytes
        await consumer.consume(prompt + [1], expect_hit=32, expect_loaded={0: {0, 1}, 1: {6, 7}})
    with pytest.raises(ValueError, match=r"^lmdb_segment_threshold_bytes must be an int >= 0 or None "
                       r"\(None or 0: every record inside LMDB\), got -1$"):
        EngineConfig(cache_dir=str(tmp_path), lmdb_segment_threshold_bytes=-1)
    with pytest.raises(ValueError, match=r"^segment_threshold_bytes must be an int >= 0 or None "
                       r"\(None or 0: every record inside LMDB\), got 'x'$"):
        LmdbTier(tmp_path / "other", segment_threshold_bytes="x")  # type: ignore[arg-type]


def test_a_filesystem_refusing_o_direct_falls_back_to_buffered_synced_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tmpfs on older kernels (and some FUSE/network filesystems) answer O_DIRECT with EINVAL;
    # this kernel's tmpfs takes it, so the refusal is injected at os.open
    import errno

    from kvtier.tiers.lmdb import segments

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(segments.os, "open", refusing_open)
    items = _items(6, 0, [65536, 700, 131072])
    path = tmp_path / "c"

    async def run() -> None:
        async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD) as tier:
            await tier.put_many(items)
            assert tier._segment_writer.direct is False
            assert len(_pointers(tier)) == 2
            await _assert_served(tier, items)

    asyncio.run(run())
    monkeypatch.undo()
    asyncio.run(_reopen_and_serve(path, items))


async def _reopen_and_serve(path: Path, items: List[Item]) -> None:
    async with await LmdbTier.open(path) as tier:
        await _assert_served(tier, items)


def test_aligned_encode_is_the_record_bitwise_zero_padded_and_pooled() -> None:
    """encode_for_segments: below the threshold the plain record; at or above it the same bytes in a
    page-aligned, zero-padded buffer, which goes back to the pool on release."""
    from kvtier.tiers.lmdb import segments
    from kvtier.tiers.record_format import encode_record

    meta = ChunkMeta(b"fp", 0, 0, "uint8", (5000,))
    raw = bytes(range(256)) * 19 + bytes(136)
    for codec in (CodecConfig(compress=False), CodecConfig()):
        want = encode_record(b"k" * 16, meta, raw, codec)
        small = segments.encode_for_segments(b"k" * 16, meta, raw, codec, len(want) + 1)
        assert isinstance(small, bytes) and small == want
        big = segments.encode_for_segments(b"k" * 16, meta, raw, codec, len(want))
        assert isinstance(big, segments.AlignedRecord) and len(big) == len(want)
        assert bytes(big) == want and bytes(segments.record_bytes(big)) == want
        assert len(big.buffer) % 4096 == 0 and big.buffer[len(want):] == bytes(len(big.buffer) - len(want))
        buffer = big.buffer
        segments.release_records([big, small])
        assert big.buffer is None
        again = segments.encode_for_segments(b"k" * 16, meta, raw, codec, len(want))
        assert again.buffer is buffer  # reused, not a fresh map
