"""The LMDB tier's segment payload path (tiers/lmdb/segments.py): records at or above
``segment_threshold_bytes`` live in append-only segment files, LMDB holds pointers. Round trips
above and below the threshold, mixed caches, corruption, eviction freeing segments, reopen,
orphan tails, a second process, and kill -9 during segment batches."""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from kvtier.tiers.base import ChunkMeta, IOHook, Removal
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig
from kvtier.tiers.lmdb import segment_reader, segments
from kvtier.tiers.lmdb.segments import SegmentPointer, committed_ends
from kvtier.tools.testing.children import check_cache, chunk_content, make_batch
from kvtier.tools.testing.fault_child import run_kill_chains, summarize_kills
from kvtier.tools.testing.faults import corrupt_stored_record
from segment_checks import assert_ledger_matches as _assert_ledger_matches
from segment_checks import assert_served as _assert_served
from segment_checks import ledger as _ledger
from segment_checks import pointers as _pointers
from segment_checks import read_items as _read
from segment_checks import segment_files as _segment_files
from segment_checks import skip_without_fallocate

THRESHOLD = 16 << 10
Item = Tuple[bytes, ChunkMeta, memoryview]


def _items(seed: int, batch: int, sizes: List[int]) -> List[Item]:
    return make_batch(seed, batch, sizes)


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
        # every file is live, this writer's active segment or the next one made ahead; emptied
        # ones were deleted
        writer = tier._writes.segment_writer
        assert files - live <= {writer.active, writer.spare}
        assert not (first_segments & files) - live
        served = [it for b in batches for it in b if it[0] in set(_pointers(tier))]
        await _assert_served(tier, served)
        assert tier.gc(0) == len(served)
        assert _pointers(tier) == {} and _ledger(tier) == {}
        assert set(_segment_files(path)) <= {writer.active, writer.spare}
    assert _segment_files(path) == {}  # closed: the active segment emptied, the spare removed
    async with await LmdbTier.open(path) as tier:
        assert _segment_files(path) == {} or all(size == 0 for size in _segment_files(path).values())


@pytest.mark.asyncio
async def test_one_batch_of_new_keys_and_every_kind_of_rewrite_keeps_the_ledger_exact(tmp_path: Path) -> None:
    """A batch mixing new keys with keys stored before (inline stored again as it was, inline
    becoming a pointer, a pointer becoming inline, a pointer replaced by another) leaves exactly the
    second values served, pointers only where the second value is large, and the ledger equal to
    the pointers: each replaced pointer's bytes dead, no new one counted twice."""
    small, large = THRESHOLD // 4, THRESHOLD * 3
    first = {"same": small, "grows": small, "shrinks": large, "moves": large}
    second = dict(first, grows=large, shrinks=small, new_large=large, new_small=small)

    def batch(sizes: Dict[str, int], generation: int) -> List[Item]:
        items = []
        for index, (name, nbytes) in enumerate(sizes.items()):
            key = make_batch(7, 0, [1] * 8)[index][0]
            payload = name.encode() + bytes([generation if name != "same" else 0]) * (nbytes - len(name))
            meta = ChunkMeta(b"f" * 16, 0, index, "uint8", (nbytes,))
            items.append((key, meta, memoryview(payload)))
        return items

    path = tmp_path / "c"
    async with await LmdbTier.open(path, segment_threshold_bytes=THRESHOLD, codec=CodecConfig(compress=False)) as tier:
        await tier.put_many(batch(first, 1))
        _assert_ledger_matches(tier)
        rewritten = batch(second, 2)
        await tier.put_many(rewritten)
        _assert_ledger_matches(tier)
        large_keys = {key for key, meta, _ in rewritten if meta.shape[0] == large}
        assert set(_pointers(tier)) == large_keys and len(large_keys) == 3
        assert tier.statistics().records == len(second)
        read = await _read(tier, rewritten)
        assert [(meta, data) for meta, data in read] == [(meta, bytes(view)) for _, meta, view in rewritten]
        assert sum(recs for _, recs, _ in _ledger(tier).values()) == 3
    async with await LmdbTier.open(path) as tier:
        _assert_ledger_matches(tier)
        assert await tier.check() == []


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
        tier._writes.segment_writer.rotate()
        tier._reads.segment_reader.forget([victim])
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
        "from kvtier.tools.testing.children import make_batch, chunk_content\n"
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
            ends = tier._db.read_txn(lambda txn: committed_ends(txn, tier._db.tables.segments))
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

    from kvtier.tiers.lmdb import segment_reader, segments

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
            assert tier._writes.segment_writer.direct is False
            assert len(_pointers(tier)) == 2
            await _assert_served(tier, items)

    asyncio.run(run())
    monkeypatch.undo()
    asyncio.run(_reopen_and_serve(path, items))


