"""Compaction of partly-live payload segments (tiers/lmdb/compaction.py), on real LMDB and files:
exact disk bytes before and after, every record bitwise afterwards, LRU order and access times
untouched, concurrent writes (this process between plan and step, another process between the copy
and the commit) winning, another process's active segment skipped, corrupt sources quarantined not
copied, the automatic trigger, ``kvtier gc``'s report, a random model test against a dict, and
kill -9 during compaction."""

from __future__ import annotations

import asyncio
import re
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from kvtier.errors import ClosedError, TierFullError, TierIOError
from kvtier.tiers.base import ChunkMeta, IOHook, Removal
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.lmdb.compaction import SegmentUsage, choose_segments, segment_disk_bytes
from kvtier.tiers.lmdb.segment_reader import SegmentReader
from kvtier.tiers.lmdb.segments import committed_ends
from kvtier.tiers.record_format import CodecConfig, decode_record
from kvtier.tools.testing.children import check_cache, chunk_content, make_batch
from kvtier.tools.testing.fault_child import run_kill_chains, summarize_kills
from kvtier.tools.testing.faults import corrupt_stored_record
from segment_checks import Item, assert_ledger_matches, assert_served, ledger, pointers, read_items, segment_files

THRESHOLD = 16 << 10
RECORD = 200_000  # raw bytes; with compression off a record takes 49 pages of a segment
SETUP = dict(segment_threshold_bytes=THRESHOLD, segment_max_bytes=1 << 20, codec=CodecConfig(compress=False))


def _record_size(tier: LmdbTier) -> Tuple[int, int]:
    """A ``RECORD``-sized record's length and the bytes it takes in its segment (head page(s), then
    the payload's pages)."""
    pointer = next(iter(pointers(tier).values()))
    return pointer.length, pointer.extent


def _atimes(tier: LmdbTier) -> Dict[bytes, bytes]:
    def body(txn) -> Dict[bytes, bytes]:
        return {bytes(k): bytes(v) for k, v in txn.cursor(db=tier._db.tables.atime).iternext(keys=True, values=True)}

    return tier._db.read_txn(body)


async def _three_segments(root: Path, live: Tuple[int, int, int], name: str = "c") -> Tuple[Path, List[List[Item]]]:
    """In ``root / name``: six batches of five records, two batches per 1 MiB segment (a segment
    rotates once past 1 MiB), then delete all but ``live[i]`` records of segment ``i``; compaction
    off meanwhile. Returns the directory and the records kept, per segment."""
    path = root / name
    batches = [make_batch(10, b, [RECORD] * 5) for b in range(6)]
    async with await LmdbTier.open(path, segment_compaction_live_fraction=0.0, **SETUP) as tier:
        for batch in batches:
            await tier.put_many(batch)
        by_segment: Dict[str, List[Item]] = {}
        for it in (it for b in batches for it in b):
            by_segment.setdefault(pointers(tier)[it[0]].name, []).append(it)
        assert sorted(len(v) for v in by_segment.values()) == [10, 10, 10]
        kept = []
        for keep, (_, its) in zip(live, sorted(by_segment.items(), key=lambda kv: int(kv[0].split("-")[2][:-4]))):
            await tier.delete_many([k for k, _, _ in its[keep:]])
            kept.append(its[:keep])
    return path, kept


