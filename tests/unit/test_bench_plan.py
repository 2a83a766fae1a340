"""The quick bench run is the full run's plan with fewer rounds: the same chunk sizes, the same
round length, the same subjects in the same order (peers included), so its ratios estimate the
full run's figures instead of measuring something else (rounds too short to reach steady state,
another subject before the engine's, a release figure that is a best of fewer tries)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from kvtier.tools.bench import run_bench
from kvtier.tools.bench._settings import ROUND_BYTES, SIZES, run_plan


def test_the_quick_plan_is_the_full_plan_with_fewer_rounds() -> None:
    full, quick = run_plan(False), run_plan(True)
    assert full.sizes == quick.sizes == SIZES and full.round_bytes == quick.round_bytes == ROUND_BYTES
    # An odd count of at least 3: their median drops one round that met a stall of the disk, as
    # the full run's median of four does (a median of 2 is their mean, moved by half the stall).
    assert 3 <= quick.rounds < full.rounds and quick.rounds % 2 == 1
    assert quick.peers and full.peers
    # The busy repeat runs after the quiet rounds; nothing else differs.
    assert quick == replace(full, rounds=quick.rounds, busy=())


def test_run_bench_takes_its_defaults_from_the_plan(tmp_path) -> None:
    # No parts: only the machine notes, which say what each run would measure.
    notes = {quick: asyncio.run(run_bench(quick=quick, parts=set(), cache_dir=str(tmp_path))).machine
             for quick in (False, True)}
    for quick, machine in notes.items():
        plan = run_plan(quick)
        assert machine["paired_rounds_per_size"] == plan.rounds
        assert machine["bytes_per_chunk_size"] == plan.rounds * ROUND_BYTES
        assert machine["peers"] is True
    assert notes[False]["busy"] and not notes[True]["busy"]
