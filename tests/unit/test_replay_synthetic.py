"""Synthetic prefix traces (``tools/replay/synthetic.py``), and the engine's policies never below
LRU on them.

The prefix property is checked by brute force: two requests with an equal block id at position i
have equal ids at every earlier position. The never-below check replays a short slice of each kind
(prompts cut to 16k tokens) in the fast mode at two budgets: the engine's default (``lru+seen``:
LRU on both tiers, ``seen`` disk admission), ``arc`` (ARC host pools, LRU disk) and ``arc-lfuda``
against ``lru`` on both tiers with every chunk written through, the
difference held to 0.2 point as the policy comparison holds it on the whole traces (README).
"""

from __future__ import annotations

import json
from typing import Dict, Tuple

import pytest

from kvtier.tools.replay.layouts import preset
from kvtier.tools.replay.sim import simulate_engine
from kvtier.tools.replay.synthetic import SYNTHETIC_KINDS, synthetic_records, write_synthetic
from kvtier.tools.replay.trace import read_trace
from kvtier.tools.replay.workload import REPLAY_FINGERPRINT, Plans, Workload, host_slots, record_bytes


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_synthetic_traces_keep_the_prefix_property_and_read_back(tmp_path, kind):
    records = synthetic_records(kind, 300, seed=1)
    assert records == synthetic_records(kind, 300, seed=1) and records != synthetic_records(kind, 300, seed=2)
    prefix_of: Dict[Tuple[int, int], Tuple[int, ...]] = {}
    for record in records:
        ids = record["hash_ids"]
        assert len(ids) == -(-record["input_length"] // 512)
        for i, block in enumerate(ids):
            assert prefix_of.setdefault((i, block), tuple(ids[:i])) == tuple(ids[:i])
    times = [r["timestamp"] for r in records]
    assert times == sorted(times)
    path = tmp_path / f"{kind}.jsonl"
    write_synthetic(kind, str(path), 300, seed=1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    trace = read_trace(str(path))
    assert len(trace) == 300 and trace.format == "mooncake"


def test_the_kinds_differ_in_sharing():
    def once_share(kind: str) -> float:
        uses: Dict[int, int] = {}
        for record in synthetic_records(kind, 600):
            for block in record["hash_ids"][: record["input_length"] // 512]:
                uses[block] = uses.get(block, 0) + 1
        return sum(1 for n in uses.values() if n == 1) / len(uses)

    shares = {kind: once_share(kind) for kind in SYNTHETIC_KINDS}
    assert shares["scan"] > 0.95 > shares["chat"] > shares["agent"]
    with pytest.raises(ValueError, match=r"unknown synthetic trace kind 'web'; valid: agent, chat, scan"):
        synthetic_records("web", 3)


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_the_engine_policies_are_never_below_lru_on_synthetic_traces(tmp_path, kind):
    path = tmp_path / f"{kind}.jsonl"
    write_synthetic(kind, str(path), 600, seed=3)
    layout = preset("full-attention", 0)
    work = Workload.prepare(read_trace(str(path)).limited(max_input_tokens=16384), layout)
    chunk_bytes, records = layout.all_chunk_bytes, record_bytes(layout, REPLAY_FINGERPRINT)
    plans = Plans(layout, None)
    for budget in (0.02, 0.2):
        rates = {}
        for policy in ("lru", "lru+seen", "arc", "arc-lfuda"):
            rates[policy] = simulate_engine(
                work, plans, host_slots=host_slots(int(budget * work.unique_bytes(chunk_bytes)), chunk_bytes, plans),
                chunk_bytes=chunk_bytes, disk_capacity=int(budget * work.unique_bytes(records)),
                disk_record_bytes=records, policy=policy).hit_rate
        assert min(rates["lru+seen"], rates["arc"], rates["arc-lfuda"]) >= rates["lru"] - 0.002, (budget, rates)