@pytest.mark.asyncio
async def test_compaction_frees_mostly_dead_segments_down_to_the_exact_live_bytes(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (2, 4, 7))  # 20 %, 40 % and 70 % live
    async with await LmdbTier.open(path, **SETUP) as tier:
        before_files = segment_files(path)
        table = ledger(tier)
        assert before_files == {name: end for name, (_, _, end) in table.items()}  # nothing but committed bytes
        record, extent = _record_size(tier)
        assert sorted(recs for _, recs, _ in table.values()) == [2, 4, 7]
        lru_before, atimes_before = list(tier._writes.lru), _atimes(tier)
        survivor = next(name for name, (_, recs, _) in table.items() if recs == 7)

        report = await tier.compact_segments()

        after_files = segment_files(path)
        # the moves filled a new segment past half: its successor may be made ahead, empty
        assert after_files.pop(tier._writes.segment_writer.spare, 0) == 0
        assert (report.segments, report.records, report.bytes, report.files_freed) == (2, 6, 6 * record, 2)
        assert report.bytes_freed == sum(size for name, size in before_files.items() if name != survivor)
        assert (report.quarantined, report.superseded, report.skipped_locked) == (0, 0, 0)
        # exactly: the 70 %-live segment as it was, plus one new segment holding the 6 moved records
        (new,) = set(after_files) - {survivor}
        assert after_files == {survivor: before_files[survivor], new: 6 * extent}
        assert sum(after_files.values()) == sum(before_files.values()) - report.bytes_freed + 6 * extent
        assert segment_disk_bytes(path) == sum(after_files.values())
        assert {p.name for p in pointers(tier).values()} == {survivor, new}
        assert_ledger_matches(tier)
        # not an access: LRU order and the access-time table are as they were
        assert list(tier._writes.lru) == lru_before and _atimes(tier) == atimes_before
        await assert_served(tier, [it for its in kept for it in its])
        deleted = [it for b in (make_batch(10, b, [RECORD] * 5) for b in range(6)) for it in b
                   if it[0] not in {i[0] for its in kept for i in its}]
        assert all(meta is None for meta, _ in await read_items(tier, deleted))
        stats = tier.statistics().extra
        assert (stats["compaction_passes"], stats["compacted_records"], stats["compacted_bytes"]) == (1, 6, 6 * record)
        assert (stats["compacted_segments"], stats["compaction_bytes_freed"]) == (2, report.bytes_freed)
        assert await tier.check() == []
        assert tier.verify().corrupt == []
        # a second pass finds nothing below the threshold
        again = await tier.compact_segments()
        spare = tier._writes.segment_writer.spare
        assert (again.segments, again.records) == (0, 0)
        assert {name: size for name, size in segment_files(path).items() if name != spare} == after_files
    with pytest.raises(ClosedError, match="is closed"):
        await tier.compact_segments()
    async with await LmdbTier.open(path, readonly=True) as tier:
        with pytest.raises(TierIOError, match="is open read-only"):
            await tier.compact_segments()
        with pytest.raises(ValueError, match=r"segment_compaction_live_fraction must be a number in \[0, 1\), got 2"):
            tier.compact_segments_sync(live_fraction=2)
    print(f"compaction: segment files {sum(before_files.values())} -> {sum(after_files.values())} bytes "
          f"for {sum(len(k) for k in kept)} live records of {record} bytes")


@pytest.mark.asyncio
async def test_segment_files_over_the_capacity_margin_compact_segments_above_the_fraction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.tiers.lmdb import compaction

    path, kept = await _three_segments(tmp_path, (6, 6, 6))  # 60 % live each: above one half
    async with await LmdbTier.open(path, **SETUP) as tier:
        assert (await tier.compact_segments()).segments == 0
    with LmdbTier(path, map_size_bytes=1 << 20) as tier:
        record, extent = _record_size(tier)
    # 18 live records; files of 30 records' pages > 1.25 x 18 records: two segments go (30 - 4 - 4 < 22.5)
    monkeypatch.setattr(compaction, "PASS_LIVE_BYTES", 7 * record)  # one segment per pass
    async with await LmdbTier.open(path, capacity_bytes=18 * record, **SETUP) as tier:
        report = await tier.compact_segments()
        assert (report.segments, report.records, report.files_freed) == (2, 12, 2)
        assert tier.statistics().extra["compaction_passes"] == 2
        assert segment_disk_bytes(path) == 10 * extent + 12 * extent
        await assert_served(tier, [it for its in kept for it in its])
        assert_ledger_matches(tier)


@pytest.mark.asyncio
async def test_a_delete_leaving_a_closed_segment_below_the_fraction_compacts_it_automatically(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (10, 10, 7))
    async with await LmdbTier.open(path, **SETUP) as tier:
        victim = pointers(tier)[kept[2][0][0]].name
        await tier.delete_many([k for k, _, _ in kept[2][2:]])  # 2 of 10 left: below one half
        await _gone(path, victim)
        await tier.flush()
        stats = tier.statistics().extra
        assert (stats["compacted_records"], stats["compacted_segments"]) == (2, 1)
        await assert_served(tier, kept[0] + kept[1] + kept[2][:2])
        # a plan that took long delays the next automatic one (PLAN_DUTY): as if it took 15 ms
        assert tier._compactor.next_automatic_at > 0  # set by the first plan
        tier._compactor.next_automatic_at = time.monotonic() + 0.3
        second = pointers(tier)[kept[1][0][0]].name
        await tier.delete_many([k for k, _, _ in kept[1][2:]])
        await asyncio.sleep(0.15)
        assert second in segment_files(path)
        await _gone(path, second)
        assert_ledger_matches(tier)
        assert await tier.check() == []
    # off: the same delete leaves the segment alone
    d, kept = await _three_segments(tmp_path, (10, 10, 7), "d")
    async with await LmdbTier.open(d, segment_compaction_live_fraction=0, **SETUP) as tier:
        files = segment_files(d)
        await tier.delete_many([k for k, _, _ in kept[2][2:]])
        await tier.flush()
        assert set(segment_files(d)) == set(files)
        assert (await tier.compact_segments()).records == 0


