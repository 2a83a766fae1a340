"""Stress: many kill -9 iterations of the spill children (opt-in: ``tests/stress`` is not in the
default test paths). ``python3 -m pytest tests/stress -s --iterations 500 --engine-iterations 20``;
``--fault-seed N`` replays a run (the seed is printed). Ends with the same self-checks as the
integration test: every acknowledged chunk intact, every batch whole, index == tables."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.tools.testing.fault_child import run_kill_chains, summarize_kills

pytestmark = pytest.mark.stress


def _run(tmp_path: Path, n: int, mode: str, seed: int, lanes: int) -> None:
    if n <= 0:
        pytest.skip(f"0 {mode} iterations asked for")
    started = time.monotonic()
    results = run_kill_chains(tmp_path, n, mode=mode, base_seed=seed, chain=4, lanes=lanes)
    problems = [f"seed {r.seed} delay {r.delay_s:.2f}s: {p}" for r in results for p in r.problems]
    print(f"\nfault-suite stress (base seed {seed}): {summarize_kills(results)}; {time.monotonic() - started:.1f} s")
    assert not problems, "\n".join(problems[:50])
    assert len(results) == n


def test_kill9_spill_stress(tmp_path: Path, iterations: int, fault_seed: int) -> None:
    _run(tmp_path, iterations, "tier", fault_seed, lanes=2)


def test_kill9_engine_spill_stress(tmp_path: Path, engine_iterations: int, fault_seed: int) -> None:
    _run(tmp_path, engine_iterations, "engine", fault_seed + 1_000_000, lanes=2)


def test_kill9_compaction_stress(tmp_path: Path, compact_iterations: int, fault_seed: int) -> None:
    _run(tmp_path, compact_iterations, "compact", fault_seed + 2_000_000, lanes=2)
