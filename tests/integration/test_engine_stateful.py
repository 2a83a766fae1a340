"""The stateful, model-based test of the engine: ``kvtier.tools.engine_sim`` drives a
real engine over a real LMDB tier (and a FileTier) with random interleavings of every public call,
cancellations at random awaits, a second writer, capacity eviction and injected faults (kvtier's
own errors and foreign ones, delays, stalls, failing device copies), checking the model after every
step. A failure names its seed: replay it with ``simulate(dir, seed=N, steps=...)``.

The long run is ``tests/stress/test_engine_stateful_stress.py`` (``--sim-seeds``, ``--sim-steps``).
"""

from __future__ import annotations

import pytest

from kvtier.tools.testing.engine_sim import simulate

STEPS = 600
LMDB_SEEDS = range(1, 13)
FILE_SEEDS = range(101, 105)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", LMDB_SEEDS)
async def test_engine_model_over_lmdb(tmp_path, seed):
    report = await simulate(tmp_path, seed=seed, steps=STEPS, tier="lmdb")
    assert report.steps == STEPS
    assert report.overlapping_steps > STEPS // 4, report.summary()  # the actors did interleave
    assert report.cancelled > 0 and report.faults > 0, report.summary()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", FILE_SEEDS)
async def test_engine_model_over_files(tmp_path, seed):
    report = await simulate(tmp_path, seed=seed, steps=STEPS, tier="files")
    assert report.steps == STEPS
    assert report.cancelled > 0 and report.faults > 0, report.summary()
