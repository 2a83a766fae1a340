"""Every process that opens a cache directory keeps every other process's acknowledged records.

One seeded trial (``kvtier.tools.testing.cache_dir_trial``): a long-lived ``LmdbTier`` writer
acknowledging durable puts, killed -9 at random points and restarted, with an injected EIO or
ENOSPC in most lives; beside it, round after round, a second writer (a warmup, killed -9 at times),
``kvtier verify`` (writable and read-only), ``kvtier gc`` with compaction (killed -9 at times), a
gc that evicts (journaled), ``kvtier inspect``, a read-only reader, and once an ``OffloadEngine``
killed -9 and restarted over the directory. Every writer journals what it acknowledged (fsync'd
after the ack); the end-of-trial check holds the directory to the journals: nothing acknowledged
lost unless a reported removal explains it by sequence, no read of bytes no put wrote (in any
process, throughout), no lookup finding a key after its delete returned, no key present after its
removal was reported, the writer's descriptors and the disk bytes held (deleted-but-open files from
``/proc/<pid>/fd`` included) within stated bounds. This is what docs/cli.md's "Errors, exit codes
and limits" promises about tools beside a live writer.

``KVTIER_FAULT_SEED`` replays a run; ``tests/stress/test_cache_dir_stress.py`` runs longer trials.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tiers.base import IOHook
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tools.testing.cache_dir_child import read_journal
from kvtier.tools.testing.cache_dir_trial import run_trial
from kvtier.tools.testing.children import make_batch

SEED = int(os.environ.get("KVTIER_FAULT_SEED", "20240607"))
ROUNDS = 12


@pytest.mark.slow
def test_processes_sharing_a_cache_directory_lose_no_acknowledged_record(tmp_path: Path) -> None:
    started = time.monotonic()
    report = run_trial(tmp_path, SEED, ROUNDS)
    print(f"cache-dir processes: {report.summary()}")
    assert report.lost == [], f"{len(report.lost)} acknowledged records lost:\n" + "\n".join(report.lost[:20])
    assert report.problems == [], "\n".join(report.problems[:20])
    # Not vacuous: every kind of process ran, writers were killed, records went through all of it.
    kinds = ("writer", "warmup", "kvtier-verify", "kvtier-gc", "gc-evict", "kvtier-inspect", "read-check",
             "reopen-loop", "engine")
    for kind in kinds:
        assert report.processes[kind] > 0, (kind, report.processes)
    assert report.kills["writer"] >= 2 and report.kills["engine"] == 1, report.kills
    assert report.acked > 1000 and report.present > 0 and report.reads > 1000 and report.engine_requests > 0
    assert report.injected_faults > 0 and report.deleted > 0 and report.evicted > 0
    assert time.monotonic() - started < 240


def evict_all_in_another_process(cache: Path, journal: Path) -> None:
    """``kvtier gc --max-bytes 0`` (journaled) in a child process: every record goes."""
    subprocess.run([sys.executable, "-m", "kvtier.tools.testing.cache_dir_child", "gc", "--dir", str(cache),
                    "--journal", str(journal), "--max-bytes", "0"], check=True, timeout=120)


class _OnFirstRead(IOHook):
    """Runs ``action`` once, inside the first read transaction (its snapshot already taken)."""

    def __init__(self, action) -> None:
        self.action = action

    def before(self, op: str) -> None:
        if op == "read" and self.action is not None:
            action, self.action = self.action, None
            action()


def test_verify_beside_a_writer_does_not_call_a_record_deleted_meanwhile_corrupt(tmp_path: Path) -> None:
    # The scan's transaction still shows the pointer; another process's gc evicts the record and
    # deletes its segment file before the scan reads it: gone, not "segment is missing".
    cache = tmp_path / "cache"
    items = make_batch(3, 0, [200000, 200000, 4096])
    with LmdbTier(cache, segment_threshold_bytes=8192) as tier:
        asyncio.run(tier.put_many(items))
    segments_before = sorted(p.name for p in cache.glob("seg-*.kvs"))
    with LmdbTier(cache, readonly=True) as reader:
        reader._io_hook = _OnFirstRead(lambda: evict_all_in_another_process(cache, tmp_path / "gc.journal"))
        report = reader.verify(quarantine=False)
    assert segments_before and not list(cache.glob("seg-*.kvs"))  # the segment file did go mid-scan
    assert len(read_journal(tmp_path / "gc.journal").removed) == 3
    assert report.corrupt == [], report.corrupt
    assert report.ok == report.checked == 1  # the inline record, read from the old snapshot


def test_access_times_flushed_after_another_process_removed_the_record_list_no_key(tmp_path: Path) -> None:
    # This process read the records (access times pending), another process evicted them, then
    # the access times were persisted: no access-time entry may come back without its record
    # (verify calls that a damaged table, exit 1; the two tables disagreeing makes every open walk
    # the whole data file, and where the counts happen to match, list the dangling key).
    cache = tmp_path / "cache"
    items = make_batch(4, 0, [4096, 30000, 200000])
    keys = [k for k, _, _ in items]

    async def scenario() -> None:
        async with await LmdbTier.open(cache, access_flush_interval_s=3600.0, segment_threshold_bytes=8192) as tier:
            await tier.put_many(items)
            await tier.flush()
            got = await tier.get_many_into([(k, memoryview(bytearray(len(r)))) for k, _, r in items])
            assert all(m is not None for m in got)
            await asyncio.to_thread(evict_all_in_another_process, cache, tmp_path / "gc.journal")
            await tier.flush()  # persists the access times of the reads above
            assert await tier.contains_many(keys) == [False] * 3
            snapshot = await tier.snapshot_keys()
            assert snapshot.keys == frozenset(), [k.hex() for k in snapshot.keys]

    asyncio.run(scenario())
    assert sorted(read_journal(tmp_path / "gc.journal").removed) == sorted(keys)
    with LmdbTier(cache, readonly=True) as reader:
        report = reader.verify(quarantine=False)
    assert report.corrupt == [] and report.checked == 0, report.corrupt
