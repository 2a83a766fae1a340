"""Fault suite, kill -9 during spill: a child process stores chunks (through an ``LmdbTier``, or an
``OffloadEngine`` with a cache directory) and prints each acknowledged one; the parent SIGKILLs it
at a random moment 0.2-2 s after it started storing, reopens the directory and checks that every
acknowledged chunk is there with a valid checksum and its exact bytes, that every batch is all or
nothing, and that the tier's index agrees with its tables.

The child is ``python -m kvtier.tools.testing.fault_child spill|engine-spill``; chunk bytes are a function of
the key (``kvtier.tools.testing.children.chunk_content``), which spells batch id, index and batch size.
Iterations come in chains of two on one directory (the second child starts on what the first one's
death left). ``KVTIER_FAULT_SEED`` replays a run; ``tests/stress/test_kill9_stress.py`` runs more.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvtier.tools.testing.fault_child import run_kill_chains, summarize_kills

BASE_SEED = int(os.environ.get("KVTIER_FAULT_SEED", "20240607"))
ITERATIONS = 20


def test_kill9_during_spill_loses_no_acknowledged_chunk_and_no_batch_is_half_visible(tmp_path: Path) -> None:
    started = time.monotonic()
    results = run_kill_chains(tmp_path, ITERATIONS, mode="tier", base_seed=BASE_SEED)
    problems = [f"seed {r.seed} delay {r.delay_s:.2f}s: {p}" for r in results for p in r.problems]
    print(f"fault-suite: {summarize_kills(results)}; {time.monotonic() - started:.1f} s")
    assert not problems, "\n".join(problems[:20])
    assert len(results) == ITERATIONS
    # Not vacuous: children that lived past half a second acknowledged work, and the cache held it.
    for r in results:
        if r.delay_s >= 0.5:
            assert r.acked_batches > 0, f"seed {r.seed}: nothing acknowledged in {r.delay_s:.2f} s"
        assert r.check is not None and r.check.intact == r.check.records > 0 or r.acked_batches == 0


@pytest.mark.slow
def test_kill9_during_engine_spill_loses_no_durable_request(tmp_path: Path) -> None:
    # One chain of two: the child imports torch and starts an engine (seconds) before it stores.
    started = time.monotonic()
    results = run_kill_chains(tmp_path, 2, mode="engine", base_seed=BASE_SEED + 1000, lanes=1)
    problems = [f"seed {r.seed} delay {r.delay_s:.2f}s: {p}" for r in results for p in r.problems]
    print(f"fault-suite: {summarize_kills(results)}; {time.monotonic() - started:.1f} s")
    assert not problems, "\n".join(problems[:20])
    assert sum(r.acked_batches for r in results) > 0
