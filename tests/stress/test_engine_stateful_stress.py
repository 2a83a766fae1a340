"""Opt-in long run of the engine's stateful test:

    python -m pytest tests/stress/test_engine_stateful_stress.py --sim-seeds 200 --sim-steps 2000

Seeds start at ``--fault-seed`` (default: from the clock, printed). Prints one summary line per
seed and the totals; any violation fails with its seed.
"""

from __future__ import annotations

import pytest

from kvtier.tools.testing.engine_sim import simulate

pytestmark = pytest.mark.stress


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["lmdb", "files"])
async def test_engine_model_long_run(tmp_path, tier, sim_seeds, sim_steps, fault_seed):
    totals = {"steps": 0, "actors": 0, "cancelled": 0, "faults": 0, "overlapping_steps": 0}
    for n in range(sim_seeds):
        seed = fault_seed + n
        report = await simulate(tmp_path / f"{tier}-{seed}", seed=seed, steps=sim_steps, tier=tier)
        print(report.summary())
        totals["steps"] += report.steps
        totals["actors"] += sum(report.actors.values())
        totals["cancelled"] += report.cancelled
        totals["faults"] += report.faults
        totals["overlapping_steps"] += report.overlapping_steps
    print(f"{tier}: {sim_seeds} seeds from {fault_seed}: {totals}")