@pytest.mark.asyncio
async def test_segments_below_the_fraction_at_open_are_compacted_after_the_first_commit(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (2, 10, 10))
    async with await LmdbTier.open(path, **SETUP) as tier:
        source = pointers(tier)[kept[0][0][0]].name
        await asyncio.sleep(0.2)
        assert source in segment_files(path)  # reading alone starts nothing
        await tier.put_many(make_batch(14, 0, [700]))  # any commit: an unrelated inline record
        await _gone(path, source)
        await assert_served(tier, kept[0])
        assert_ledger_matches(tier)


@pytest.mark.asyncio
async def test_an_active_segment_emptied_below_the_fraction_is_compacted_once_it_rotates(tmp_path: Path) -> None:
    async with await LmdbTier.open(tmp_path / "c", **SETUP) as tier:
        first = make_batch(12, 0, [RECORD] * 6)  # 6 records: past 1 MiB, the next append rotates
        await tier.put_many(first)
        source = pointers(tier)[first[0][0]].name
        await tier.delete_many([k for k, _, _ in first[1:]])  # 1 of 6 left, but still the active segment
        await tier.flush()
        assert source in segment_files(tmp_path / "c") and tier.statistics().extra["compaction_passes"] == 0
        second = make_batch(12, 1, [RECORD])
        await tier.put_many(second)  # rotates: the closed segment is offered
        await _gone(tmp_path / "c", source)
        await tier.flush()
        assert tier.statistics().extra["compacted_records"] == 1
        await assert_served(tier, first[:1] + second)
        assert_ledger_matches(tier)


async def _churn_at_capacity(path: Path, fraction: float, hot_every: int) -> Tuple[int, int, int]:
    """96 one-record puts of 128 KiB into a 4 MiB tier (1 MiB segments), every ``hot_every``-th
    record read back after each put (kept young in the LRU; 0: none). Returns (bytes compacted,
    most segment bytes on disk, segment bytes at the end)."""
    hot: List[Item] = []
    worst = 0
    async with await LmdbTier.open(path, capacity_bytes=4 << 20, access_flush_interval_s=0.01,
                                   segment_compaction_live_fraction=fraction, **SETUP) as tier:
        for b in range(96):
            items = make_batch(13, b, [128 << 10])
            await tier.put_many(items)
            if hot_every and b % hot_every == 0:
                hot += items
            if hot:
                await assert_served(tier, hot)
                await tier.flush()  # the reads reach the LRU before the next put evicts
            worst = max(worst, segment_disk_bytes(path))
        await tier.flush()
        deadline = time.monotonic() + 20
        while tier._compactor.scheduled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await assert_served(tier, hot)
        assert await tier.check() == []
        return int(tier.statistics().extra["compacted_bytes"]), worst, segment_disk_bytes(path)


@pytest.mark.asyncio
async def test_under_steady_eviction_only_records_kept_young_are_moved(tmp_path: Path) -> None:
    # cold churn: every partial segment is being eaten by eviction: nothing is worth moving
    moved, worst, _ = await _churn_at_capacity(tmp_path / "cold", 0.5, 0)
    assert moved == 0 and worst <= (4 << 20) + (2 << 20)
    # one record in eight kept hot: without compaction their old segments pile up; with it they move
    _, worst_off, end_off = await _churn_at_capacity(tmp_path / "off", 0.0, 8)
    moved, worst, end = await _churn_at_capacity(tmp_path / "on", 0.5, 8)
    print(f"compaction at capacity (4 MiB): cold churn moved 0 bytes; with hot records segment files "
          f"end at {end_off} bytes without compaction, {end} with it ({moved} bytes moved)")
    assert moved > 0 and end < end_off and end <= (4 << 20) * 3 // 2


