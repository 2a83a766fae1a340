"""``kvtier replay --fleet``: engine processes sharing a local 3-primary Valkey cluster, against the
same processes alone, with every loaded byte checked and every missed chunk explained."""

from __future__ import annotations

import json
import random

import pytest

from kvtier.tools.cli import main
from kvtier.tools.replay.fleet import Fault, History, classify_misses
from kvtier.tools.testing.valkey import require_valkey


def _conversations(path, *, chats: int = 5, turns: int = 36, seed: int = 3) -> str:
    """Mooncake-format conversations: each turn re-sends its conversation so far plus new blocks.
    Conversation ``i``'s turns are spread so that round-robin hands consecutive turns of one
    conversation to different hosts (an odd number of conversations in turn over two hosts): only a
    shared pool turns them into hits."""
    rng = random.Random(seed)
    fresh = iter(range(1000, 10**6))
    system = [next(fresh) for _ in range(2)]
    history = [list(system) for _ in range(chats)]
    lines = []
    order = [(t * chats + c) % chats for t in range(turns) for c in range(chats)][:turns]
    for step, chat in enumerate(order):
        history[chat].extend(next(fresh) for _ in range(rng.randrange(1, 3)))
        n = len(history[chat]) * 512 - rng.randrange(0, 300)
        lines.append(json.dumps({"timestamp": step * 10, "input_length": n, "output_length": 8, "hash_ids": history[chat]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_two_hosts_share_a_cluster_every_byte_checked_every_miss_explained(tmp_path, capsys):
    require_valkey()
    trace = _conversations(tmp_path / "conversations.jsonl")
    code = main(["replay", "--trace", trace, "--fleet", "2", "--bytes-scale", "0.001", "--host-bytes", "5%",
                 "--disk-bytes", "15%", "--faults", "corrupt", "--json", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    pooled, local = result["pooled"], result["local"]
    assert result["hosts"] == 2 and result["primaries"] == 3 and result["requests"] == 36
    for run in (pooled, local):
        assert run["wrong_bytes"] == 0 and run["chunks_verified"] > 0
        assert run["unexplained_misses"] == 0, run["misses"]
        assert sum(run["misses"].values()) == run["missed_chunks"] > 0
    assert pooled["hit_rate"] > local["hit_rate"] > 0
    # Alone, a host misses what only the other host stored; pooled, never.
    assert local["misses"].get("stored by another host only (no shared pool)", 0) > 0
    assert not any(k.startswith("stored by another host only") for k in pooled["misses"])
    # The corrupted record was read, found corrupt (the load failed, a miss of its step) and deleted.
    assert [f["kind"] for f in pooled["faults"]] == ["corrupt"]
    assert pooled["failed_loads"] >= 1 and local["failed_loads"] == 0
    # Each load that read it fails on it (both hosts may have admitted it in one step).
    assert 1 <= pooled["misses"]["fault: corrupt record (failed load)"] <= pooled["failed_loads"]
    assert pooled["check_disk"] == [] and local["check_disk"] == []


def _history(pooled: bool) -> History:
    history = History(2, pooled)
    history.node_of = lambda key: 0
    return history


def _step(missed, where, *, hit=0, looked_up=0, ok=True):
    return {"missed": missed, "where": where, "hit": hit, "looked_up": looked_up, "ok": ok, "reason": None}


@pytest.mark.parametrize("pooled", [True, False])
def test_a_chunk_present_before_the_lookup_and_not_hit_is_unexplained(pooled):
    # Host 0 had the chunk on its own LMDB right before the lookup, no fault ran: a miss the keys caused.
    history = _history(pooled)
    history.stores["aa"] = [(1.0, 0)]
    step = _step(["aa", "bb"], {"h": [False, False], "d": [True, False], "r": [False, False]})
    assert classify_misses(history, step, 0, 2.0, 3.0, 512) == ["unexplained: on this host but not hit", "never stored"]


def test_absent_chunks_are_explained_by_who_stored_them_and_who_removed_them():
    local = _history(False)
    local.stores.update({"a": [(1.0, 1)], "b": [(1.0, 0)], "c": [(2.5, 1)]})
    local.stores.update({"e": [(1.0, 0)], "f": [(1.0, 0)]})
    local.lmdb_removed["b"] = [(1.5, 0, "evicted")]
    local.host_removed["e"] = [(1.5, 0)]
    where = {"h": [False] * 6, "d": [False] * 6, "r": [False] * 6}
    assert classify_misses(local, _step(["a", "b", "c", "d", "e", "f"], where), 0, 2.5, 3.0, 512) == [
        "stored by another host only (no shared pool)", "evicted by this host (LMDB LRU)",
        "stored by another host in the same step", "never stored",
        "evicted by this host (host tier; never on its LMDB)",
        # "f" this host stored and nothing removed, yet it is nowhere: the keys or the index lost it.
        "unexplained: stored here, never removed, not found"]
    pooled = _history(True)
    pooled.stores.update({"a": [(1.0, 1)], "b": [(1.0, 0)]})
    pooled.remote_evicted["a"] = [1.2]
    # "b" left the remote with nobody saying so: the ground truth cannot explain it.
    assert classify_misses(pooled, _step(["a", "b"], {k: v[:2] for k, v in where.items()}), 0, 2.5, 3.0, 512) == [
        "evicted by the remote (server maxmemory)", "unexplained: gone from the remote"]


def test_a_chunk_left_out_of_the_index_by_a_fault_is_explained_only_near_that_fault():
    # "aa": another host stored it at 1.0; this host's last index refresh (at 2.0) and the lookup
    # (at 20.0) saw it in the remote and not indexed.
    history = _history(True)
    history.stores["aa"] = [(1.0, 1)]
    step = dict(_step(["aa"], {"h": [False], "d": [False], "r": [True]}), indexed_at=2.0)
    assert classify_misses(history, step, 0, 20.0, 20.1, 512) == ["unexplained: in the remote but not hit"]
    # A primary stopped during that refresh (its listing skipped the node): explained.
    history.faults.append(Fault("stall", 1, 1.5, 2.5))
    assert classify_misses(history, step, 0, 20.0, 20.1, 512) == [
        "fault: in the remote, not indexed (stall: a listing that skipped a node, or notices lost while a "
        "subscription was down)"]
    # A primary killed and restarted 4 s before the lookup (its subscription's backoff): explained.
    history.faults[:] = [Fault("kill", 0, 10.0, 20.0 - 4.0 - history.grace_s)]
    assert classify_misses(history, step, 0, 20.0, 20.1, 512)[0].startswith("fault: in the remote, not indexed (kill")
    # Long after either: unexplained again.
    history.faults[:] = [Fault("kill", 0, 5.0, 10.0)]
    assert classify_misses(history, step, 0, 20.0, 20.1, 512) == ["unexplained: in the remote but not hit"]
