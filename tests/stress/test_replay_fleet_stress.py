"""Stress (opt-in): ``kvtier replay --fleet 4`` on a slice of the Mooncake conversation trace, four
engine processes sharing a 3-primary cluster while every fault kind runs (a primary killed with -9
and restarted empty, another SIGSTOPped then resumed, a record corrupted on the server, I/O errors
under one host's LMDB). The run finishes; no loaded byte is wrong; every missed chunk is explained;
each fault ran and each failed load is a miss of its own step. ``python -m pytest -n 0
tests/stress/test_replay_fleet_stress.py -s`` (several minutes on two shared cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.tools.cli import main
from kvtier.tools.testing.valkey import require_valkey

pytestmark = pytest.mark.stress

MOONCAKE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="the Mooncake trace is not beside this checkout")
def test_four_hosts_with_every_fault_explain_every_miss(capsys):
    require_valkey()
    code = main(["replay", "--trace", str(MOONCAKE), "--fleet", "4", "--limit", "800", "--bytes-scale", "0.0002",
                 "--host-bytes", "5%", "--disk-bytes", "10%", "--faults", "all", "--json", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    pooled, local = result["pooled"], result["local"]
    print(json.dumps({k: {x: run[x] for x in ("hit_rate", "misses", "failed_loads", "max_step_s", "faults")}
                      for k, run in (("pooled", pooled), ("local", local))}, indent=1))
    assert sorted(f["kind"] for f in pooled["faults"]) == ["corrupt", "disk", "kill", "stall"]
    for run in (pooled, local):
        assert run["wrong_bytes"] == 0 and run["chunks_verified"] > 0
        assert run["unexplained_misses"] == 0, run["misses"]
    assert pooled["failed_loads"] >= 1
    assert pooled["misses"]["fault: corrupt record (failed load)"] == 1
    assert pooled["misses"].get("fault: lost with a killed primary", 0) > 0
    # A load waiting on the stopped primary gives up after the remote timeout: every step ends.
    assert pooled["max_step_s"] < 30
    assert pooled["hit_rate"] >= local["hit_rate"]
