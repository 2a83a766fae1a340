"""Every process that opens a cache directory keeps every other process's acknowledged records.

One seeded trial (``kvtier.tools.testing.cache_dir_trial``): a long-lived ``LmdbTier`` writer
acknowledging durable puts, killed -9 at random points and restarted, with an injected EIO or
ENOSPC in each life; beside it, round after round, a second writer (a warmup, killed -9 at times),
``kvtier verify`` (writable and read-only), ``kvtier gc`` with compaction (killed -9 at times), a
gc that evicts (journaled), ``kvtier inspect``, a read-only reader, and once an ``OffloadEngine``
killed -9 and restarted over the directory. Every writer journals what it acknowledged (fsync'd
after the ack); the end-of-trial check holds the directory to the journals: nothing acknowledged
lost unless a reported removal explains it by sequence, no read of bytes no put wrote (in any
process, throughout), no lookup finding a key after its delete returned, no key present after its
removal was reported, the writer's descriptors and the disk bytes held (deleted-but-open files from
``/proc/<pid>/fd`` included) within stated bounds. This is what README's "Errors, exit codes and
limits" promises about tools beside a live writer.

``KVTIER_FAULT_SEED`` replays a run; ``tests/stress/test_cache_dir_stress.py`` runs longer trials.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvtier.tools.testing.cache_dir_trial import run_trial

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
    for kind in ("writer", "warmup", "kvtier-verify", "kvtier-gc", "gc-evict", "kvtier-inspect", "read-check", "reopen-loop", "engine"):
        assert report.processes[kind] > 0, (kind, report.processes)
    assert report.kills["writer"] >= 2 and report.kills["engine"] == 1, report.kills
    assert report.acked > 1000 and report.present > 0 and report.reads > 1000 and report.engine_requests > 0
    assert report.injected_faults > 0 and report.deleted > 0 and report.evicted > 0
    assert time.monotonic() - started < 240