@pytest.mark.asyncio
async def test_writes_between_plan_and_step_win_and_nothing_stale_is_copied(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (4, 10, 10))
    a, b, c, d = kept[0]
    # automatic passes off: this test runs the steps itself
    async with await LmdbTier.open(path, segment_compaction_live_fraction=0, **SETUP) as tier:
        source = pointers(tier)[a[0]].name
        plan = await tier._reads.in_pool(lambda: tier._compactor.plan_pass(0.5))  # lists a, b, c, d with their pointers
        assert [k for k, _ in plan.pending] == sorted([a[0], b[0], c[0], d[0]], key=lambda k: pointers(tier)[k].offset)
        other = bytes(reversed(chunk_content(a[0])))
        await tier.put_many([(a[0], a[1], memoryview(other))])  # overwrite: a new pointer
        await tier.delete_many([b[0]])
        await _run_steps(tier, plan)
        assert (plan.report.records, plan.report.superseded, plan.report.files_freed) == (2, 2, 1)
        assert source not in segment_files(path)
        (meta, data), = await read_items(tier, [a])
        assert meta == a[1] and data == other
        assert (await read_items(tier, [b]))[0][0] is None
        await assert_served(tier, [c, d])
        assert_ledger_matches(tier)
        assert await tier.check() == []


async def _gone(path: Path, name: str) -> None:
    """Wait (at most 20 s) until segment ``name`` is deleted by background work."""
    deadline = time.monotonic() + 20
    while name in segment_files(path) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert name not in segment_files(path)


class _CancelAtTheFirstCommit(IOHook):
    """Cancels ``task`` from inside the first commit after arming, and lets that commit go on
    only once the cancellation has reached the caller."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.task, self.armed = loop, None, False

    def before(self, op: str) -> None:
        if op == "commit" and self.armed:
            self.armed = False
            self.loop.call_soon_threadsafe(self.task.cancel)
            deadline = time.monotonic() + 10
            while not self.task.done() and time.monotonic() < deadline:
                time.sleep(0.005)


@pytest.mark.asyncio
async def test_cancelling_compact_segments_lets_the_step_in_flight_commit_and_starts_no_other(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (4, 10, 10))
    async with await LmdbTier.open(path, **SETUP) as tier:
        source = pointers(tier)[kept[0][0][0]].name
        tier._compactor.step_bytes = 1  # one record per step
        hook = _CancelAtTheFirstCommit(asyncio.get_running_loop())
        tier._io_hook = hook
        hook.task = asyncio.ensure_future(tier.compact_segments())
        hook.armed = True
        with pytest.raises(asyncio.CancelledError):
            await hook.task
        await tier.flush()
        assert sorted(pointers(tier)[k].name == source for k, _, _ in kept[0]) == [False, True, True, True]
        assert tier.statistics().extra["compacted_records"] == 1
        assert_ledger_matches(tier)
        await assert_served(tier, kept[0])
        report = await tier.compact_segments()  # the rest, and the source goes
        assert (report.records, report.files_freed) == (3, 1) and source not in segment_files(path)
        await assert_served(tier, kept[0])
        assert await tier.check() == []


async def _run_steps(tier: LmdbTier, plan) -> None:
    """What compact_segments does after planning: the steps, then deleting the retired sources (no
    read transaction is open here)."""
    while not plan.done:
        await tier._writer.submit_async(lambda: tier._compactor.step(plan))
    freed = await tier._writer.submit_async(tier._compactor.remove_retired)
    plan.report.files_freed += freed.files_freed


@pytest.mark.asyncio
async def test_an_emptied_source_outlives_every_read_that_could_still_hold_its_pointer(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (2, 10, 10))
    async with await LmdbTier.open(path, **SETUP) as tier:
        source = pointers(tier)[kept[0][0][0]].name
        # a read transaction from before the move (as a read slice between its get and its pread)
        old_txn = tier._db.env.begin(buffers=True)
        old_value = bytes(old_txn.get(kept[0][0][0], db=tier._db.tables.chunks))
        report = await tier.compact_segments()
        assert (report.records, report.files_freed) == (2, 0)  # moved, but the file must stay
        assert source in segment_files(path) and source not in ledger(tier)
        fresh = SegmentReader(path)  # a reader that had not opened the file yet still finds it
        try:
            record = fresh.read(old_value)
        finally:
            fresh.close()
        meta, data = decode_record(kept[0][0][0], record)
        assert meta == kept[0][0][1] and bytes(data) == chunk_content(kept[0][0][0])
        old_txn.abort()
        await _gone(path, source)  # the timer's retries delete it now
        await tier.flush()  # after the writer job that deleted it (and counted it)
        assert tier.statistics().extra["compacted_segments"] == 1
        await assert_served(tier, kept[0])
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_reads_racing_the_moves_all_hit_bitwise(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (4, 4, 10))
    live = [it for its in kept for it in its]
    async with await LmdbTier.open(path, read_workers=2, **SETUP) as tier:
        tier._compactor.step_bytes = 1  # one record per step: as many commits and deletions as can be
        stop = asyncio.Event()
        rounds = 0

        async def reader() -> None:
            nonlocal rounds
            while not stop.is_set():
                await assert_served(tier, live)
                rounds += 1

        readers = [asyncio.ensure_future(reader()) for _ in range(2)]
        report = await tier.compact_segments()
        stop.set()
        await asyncio.gather(*readers)
        assert (report.records, report.files_freed) == (8, 2)
        stats = tier.statistics()
        assert (stats.misses, stats.corrupt) == (0, 0) and rounds > 0
        assert await tier.check() == []


_OTHER_WRITER = """
import asyncio, sys
from kvtier.tiers.lmdb import LmdbTier
async def main():
    async with await LmdbTier.open(sys.argv[1], segment_compaction_live_fraction=0) as t:  # no pass of its own
        await t.delete_many([bytes.fromhex(sys.argv[2])])
