"""Stress: longer multi-process trials on one cache directory (opt-in: ``tests/stress`` is not in
the default test paths). ``python3 -m pytest tests/stress/test_cache_dir_stress.py -s
--cache-dir-trials 10 --cache-dir-rounds 60``; ``--fault-seed N`` replays a run (the seed is
printed). Each trial is ``tests/integration/test_cache_dir_processes.py``'s, with more rounds (an
engine round in the middle), and ends with the same check against the journals."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tools.testing.cache_dir_trial import run_trial

pytestmark = pytest.mark.stress


def test_cache_dir_processes_stress(tmp_path: Path, cache_dir_trials: int, cache_dir_rounds: int, fault_seed: int) -> None:
    if cache_dir_trials <= 0:
        pytest.skip("0 trials asked for")
    failures = []
    for i in range(cache_dir_trials):
        report = run_trial(tmp_path / f"trial-{i}", fault_seed + i, cache_dir_rounds)
        print(f"\ncache-dir processes stress (base seed {fault_seed}): {report.summary()}")
        if report.lost or report.problems:
            failures.append(f"seed {fault_seed + i}: lost {len(report.lost)}: " + "\n".join((report.lost + report.problems)[:10]))
    assert not failures, "\n".join(failures)
