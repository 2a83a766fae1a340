"""The fast mode on the whole Mooncake conversation trace, against the figures in TRACES.md.

Opt-in (``python3 -m pytest tests/stress/test_replay_trace_figures.py``): it reads the 3 MB trace
and replays its 12,031 requests several times (about a minute on two shared cores).

TRACES.md counts every 512-token block, the partial last ones too; kvtier never stores a partial
chunk and never hits a prompt's last token, and its capacities below are the same numbers of
512-token chunks (a share of the 182,790 unique blocks), so its figures sit a few tenths of a point
from the block-level ones (measured: unbounded 37.34% of tokens against 37.4%).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvtier.tools.replay.layouts import preset
from kvtier.tools.replay.sim import simulate_belady, simulate_engine, simulate_lru
from kvtier.tools.replay.trace import read_trace
from kvtier.tools.replay.workload import Plans, Workload, host_slots

pytestmark = pytest.mark.stress

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
UNIQUE_BLOCKS = 182_790


@pytest.fixture(scope="module")
def workload():
    if not TRACE.is_file():
        pytest.skip("the Mooncake trace is not beside this checkout")
    layout = preset("full-attention")
    return Workload.prepare(read_trace(str(TRACE)), layout), layout


def test_unbounded_and_lru_and_belady_match_the_published_figures(workload):
    work, layout = workload
    plans = Plans(layout, None)
    chunk = [layout.chunk_bytes(0)]
    assert sum(work.tokens) == 144_793_823 and len(work) == 12_031
    assert simulate_lru(work, plans, chunk_bytes=chunk, capacity=None).hit_rate == pytest.approx(0.374, abs=0.002)
    # TRACES.md, token-weighted block LRU at 2/5/10/20/50% of the unique blocks; offline bound at 2/5/10%.
    lru_figures = {0.02: 0.080, 0.05: 0.199, 0.10: 0.284, 0.20: 0.351, 0.50: 0.370}
    belady_figures = {0.02: 0.320, 0.05: 0.374, 0.10: 0.374}
    for share, figure in lru_figures.items():
        capacity = int(share * UNIQUE_BLOCKS) * chunk[0]
        lru = simulate_lru(work, plans, chunk_bytes=chunk, capacity=capacity).hit_rate
        assert lru == pytest.approx(figure, abs=0.008), share
        if share in belady_figures:
            belady = simulate_belady(work, plans, chunk_bytes=chunk, capacity=capacity).hit_rate
            assert belady == pytest.approx(belady_figures[share], abs=0.005), share


def test_the_whole_trace_replays_in_the_fast_mode_within_a_minute(workload):
    work, layout = workload
    chunk = [layout.chunk_bytes(0)]
    capacity = int(0.05 * UNIQUE_BLOCKS) * chunk[0]
    started = time.perf_counter()
    model = simulate_engine(work, Plans(layout, None), host_slots=host_slots(capacity // 2, chunk, Plans(layout, None)), chunk_bytes=chunk,
                            disk_capacity=capacity, disk_record_bytes=chunk)
    assert time.perf_counter() - started < 60
    assert model.hit_rate == pytest.approx(0.20, abs=0.01)