asyncio.run(main())
"""


class _OtherProcessDeletesBeforeTheCommit(IOHook):
    """On the compaction step's ``put`` (after its check and reads, before its copy and commit):
    another process deletes one of the keys being moved, and waits until it committed."""

    def __init__(self, path: Path, key: bytes) -> None:
        self.path, self.key, self.armed = path, key, False

    def before(self, op: str) -> None:
        if op == "put" and self.armed:
            self.armed = False
            subprocess.run([sys.executable, "-c", _OTHER_WRITER, str(self.path), self.key.hex()], check=True, timeout=60)


@pytest.mark.asyncio
async def test_another_process_changing_a_key_between_copy_and_commit_wins(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (3, 10, 10))
    async with await LmdbTier.open(path, **SETUP) as tier:
        hook = _OtherProcessDeletesBeforeTheCommit(path, kept[0][1][0])
        tier._io_hook = hook
        plan = await tier._reads.in_pool(lambda: tier._compactor.plan_pass(0.5))
        hook.armed = True
        await _run_steps(tier, plan)
        assert not hook.armed
        assert (plan.report.records, plan.report.superseded) == (2, 1)
        assert (await read_items(tier, [kept[0][1]]))[0][0] is None
        await assert_served(tier, [kept[0][0], kept[0][2]])
        assert_ledger_matches(tier)
        # our LRU still lists the key the other process deleted (the documented one-writer limit)
        problems = await tier.check()
        assert problems and all(kept[0][1][0].hex() in p for p in problems)
    async with await LmdbTier.open(path, **SETUP) as tier:  # the copy of the deleted record: an orphan tail
        assert await tier.check() == []
        assert sum(segment_files(path).values()) == sum(end for _, _, end in ledger(tier).values())


_HOLDER = """
import asyncio, sys
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig
from kvtier.tools.testing.children import make_batch
async def main():
    # no passes of its own: they would take the parent's mostly-dead segment first
    async with await LmdbTier.open(sys.argv[1], segment_threshold_bytes=16384, codec=CodecConfig(compress=False),
                                   segment_compaction_live_fraction=0) as t:
        items = make_batch(11, 0, [200_000] * 4)
        await t.put_many(items)
        await t.delete_many([k for k, _, _ in items[1:]])  # its active segment: 25 % live, and held
        print("holding", flush=True)
        sys.stdin.readline()
asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_a_segment_another_process_still_appends_to_is_skipped(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (2, 10, 10))
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _HOLDER, str(path),
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert (await asyncio.wait_for(child.stdout.readline(), 60)).strip() == b"holding"
        theirs = make_batch(11, 0, [RECORD] * 4)[:1]
        async with await LmdbTier.open(path, **SETUP) as tier:
            held = pointers(tier)[theirs[0][0]].name
            ours = pointers(tier)[kept[0][0][0]].name
            report = await tier.compact_segments()
            assert (report.segments, report.records, report.skipped_locked) == (1, 2, 1)
            assert held in segment_files(path) and ours not in segment_files(path)
            assert pointers(tier)[theirs[0][0]].name == held
            child.stdin.close()
            assert await asyncio.wait_for(child.wait(), 60) == 0
            # closed now: the next pass takes it
            report = await tier.compact_segments()
            assert (report.records, report.files_freed, report.skipped_locked) == (1, 1, 0)
            assert held not in segment_files(path)
            await assert_served(tier, kept[0] + theirs)
            assert_ledger_matches(tier)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