async def _reopen_and_serve(path: Path, items: List[Item]) -> None:
    async with await LmdbTier.open(path) as tier:
        await _assert_served(tier, items)


def _page_aligned(nbytes: int) -> memoryview:
    """A writable page-aligned buffer (as a host slot is)."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]


def _layout(record: "segments.SegmentRecord") -> bytes:
    return b"".join(bytes(v) for v in record.iovecs())


def test_segment_record_is_head_page_then_payload_pages_borrowed_only_when_aligned() -> None:
    """encode_for_segments: below the threshold the plain record; at or above it the head in a
    zero-padded page and the payload from the next page boundary -- written straight from the
    caller's buffer when that is page-aligned and the record raw (its partial last page copied),
    copied into a pooled buffer otherwise; the pooled pages are reused after release."""
    from kvtier.tiers.record_format import encode_record, header_end_of

    meta = ChunkMeta(b"fp", 0, 0, "uint8", (9000,))
    content = (bytes(range(256)) * 36)[:9000]
    aligned = _page_aligned(9000)
    aligned[:] = content
    off_page = _page_aligned(9000 + 64)[64:]  # a bytes object may start on a page boundary by chance
    off_page[:] = content
    for raw, codec, borrowed in ((off_page, CodecConfig(compress=False), False),
                                 (aligned, CodecConfig(compress=False), True),
                                 (bytes(9000), CodecConfig(), False),  # compressed: planes are ours
                                 (aligned[1:], CodecConfig(compress=False), False)):  # off a page boundary
        want = encode_record(b"k" * 16, meta if len(raw) == 9000 else ChunkMeta(b"fp", 0, 0, "uint8", (len(raw),)), raw, codec)
        key_meta = ChunkMeta(b"fp", 0, 0, "uint8", (len(raw),))
        small = segments.encode_for_segments(b"k" * 16, key_meta, raw, codec, len(want) + 1)
        assert isinstance(small, bytes) and small == want
        big = segments.encode_for_segments(b"k" * 16, key_meta, raw, codec, len(want))
        assert isinstance(big, segments.SegmentRecord) and len(big) == len(want) and big.borrows == borrowed
        head = header_end_of(want)
        assert big.head == want[:head]
        layout = _layout(big)
        assert len(layout) % 4096 == 0 and all(v.nbytes % 4096 == 0 for v in big.iovecs())
        assert layout == want[:head].ljust(4096, b"\0") + want[head:].ljust(len(layout) - 4096, b"\0")
        if borrowed:  # the payload's whole pages are the caller's memory, not a copy
            assert len(big.iovecs()) == 3 and big.iovecs()[1].obj is aligned.obj
        segments.release_records([big, small])
    first = segments.encode_for_segments(b"k" * 16, meta, content, CodecConfig(compress=False), 1)
    pages = first._pages
    first.release()
    again = segments.encode_for_segments(b"k" * 16, meta, content, CodecConfig(compress=False), 1)
    assert again._pages is pages  # reused, not a fresh map


@pytest.mark.asyncio
async def test_direct_reads_into_aligned_buffers_bitwise_and_damage_anywhere_is_a_miss(tmp_path: Path) -> None:
    """Page-aligned buffers of the payload's size are read into directly (head page + payload in
    one vectored read, partial last page through a pooled page); unaligned ones through a pooled
    buffer; both bitwise. A flipped byte in the head or in the payload is a miss, quarantined."""
    sizes = [65536, 65536 + 100, 5 * 4096 + 1, 200_000]
    items = _items(5, 0, sizes)
    aligned_raw = []
    for key, meta, raw in items:  # write from page-aligned buffers: borrowed, not copied
        buf = _page_aligned(raw.nbytes)
        buf[:] = raw
        aligned_raw.append((key, meta, buf))
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(aligned_raw)
        assert set(_pointers(tier)) == {it[0] for it in items}
        assert all(p.split and p.offset % 4096 == 0 for p in _pointers(tier).values())
        outs = [_page_aligned(it[2].nbytes) for it in items]
        metas = await tier.get_many_into([(it[0], out) for it, out in zip(items, outs)])
        assert metas == [it[1] for it in items]
        assert [bytes(o) for o in outs] == [chunk_content(it[0]) for it in items]
        await _assert_served(tier, items)  # bytearrays: not page-aligned
        head_hit, payload_hit = items[0][0], items[1][0]
        pointer = _pointers(tier)[head_hit]
        await asyncio.to_thread(corrupt_stored_record, tier, head_hit, offset_from_end=pointer.length - 20)
        await asyncio.to_thread(corrupt_stored_record, tier, payload_hit, offset_from_end=1)
        outs = [_page_aligned(it[2].nbytes) for it in items]
        metas = await tier.get_many_into([(it[0], out) for it, out in zip(items, outs)])
        assert metas == [None, None, items[2][1], items[3][1]]
        await tier.flush()
        assert sorted(tier.quarantined_keys()) == sorted([head_hit, payload_hit])
        _assert_ledger_matches(tier)
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_first_layout_pointers_are_still_read_and_freed(tmp_path: Path) -> None:
    """A cache written by the first segment layout (the record's bytes in one run, 28-byte
    pointers) is read bitwise, verified, and its segment freed when its records go."""
    items = _items(6, 0, [65536, 70000])
    async with await LmdbTier.open(tmp_path / "c", segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(items)
        records = {key: tier._reads.segment_reader.read(p.pack()) for key, p in _pointers(tier).items()}
        name = segments.segment_name(os.getpid(), 999)
        old: Dict[bytes, SegmentPointer] = {}
        at = 0
        with open(tmp_path / "c" / name, "wb") as f:
            for key, record in records.items():
                f.write(record.ljust(-(-len(record) // 4096) * 4096, b"\0"))
                old[key] = SegmentPointer(os.getpid(), 999, at, len(record))
                at += -(-len(record) // 4096) * 4096

        def body(txn):
            ledger = segments.Ledger(txn, tier._db.tables.segments)
            for key, pointer in old.items():
                ledger.drop(txn.get(key, db=tier._db.tables.chunks))
                ledger.add(pointer)
                txn.put(key, pointer.pack(), db=tier._db.tables.chunks)
            ledger.commit()
            tier._writes.emptied_segments += ledger.emptied
            return lambda: None

        await asyncio.to_thread(tier._writer.call, lambda: tier._writes.write(body))
        assert all(len(p.pack()) == 28 and not p.split for p in _pointers(tier).values())
        assert set(_segment_files(tmp_path / "c")) == {name}  # the split-layout segment was emptied
        await _assert_served(tier, items)
        outs = [_page_aligned(it[2].nbytes) for it in items]
        assert await tier.get_many_into([(it[0], o) for it, o in zip(items, outs)]) == [it[1] for it in items]
        assert [bytes(o) for o in outs] == [chunk_content(it[0]) for it in items]
        assert tier.verify().ok == 2
        _assert_ledger_matches(tier)
        await tier.delete_many([it[0] for it in items])
        assert _segment_files(tmp_path / "c") == {}


class _SlowSegmentWrite(IOHook):
    """Holds the writer thread before each segment append (the tier's "put" before it)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.started = threading.Event()

    def before(self, op: str) -> None:
        if op == "put":
            self.started.set()
            time.sleep(self.delay_s)


@pytest.mark.asyncio
async def test_cancelled_put_returns_only_after_borrowed_buffers_are_written(tmp_path: Path) -> None:
    """The buffer rule with records written straight from the caller's buffers: a cancelled
    put_many re-raises CancelledError only once the batch has landed (nothing reads the buffers
    any more); the batch landed bitwise."""
    items = _items(7, 0, [65536, 65536])
    aligned = []
    for key, meta, raw in items:
        buf = _page_aligned(raw.nbytes)
        buf[:] = raw
        aligned.append((key, meta, buf))
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD) as tier:
        hook = _SlowSegmentWrite(0.3)
        tier._io_hook = hook
        task = asyncio.ensure_future(tier.put_many(aligned))
        assert await asyncio.to_thread(hook.started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        tier._io_hook = IOHook()
        assert await tier.contains_many([it[0] for it in items]) == [True, True]  # landed before the raise
        for _, _, buf in aligned:
            buf[:] = bytes(buf.nbytes)  # the caller reuses its buffers: the tier must not care
        await _assert_served(tier, items)


_DURABILITY_CHILD = """
import asyncio, mmap, sys
from pathlib import Path
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig

async def main(path):
    async with await LmdbTier.open(path, codec=CodecConfig(compress=False), segment_threshold_bytes=16384,
                                   segment_max_bytes=1 << 20) as tier:
        for b in range(5):
            items = []
            for i, size in enumerate([65536, 300_000, 1000, 200_000]):
                buf = memoryview(mmap.mmap(-1, size))
                buf[:] = bytes([b * 7 + i]) * size
                items.append((b"k-%d-%d" % (b, i), ChunkMeta(b"f", 0, i, "uint8", (size,)), buf))
            await tier.put_many(items)
        await tier.delete_many([b"k-0-%d" % i for i in range(4)])

asyncio.run(main(Path(sys.argv[1])))
"""

_SYSCALL = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\((\d+)<([^>]*)>)")


def _durability_violations(trace: str, cache: Path) -> Tuple[List[str], Dict[str, int]]:
    """Replay an ``strace -f -y`` log: a new segment's name must be synced (``fsync`` of the cache
    directory) before any write to the segment, and every segment write synced (``fdatasync``)
    before any write to ``data.mdb`` starts -- the order that keeps a power cut from leaving a
    committed pointer to bytes the disk never got. (A segment created ahead and not yet written
    holds no byte a pointer could name, so a commit may run while its name is being synced.)"""
    dirty: Set[str] = set()  # segments with completed writes not yet synced
    unnamed: Set[str] = set()  # segments created since the last directory fsync
    pending: Dict[str, Tuple[str, str]] = {}  # pid -> (syscall, path) of an unfinished call
    counts = {"segment writes": 0, "segment syncs": 0, "lmdb writes": 0, "segments created": 0}
    violations: List[str] = []
    for line in trace.splitlines():
        m = _SYSCALL.match(line)
        if m is None:
            if "openat(" in line and "O_CREAT" in line and ".kvs" in line and "= -1" not in line:
                name = line.split('"')[1].rsplit("/", 1)[-1]
                unnamed.add(name)
                counts["segments created"] += 1
            continue
        pid, resumed, call, _fd, path = m.groups()
        if resumed:
            call, path = pending.pop(pid, (resumed, ""))
        elif "<unfinished" in line:
            pending[pid] = (call, path)
            if path.endswith("data.mdb") and call.startswith(("pwrite", "write")):
                counts["lmdb writes"] += 1
                if dirty:
                    violations.append(f"data.mdb write while {sorted(dirty)} unsynced")
            continue
        name = path.rsplit("/", 1)[-1]
        if name.endswith(".kvs") and call.startswith("pwrite"):
            if name in unnamed:
                violations.append(f"write to {name} before its name was synced")
            dirty.add(name)
            counts["segment writes"] += 1
        elif name.endswith(".kvs") and call in ("fdatasync", "fsync"):
            dirty.discard(name)
            counts["segment syncs"] += 1
        elif path == str(cache) and call == "fsync":
            unnamed.clear()
        elif name == "data.mdb" and call.startswith(("pwrite", "write")) and not resumed:
            counts["lmdb writes"] += 1
            if dirty:
                violations.append(f"data.mdb write while {sorted(dirty)} unsynced")
    return violations, counts


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to record the syscall order")
def test_power_cut_order_segment_bytes_and_names_are_synced_before_any_index_write(tmp_path: Path) -> None:
    """Power-loss safety, checked on the syscalls a real process makes (strace): every segment
    write is fdatasync'd, and every new segment's directory entry fsync'd, before LMDB writes the
    transaction that points at them. A power cut keeps what was synced, so a committed pointer
    always finds its bytes (kill -9 is covered above; this is the part only ordering proves)."""
    cache = tmp_path / "c"
    log = tmp_path / "trace.txt"
    proc = subprocess.run(
        ["strace", "-f", "-y", "-qq", "-o", str(log), "-e", "trace=openat,pwrite64,pwritev,pwritev2,write,writev,fdatasync,fsync",
         sys.executable, "-c", _DURABILITY_CHILD, str(cache)],
        capture_output=True, text=True, timeout=120,
    )
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    violations, counts = _durability_violations(log.read_text(), cache)
    assert violations == []
    # not vacuous: batches went to segments (rotating at 1 MiB) and were committed
    assert counts["segment writes"] >= 15 and counts["segment syncs"] >= 5
    assert counts["segments created"] >= 2 and counts["lmdb writes"] >= 6


@pytest.mark.asyncio
async def test_a_lone_put_allocates_its_blocks_and_the_next_batches_before_writing_and_the_tail_goes_back(
        tmp_path: Path) -> None:
    """The blocks a batch writes are allocated first (fallocate: the direct writes then land inside
    the file). A put begun with nothing in flight allocates ALLOCATE_AHEAD_BATCHES batches of its
    size, so the puts after it allocate nothing (ext4's fallocate waits for the writes in flight
    to the file); the unused tail is given back when the tier closes: every segment then ends
    exactly at its committed records."""
    skip_without_fallocate(tmp_path)
    allocations: List[Tuple[int, int]] = []
    real = segments._fallocate

    def recording(fd: int, offset: int, length: int) -> bool:
        allocations.append((offset, length))
        return real(fd, offset, length)

    segments._fallocate = recording
    try:
        async with await LmdbTier.open(tmp_path / "c", segment_threshold_bytes=THRESHOLD) as tier:
            for batch in range(3):
                items = _items(8, batch, [65536, 100_000, 700])
                await tier.put_many(items)
                (name, (_, _, end)), = _ledger(tier).items()
                extents = sorted((p.offset, p.extent) for p in _pointers(tier).values())
                batch_extent = extents[0][1] + extents[1][1]  # its two segment records
                assert end == (batch + 1) * batch_extent
                # active: the blocks of ALLOCATE_AHEAD_BATCHES batches, allocated by the first
                assert _segment_files(tmp_path / "c") == {name: segments.ALLOCATE_AHEAD_BATCHES * batch_extent}
            items = [it for batch in range(3) for it in _items(8, batch, [65536, 100_000, 700])]
            await _assert_served(tier, items)
    finally:
        segments._fallocate = real
    assert allocations == [(0, segments.ALLOCATE_AHEAD_BATCHES * batch_extent)]
    assert _segment_files(tmp_path / "c") == {name: 3 * batch_extent}  # closed: its committed end


@pytest.mark.asyncio
async def test_a_full_disk_at_segment_allocation_is_typed_commits_nothing_and_recovers(tmp_path: Path) -> None:
    """A batch that cannot get its segment blocks fails with TierFullError before any byte of it
    is written; nothing of it is visible, earlier records still read bitwise, and puts work again
    once space returns (real tmpfs, filled to the last byte)."""
    from kvtier.errors import TierFullError

    from mounts import fill_up, tmpfs

    with tmpfs(tmp_path / "mnt", "size=8m,mode=0700") as mnt:
        async with await LmdbTier.open(mnt / "c", segment_threshold_bytes=THRESHOLD,
                                       segment_max_bytes=1 << 20) as tier:
            early = _items(9, 0, [1 << 20, 500_000])
            await tier.put_many(early)
            fill_up(mnt / "filler")
            late = _items(9, 1, [1 << 20, 600_000])
            with pytest.raises(TierFullError, match="disk full"):
                await tier.put_many(late)
            assert await tier.contains_many([it[0] for it in late]) == [False, False]
            await _assert_served(tier, early)
            (mnt / "filler").unlink()
            await tier.put_many(late)
            await _assert_served(tier, early + late)
            _assert_ledger_matches(tier)
            assert await tier.check() == []


@pytest.mark.asyncio
async def test_adjacent_records_are_read_together_and_a_short_one_fails_alone(tmp_path: Path) -> None:
    """Records written in one batch lie one after another and come back in one vectored read per
    run; when the segment ends inside the last of them, that one is a miss (quarantined) and its
    neighbours in the run still hit bitwise."""
    items = _items(11, 0, [65536] * 6)
    aligned = []
    for key, meta, raw in items:
        buf = _page_aligned(raw.nbytes)
        buf[:] = raw
        aligned.append((key, meta, buf))
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False), read_workers=1,
                                   segment_threshold_bytes=THRESHOLD) as tier:  # one read slice: one run
        await tier.put_many(aligned)
        by_offset = sorted(_pointers(tier).items(), key=lambda kv: kv[1].offset)
        assert [p.offset for _, p in by_offset] == [k * by_offset[0][1].extent for k in range(6)]
        calls: List[int] = []
        real = segment_reader._preadv_all

        def counting(fd: int, views: List[memoryview], offset: int) -> bool:
            calls.append(sum(v.nbytes for v in views))
            return real(fd, views, offset)

        segment_reader._preadv_all = counting
        try:
            outs = [_page_aligned(65536) for _ in items]
            assert await tier.get_many_into([(it[0], out) for it, out in zip(items, outs)]) == [it[1] for it in items]
        finally:
            segment_reader._preadv_all = real
        assert calls == [6 * by_offset[0][1].extent]  # the six records in one read
        last_key, last = by_offset[-1]
        await asyncio.to_thread(tier._writer.call, tier._writes.segment_writer.rotate)
        os.truncate(tmp_path / "c" / last.name, last.offset + last.extent // 2)
        outs = [_page_aligned(65536) for _ in items]
        metas = await tier.get_many_into([(it[0], out) for it, out in zip(items, outs)])
        for it, meta, out in zip(items, metas, outs):
            if it[0] == last_key:
                assert meta is None
            else:
                assert meta == it[1] and bytes(out) == chunk_content(it[0])
        await tier.flush()
        assert tier.quarantined_keys() == [last_key]
        assert tier.statistics().corrupt == 1


def test_adjacent_runs_partition_in_order_within_the_bounds() -> None:
    """adjacent_runs against its definition, over random extents and lane counts."""
    import random

    rng = random.Random(3)
    for _ in range(500):
        extents = [rng.choice([4096, 65536, 266240, 1 << 20, 4 << 20, 5 << 20]) for _ in range(rng.randrange(0, 400))]
        lanes = rng.randrange(1, 9)
        runs = segments.adjacent_runs(extents, lanes=lanes)
        assert [k for run in runs for k in run] == list(range(len(extents)))  # a partition, in order
        limit = max(4096, min(segments.RUN_BYTES, sum(extents) // lanes))
        for run in runs:
            assert len(run) >= 1 and len(run) <= segments._RUN_RECORDS
            assert len(run) == 1 or sum(extents[k] for k in run) <= limit
        for a, b in zip(runs, runs[1:]):  # a run ends only where the next record would not fit
            assert len(a) == segments._RUN_RECORDS or sum(extents[k] for k in a) + extents[b.start] > limit


def test_write_runs_partition_in_order_balanced_over_the_lanes() -> None:
    """write_runs against its definition: a partition in order, at most _RUN_RECORDS records a run,
    a multiple of the lanes of runs about WRITE_RUN_BYTES each, and -- dealt round-robin as
    SegmentWriter.begin deals them -- every lane within one record of its share of the bytes."""
    import random

    mib, page = 1 << 20, 4096
    # The spill's 64 MiB batches: one write of about 16 MiB per lane, whatever the record size.
    assert segments.write_runs([4 * mib + page] * 16, lanes=4) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert [len(r) for r in segments.write_runs([mib + page] * 64, lanes=4)] == [16, 16, 16, 16]
    assert [len(r) for r in segments.write_runs([mib + page] * 128, lanes=4)] == [16] * 8
    assert segments.write_runs([mib + page] * 5, lanes=4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert segments.write_runs([], lanes=4) == []
    # a batch of fewer records than lanes: one write each, whatever their sizes
    assert segments.write_runs([69632, 303104, 204800], lanes=4) == [range(0, 1), range(1, 2), range(2, 3)]
    assert segments.write_runs([64 * mib], lanes=4) == [range(0, 1)]  # a record is never split

    rng = random.Random(5)
    for _ in range(500):
        extents = [rng.choice([4096, 65536, 266240, 1 << 20, 4 << 20, 5 << 20]) for _ in range(rng.randrange(0, 1200))]
        lanes = rng.randrange(1, 9)
        runs = segments.write_runs(extents, lanes=lanes)
        assert [k for run in runs for k in run] == list(range(len(extents)))
        assert all(1 <= len(run) <= segments._RUN_RECORDS for run in runs)
        total, unit = sum(extents), lanes * segments.WRITE_RUN_BYTES
        count = lanes * max(1, (total + unit // 2) // unit)
        if extents and max(extents) * count <= total and all(len(run) < segments._RUN_RECORDS for run in runs):
            # no record above a run's share, no run cut by the record bound: exactly ``count``
            # runs, each ending within a record of its share, so each lane near its own
            assert len(runs) == count
            per_lane = [sum(extents[k] for run in runs[i::lanes] for k in run) for i in range(lanes)]
            assert max(per_lane) - min(per_lane) <= 2 * max(extents) * (count // lanes)


def _format_marker(path: Path) -> bytes:
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            return bytes(txn.get(b"format", db=meta))
    finally:
        env.close()


@pytest.mark.asyncio
async def test_a_cache_that_may_hold_pointers_is_marked_so_an_older_reader_refuses_it(tmp_path: Path) -> None:
    """The tier format marker says whether records may be segment pointers: an all-inline cache
    stays b"1" (readable by kvtier before segments), the first writable open with segments marks
    it b"2"; a marker this kvtier does not read is refused with its value in the message."""
    import lmdb

    from kvtier.errors import TierIOError

    items = _items(12, 0, [65536, 700])
    async with await LmdbTier.open(tmp_path / "inline", segment_threshold_bytes=None) as tier:
        await tier.put_many(items)
    assert _format_marker(tmp_path / "inline") == b"1"
    async with await LmdbTier.open(tmp_path / "inline", segment_threshold_bytes=THRESHOLD) as tier:
        await _assert_served(tier, items)  # an inline cache reads on, now marked for pointers
    assert _format_marker(tmp_path / "inline") == b"2"
    async with await LmdbTier.open(tmp_path / "inline", segment_threshold_bytes=None) as tier:
        await _assert_served(tier, items)
    assert _format_marker(tmp_path / "inline") == b"2"  # never marked back: pointers may be there
    async with await LmdbTier.open(tmp_path / "new") as tier:  # the default: segments
        await tier.put_many(items)
    assert _format_marker(tmp_path / "new") == b"2"

    env = lmdb.open(str(tmp_path / "new"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"3", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(TierIOError, match=r"has tier format b'3', this kvtier reads b'1' and b'2'"):
        await LmdbTier.open(tmp_path / "new")


@pytest.mark.asyncio
async def test_a_pointer_damaged_off_a_page_boundary_is_a_miss_not_an_io_error(tmp_path: Path) -> None:
    """Every record starts on a page; a pointer whose offset lost that (a flipped low bit) is
    corruption -- a miss, quarantined -- and never reaches a direct read (which would fail with
    EINVAL and look like a broken disk)."""
    items = _items(13, 0, [65536, 70000])
    async with await LmdbTier.open(tmp_path / "c", segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(items)
        bad = items[1][0]
        pointer = _pointers(tier)[bad]
        damaged = SegmentPointer(pointer.pid, pointer.counter, pointer.offset + 100, pointer.length, pointer.head)

        def body(txn):
            txn.put(bad, damaged.pack(), db=tier._db.tables.chunks)
            return lambda: None

        await asyncio.to_thread(tier._writer.call, lambda: tier._writes.write(body))
        outs = [_page_aligned(it[2].nbytes) for it in items]
        assert await tier.get_many_into([(it[0], o) for it, o in zip(items, outs)]) == [items[0][1], None]
        await tier.flush()
        assert tier.quarantined_keys() == [bad] and tier.statistics().corrupt == 1


@pytest.mark.asyncio
async def test_a_batch_read_in_run_slices_is_bitwise_finds_one_bad_record_and_survives_a_cancel(tmp_path: Path) -> None:
    """A batch of adjacent records is read in slices of one vectored read each, several per read
    thread: every byte comes back, a flipped payload byte in the middle of a run is a miss of that
    record only (checked on the reading thread, its neighbours in the same read intact), and a
    read cancelled while its slices run leaves the tier consistent and readable."""
    sizes = [64 << 10] * 48
    items = _items(11, 0, sizes)
    aligned = []
    for key, meta, raw in items:
        buf = _page_aligned(raw.nbytes)
        buf[:] = raw
        aligned.append((key, meta, buf))
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False), segment_threshold_bytes=THRESHOLD,
                                   read_workers=2) as tier:
        await tier.put_many(aligned)
        pointers = _pointers(tier)
        ordered = sorted(pointers.values(), key=lambda p: p.offset)
        assert all(b.offset == a.offset + a.extent for a, b in zip(ordered, ordered[1:]))  # one run on disk
        outs = [_page_aligned(n) for n in sizes]
        assert await tier.get_many_into([(it[0], out) for it, out in zip(items, outs)]) == [it[1] for it in items]
        assert [bytes(o) for o in outs] == [chunk_content(it[0]) for it in items]

        bad = items[17][0]
        await asyncio.to_thread(corrupt_stored_record, tier, bad, offset_from_end=4097)
        outs = [_page_aligned(n) for n in sizes]
        metas = await tier.get_many_into([(it[0], out) for it, out in zip(items, outs)])
        assert [i for i, m in enumerate(metas) if m is None] == [17]
        assert [bytes(o) for i, o in enumerate(outs) if i != 17] == [chunk_content(it[0]) for i, it in enumerate(items) if i != 17]
        assert tier.statistics().corrupt == 1

        reading = asyncio.ensure_future(tier.get_many_into([(it[0], _page_aligned(n)) for it, n in zip(items, sizes)]))
        await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await tier.flush()
        assert tier.quarantined_keys() == [bad]
        good = [it for i, it in enumerate(items) if i != 17]
        outs = [_page_aligned(it[2].nbytes) for it in good]
        assert await tier.get_many_into([(it[0], out) for it, out in zip(good, outs)]) == [it[1] for it in good]
        assert [bytes(o) for o in outs] == [chunk_content(it[0]) for it in good]
        _assert_ledger_matches(tier)
        assert await tier.check() == []


def test_split_extent_is_the_extent_of_a_split_record_with_a_one_page_head() -> None:
    for payload in (1, 4096, 5000, 1 << 20):
        pointer = SegmentPointer(pid=1, counter=0, offset=0, length=300 + payload, head=300)
        assert segments.split_extent(payload) == pointer.extent