@pytest.mark.asyncio
async def test_a_corrupt_source_record_is_quarantined_not_copied(tmp_path: Path) -> None:
    path, kept = await _three_segments(tmp_path, (3, 10, 10))
    async with await LmdbTier.open(path, **SETUP) as tier:
        removed: List[Removal] = []
        tier.subscribe_removals(removed.extend)
        bad = kept[0][1][0]
        source = pointers(tier)[bad].name
        await asyncio.to_thread(corrupt_stored_record, tier, bad, offset_from_end=10)
        report = await tier.compact_segments()
        await asyncio.sleep(0.05)
        assert (report.records, report.quarantined, report.files_freed) == (2, 1, 1)
        assert source not in segment_files(path)
        assert tier.quarantined_keys() == [bad]
        assert [(r.key, r.reason) for r in removed] == [(bad, "quarantined")]
        assert tier.statistics().corrupt == 1
        assert bad not in pointers(tier)
        # the new segment holds the two good records and nothing else
        assert sum(segment_files(path).values()) == sum(end for _, _, end in ledger(tier).values())
        await assert_served(tier, [kept[0][0], kept[0][2]])
        assert_ledger_matches(tier)
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_a_damaged_pointer_in_a_source_is_quarantined_and_the_rest_moves(tmp_path: Path) -> None:
    import struct

    path, kept = await _three_segments(tmp_path, (3, 10, 10))
    async with await LmdbTier.open(path, **SETUP) as tier:
        bad = kept[0][1][0]
        source = pointers(tier)[bad].name
        value = bytearray(tier._db.read_txn(lambda txn: bytes(txn.get(bad, db=tier._db.tables.chunks))))
        value[-4:] = struct.pack("<I", 0)  # the head length: a split pointer with no head cannot be right

        def damage(txn):
            txn.put(bad, bytes(value), db=tier._db.tables.chunks)
            return lambda: None

        await tier._writer.submit_async(lambda: tier._writes.write(damage))
        report = await tier.compact_segments()
        assert (report.records, report.quarantined, report.files_freed) == (2, 1, 1)
        assert source not in segment_files(path) and tier.quarantined_keys() == [bad]
        await assert_served(tier, [kept[0][0], kept[0][2]])
        assert_ledger_matches(tier)
        assert await tier.check() == []


@pytest.mark.asyncio
async def test_a_full_disk_fails_the_pass_and_loses_nothing(tmp_path: Path) -> None:
    from mounts import fill_up, tmpfs

    with tmpfs(tmp_path / "mnt", "size=16m,mode=0700") as where:
        path, kept = await _three_segments(where, (2, 4, 10))
        async with await LmdbTier.open(path, **SETUP) as tier:
            files = segment_files(path)
            fill_up(where / "filler")
            with pytest.raises(TierFullError, match="disk full"):
                await tier.compact_segments()
            assert tier.statistics().degraded and tier.statistics().errors == 1
            await assert_served(tier, [it for its in kept for it in its])
            assert_ledger_matches(tier)
            assert await tier.check() == []
            assert all(name in segment_files(path) for name in files)  # no source went
            (where / "filler").unlink()
            report = await tier.compact_segments()
            assert (report.records, report.files_freed) == (6, 2) and not tier.statistics().degraded
            await assert_served(tier, [it for its in kept for it in its])
            assert_ledger_matches(tier)
        async with await LmdbTier.open(path, **SETUP) as tier:  # the failed copy's bytes: orphans, reclaimed
            ends = tier._db.read_txn(lambda txn: committed_ends(txn, tier._db.tables.segments))
            assert segment_files(path) == ends


def test_kvtier_gc_compacts_and_reports_what_it_reclaimed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvtier.tools.cli import main

    path, kept = asyncio.run(_three_segments(tmp_path, (10, 10, 10)))
    with LmdbTier(path, map_size_bytes=1 << 20) as tier:
        record, extent = _record_size(tier)
    before = segment_disk_bytes(path)
    # gc evicts the 24 least recently used records (the first two segments whole, 4 of the third):
    # the first two files go as emptied ones, the third is 60 % live and stays
    assert main(["gc", "--cache-dir", str(path), "--max-bytes", str(6 * record), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["evicted_records"], result["compacted_records"], result["compacted_segments"]) == (24, 0, 0)
    assert (result["bytes_before"], result["bytes_after"]) == (30 * record, 6 * record)
    assert result["segment_bytes_before"] == before
    assert result["segment_bytes_after"] == segment_disk_bytes(path) == before // 3
    with LmdbTier(path, map_size_bytes=1 << 20, segment_compaction_live_fraction=0) as tier:
        assert tier.gc(2 * record) == 4  # 2 of 10 left: 20 % live
    mid = segment_disk_bytes(path)
    assert main(["gc", "--cache-dir", str(path), "--max-bytes", "1GiB"]) == 0
    after = segment_disk_bytes(path)
    assert after == 2 * extent
    # the compacted file is deleted and its two records go to a new active one: 1 -> 1 files
    out = capsys.readouterr().out
    assert out.startswith(
        f"kvtier gc: evicted 0 records: stored bytes {2 * record} -> {2 * record} (--max-bytes {1 << 30}); "
        f"compacted 2 records; segment files 1 -> 1 ({mid} -> {after} bytes); on disk "
    ), out
    assert re.search(r"; on disk (\d+) -> (\d+) bytes \(data.mdb keeps its size: LMDB reuses its freed pages\)\n$", out), out
    asyncio.run(_reopen_and_check(path, kept[2][-2:]))


async def _reopen_and_check(path: Path, items: List[Item]) -> None:
    async with await LmdbTier.open(path) as tier:
        await assert_served(tier, items)
        assert_ledger_matches(tier)
        assert await tier.check() == []


def test_choose_segments_by_live_fraction_then_by_disk_budget() -> None:
    # 1 MB segments, one live record each (a page of its padding counts as live): 10 % ... 95 % live
    end = 1_000_000

    def seg(name: str, fraction: float) -> SegmentUsage:
        return SegmentUsage(name, int(fraction * end) - 4096, 1, end)

    usage = [seg("a", 0.1), seg("b", 0.4), seg("c", 0.6), seg("d", 0.85), seg("e", 0.95), seg("f", 0.05)]
    assert [round(u.live_fraction, 2) for u in usage] == [0.1, 0.4, 0.6, 0.85, 0.95, 0.05]
    assert usage[0].dead_bytes == 900_000
    closed = {"a", "b", "c", "d", "e"}  # f is someone's active segment
    names = lambda chosen: [u.name for u in chosen]  # noqa: E731
    assert names(choose_segments(usage, closed, live_fraction=0.5)) == ["a", "b"]
    assert names(choose_segments(usage, closed, live_fraction=0.0)) == []
    # 6 MB committed; a and b free 1.5 MB: 4.5 MB > 4.2 MB, so c (least live next) goes too
    assert names(choose_segments(usage, closed, live_fraction=0.5, disk_budget_bytes=4_200_000)) == ["a", "b", "c"]
    # however tight the budget, segments over 90 % live are never rewritten for it
    assert names(choose_segments(usage, closed, live_fraction=0.5, disk_budget_bytes=0)) == ["a", "b", "c", "d"]
    assert names(choose_segments(usage, closed, live_fraction=0.5, disk_budget_bytes=6_000_000)) == ["a", "b"]
    # a segment of small records, all live, is mostly padding: never below the fraction
    assert SegmentUsage("small", 100 * 300, 100, 100 * 8192).live_fraction > 0.5
    for bad in (-0.1, 1.0, "half", True, None):
        with pytest.raises(ValueError, match=r"segment_compaction_live_fraction must be a number in \[0, 1\), got"):
            LmdbTier("/nonexistent/never-created", segment_compaction_live_fraction=bad)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_engine_config_carries_the_fraction_to_its_disk_tier(tmp_path: Path) -> None:
    from kvtier.engine import EngineConfig, OffloadEngine
    from kvtier.policy import AttentionGroup, ModelLayout
    from kvtier.tools.testing.scenario import make_cpu_device

    config = EngineConfig.from_dict({"cache_dir": str(tmp_path / "cache"), "host_capacity_bytes": "1MiB",
                                     "lmdb_map_size_bytes": "32MiB", "lmdb_segment_threshold_bytes": "1",
                                     "lmdb_segment_compaction_live_fraction": "0.25",
                                     "pressure_poll_interval_s": "3600"})
    assert config.lmdb_segment_compaction_live_fraction == 0.25
    layout = ModelLayout(groups=(AttentionGroup(16),))
    async with OffloadEngine(layout, make_cpu_device(layout, num_blocks=16), config, fingerprint=b"c") as engine:
        assert engine._disk._compactor.live_fraction == 0.25
    with pytest.raises(ValueError, match=r"lmdb_segment_compaction_live_fraction must be in \[0, 1\), got 1.0"):
        EngineConfig(cache_dir=str(tmp_path), lmdb_segment_compaction_live_fraction=1.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_puts_deletes_evictions_and_compactions_agree_with_a_dict(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    path = tmp_path / "c"
    oracle: Dict[bytes, bytes] = {}  # key -> the raw bytes it must read back
    metas: Dict[bytes, ChunkMeta] = {}
    keys = [make_batch(seed, 0, [1])[0][0][:-1] + bytes([i]) for i in range(24)]
    tier = await LmdbTier.open(path, **SETUP)
    removed: List[Removal] = []
    tier.subscribe_removals(removed.extend)
    try:
        for step in range(60):
            op = rng.choice(["put", "put", "put", "delete", "evict", "compact", "reopen"])
            if op == "put":
                chosen = rng.sample(keys, rng.randint(1, 4))
                items = []
                for key in chosen:
                    raw = rng.randbytes(rng.choice([3000, 40_000, 150_000]))
                    meta = ChunkMeta(b"fp", 0, 0, "uint8", (len(raw),))
                    items.append((key, meta, memoryview(raw)))
                    oracle[key], metas[key] = raw, meta
                await tier.put_many(items)
            elif op == "delete":
                chosen = rng.sample(keys, rng.randint(1, 6))
                await tier.delete_many(chosen)
                for key in chosen:
                    oracle.pop(key, None)
            elif op == "evict":
                await asyncio.to_thread(tier.gc, rng.randint(0, 600_000))
            elif op == "compact":
                await tier.compact_segments()
            else:
                await tier.close()
                tier = await LmdbTier.open(path, **SETUP)
                removed = []
                tier.subscribe_removals(removed.extend)
            await tier.flush()
            await asyncio.sleep(0)
            for r in removed:
                if r.reason == "evicted":
                    oracle.pop(r.key, None)
            removed.clear()
            present = set(await tier.list_keys())
            assert present == set(oracle), f"step {step} ({op})"
            bufs = {k: bytearray(len(v)) for k, v in oracle.items()}
            got = await tier.get_many_into([(k, memoryview(b)) for k, b in bufs.items()])
            assert got == [metas[k] for k in bufs], f"step {step} ({op})"
            assert all(bytes(bufs[k]) == oracle[k] for k in bufs), f"step {step} ({op})"
            assert_ledger_matches(tier)
            assert await tier.check() == []
        # at the end, after a pass (and any automatic one still running): no closed segment is left
        # below the fraction
        await tier.compact_segments()
        deadline = time.monotonic() + 20
        while tier._compactor.scheduled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await tier.compact_segments()
        active = tier._writes.segment_writer.active if tier._writes.segment_writer is not None else None
        for name, (live, records, end) in ledger(tier).items():
            assert name == active or SegmentUsage(name, live, records, end).live_fraction >= 0.5, (name, live, end)
        assert tier.statistics().extra["compacted_records"] >= 0
    finally:
        await tier.close()


def test_kill9_during_compaction_loses_nothing(tmp_path: Path) -> None:
    results = run_kill_chains(tmp_path, 4, mode="compact", base_seed=4242)
    problems = [f"seed {r.seed} delay {r.delay_s:.2f}s: {p}" for r in results for p in r.problems]
    compacted = sum(r.compacted for r in results)
    print(f"compaction: {summarize_kills(results)}")
    assert not problems, "\n".join(problems[:20])
    assert compacted > 0, "not vacuous: the children compacted before they were killed"
    for directory in {p.parent for p in tmp_path.glob("chain-*/data.mdb")}:
        check = check_cache(str(directory))  # reopens (reclaiming orphans), verifies, reads all
        assert not check.problems and check.intact == check.records > 0
        with LmdbTier(directory, map_size_bytes=1 << 20) as tier:
            assert_ledger_matches(tier)
            ends = tier._db.read_txn(lambda txn: committed_ends(txn, tier._db.tables.segments))
            assert segment_files(directory) == ends  # no orphan file, no orphan tail


def test_the_compaction_bench_runs_and_checks_what_it_moved(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from kvtier.tools.bench.compaction import main

    assert main(["--total-mib", "4", "--record-kib", "256", "--segment-mib", "1", "--latency-puts", "2",
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 MiB of 256 KiB records in 1 MiB segments, 5 of 16 left live (31%)" in out
    assert "read back: 5 of 5 live records bitwise; check(): clean" in out
    assert list(tmp_path.iterdir()) == []  # its temp dir is gone
