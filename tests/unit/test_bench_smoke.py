"""``kvtier bench`` smoke test: every part on tiny sizes, the JSON schema, the correctness checks.

The real figures take minutes and a quiet machine; this only proves that the command's pieces run
end to end (disk subjects in paired rounds, engine, staging, policy, compression, bookkeeping) and
that what they report has the documented shape. Whole file well under 10 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics

import pytest
import torch

from kvtier.tools.bench import (
    BenchReport,
    RawFile,
    deepseek_v4_like_layout,
    format_report,
    gemma3_kv_bytes,
    make_kv_bytes,
    measure_compression,
    measure_coverage,
    measure_longest_hit,
    run_bench,
    run_paired,
)
from kvtier.tools.bench._figures import _brute_force_minimal
from kvtier.tools.bench.engine import measure_bookkeeping

ROW_KEYS = {"name", "value", "unit", "ratio", "ratio_to"}
MACHINE_KEYS = {
    "cpu_count",
    "platform",
    "python",
    "torch",
    "lmdb",
    "filesystem",
    "page_cache_drop_possible",
    "quick",
}


def _check_schema(report: BenchReport) -> dict:
    doc = json.loads(json.dumps(report.to_dict()))
    assert set(doc) == {"results", "machine"}
    assert MACHINE_KEYS <= set(doc["machine"])
    assert doc["results"], "no figures"
    for row in doc["results"]:
        assert ROW_KEYS <= set(row), row
        assert isinstance(row["name"], str) and row["name"]
        assert isinstance(row["value"], (int, float))
        assert isinstance(row["unit"], str) and row["unit"]
        assert row["ratio"] is None or isinstance(row["ratio"], (int, float))
        assert row["ratio_to"] is None or isinstance(row["ratio_to"], str)
        if row["ratio"] is not None:
            assert row["ratio_to"], f"{row['name']}: a ratio must say what it is a ratio to"
        if row.get("target") is not None:
            assert isinstance(row["met"], bool)
        if "per_round" in row:  # a paired ratio: its median over the rounds, each listed
            # Both are printed to 4 places, so they may differ by one unit in the last (0.03935 -> 0.0393).
            assert row["ratio"] == pytest.approx(statistics.median(row["per_round"]), rel=1e-3, abs=1.01e-4), row
    return doc


def test_tiers_and_engine_on_tiny_sizes(tmp_path):
    report = asyncio.run(
        run_bench(sizes=(64 << 10,), total_bytes=1 << 20, rounds=2, parts={"tiers", "engine"}, cache_dir=str(tmp_path),
                  peers=False)
    )
    doc = _check_schema(report)
    assert report.failures == []  # every byte read back (LMDB, files, baseline, engine) matched
    names = {row["name"] for row in doc["results"]}
    for expected in (
        "memcpy 64KiB",
        "staging device->host 64KiB",
        "raw write+fdatasync 64KiB",
        "raw cold read 64KiB",
        "file-per-chunk write (aiofiles, fsync, rename) 64KiB",
        "lmdb spill raw codec 64KiB",
        "lmdb spill zstd codec 64KiB vs baseline",
        "lmdb cold restore zstd codec 64KiB",
        "file tier put 64KiB",
        "engine store until durable (zstd) 64KiB",
        "engine cold load (zstd) 64KiB",
        "engine store until released, host tier only 64KiB",
    ):
        assert expected in names
    rows = {row["name"]: row for row in doc["results"]}
    for paired in ("lmdb spill raw codec 64KiB", "lmdb cold restore zstd codec 64KiB",
                   "engine cold load (zstd) 64KiB", "engine store until released, host tier only 64KiB"):
        assert len(rows[paired]["per_round"]) == 2, paired  # rounds=2, one ratio each
    skipped = report.machine.get("peers_skipped", [])
    assert any(s.startswith("peers (vLLM fs") for s in skipped)  # peers=False
    if not any(s.startswith("O_DIRECT limit") for s in skipped):  # the limit runs where O_DIRECT works
        assert "O_DIRECT write+fdatasync, 4 x 16 MiB I/Os in flight 64KiB" in names
        assert "O_DIRECT cold read, 8 x 4 MiB I/Os in flight 64KiB" in names
        assert "kvtier lmdb cold read vs O_DIRECT limit 64KiB" in names
    assert list(tmp_path.iterdir()) == []  # the run's subdirectory is gone
    text = format_report(report)
    assert "targets:" in text and "machine:" in text


def test_paired_rounds_write_back_each_subjects_pages_before_the_next_subject_writes(tmp_path, monkeypatch):
    """A subject that does not sync leaves dirty pages; the rounds write them back (untimed) right
    after its write, so the kernel never writes them back inside another subject's timed round."""
    events = []
    real_sync = os.sync

    def sync() -> None:
        events.append("sync")
        real_sync()

    class Unsynced(RawFile):
        name = "unsynced"

        async def write(self, indices: range) -> float:
            events.append(f"{self.name} {indices.start}")
            fd = os.open(self._path(indices), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for i in indices:
                    os.write(fd, self.chunks[i])
            finally:
                os.close(fd)
            return 1e-3

    class Logged(RawFile):
        async def write(self, indices: range) -> float:
            events.append(f"{self.name} {indices.start}")
            return await super().write(indices)

    monkeypatch.setattr(os, "sync", sync)
    chunks = [memoryview(bytes([i]) * (64 << 10)) for i in range(4)]
    outs = [memoryview(bytearray(64 << 10)) for _ in range(4)]
    subjects = [Logged(tmp_path / "raw", chunks, outs), Unsynced(tmp_path / "unsynced", chunks, outs)]
    times, failures = asyncio.run(run_paired(subjects, [range(0, 2), range(2, 4)], 64 << 10, outs, chunks))
    assert failures == []
    # the reference first in even rounds, last in odd ones; a writeback after every subject's write
    assert events[:8] == ["raw 0", "sync", "unsynced 0", "sync", "unsynced 2", "sync", "raw 2", "sync"]
    assert times.round_ratios("unsynced", "write", "raw") == [times.write["raw"][k] / 1e-3 for k in range(2)]
    assert times.ratio("unsynced", "write", "raw") == statistics.median(times.round_ratios("unsynced", "write", "raw"))


def test_busy_rounds_report_quiet_and_busy_rows_of_each_kind(tmp_path):
    """``busy_kinds``: the disk rounds run again beside each kind of CPU-bound workers; every
    disk row appears once quiet and once per kind, named so, each with the load average."""
    report = asyncio.run(
        run_bench(sizes=(64 << 10,), total_bytes=512 << 10, rounds=2, parts={"tiers"}, cache_dir=str(tmp_path),
                  peers=False, busy_kinds=("threads", "processes"))
    )
    doc = _check_schema(report)
    assert report.failures == []
    names = [row["name"] for row in doc["results"]]
    quiet = [n for n in names if n.endswith(" 64KiB") and not n.startswith(("memcpy", "staging"))]
    assert "lmdb spill raw codec 64KiB" in quiet and "raw cold read 64KiB" in quiet
    for kind in ("threads", "processes"):
        suffix = f", busy (2 CPU-bound {kind})"
        assert [n[: -len(suffix)] for n in names if n.endswith(suffix)] == quiet
    assert names.count("memcpy 64KiB") == 1  # the copy limits run once, quiet
    assert doc["machine"]["busy"] == ["busy (2 CPU-bound threads)", "busy (2 CPU-bound processes)"]
    loads = doc["machine"]["load_average"]
    assert set(loads) == {"64KiB", "64KiB, busy (2 CPU-bound threads)", "64KiB, busy (2 CPU-bound processes)"}
    assert all(len(v) == 6 for v in loads.values())  # 1/5/15-minute averages before and after
    with pytest.raises(ValueError, match="unknown busy kind 'fibers'"):
        asyncio.run(run_bench(sizes=(64 << 10,), total_bytes=512 << 10, parts={"tiers"}, busy_kinds=("fibers",)))


def test_policy_figures():
    for r in (0, 3):
        cov = asyncio.run(measure_coverage(r, num_tokens=6000))
        assert cov["equal"], cov["diff"]
        assert cov["stored"] == cov["minimal"] < cov["every"]
        assert cov["cross_group"] <= cov["minimal"]
    # The brute force itself, on the seed's worked example (FA b=16; SWA b=4, W=8, 33 tokens).
    from kvtier.policy import AttentionGroup, ModelLayout

    seed = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8, extra_retained_tokens=3)))
    assert _brute_force_minimal(seed, 1, 33, cross_group=False) == {1, 2, 3, 5, 6, 7}
    lh = measure_longest_hit(tokens=8192, repeats=1)
    assert lh["full_hit"] == 8192 and lh["full"] > 0
    assert len(deepseek_v4_like_layout(3).groups) == 3


def test_compression_and_bookkeeping():
    kv = make_kv_bytes(1 << 20).view(torch.uint8)
    figures = measure_compression(kv, 256 << 10, repeats=1)
    assert figures["ratio"] > 1.2  # bf16 high bytes compress
    assert figures["encode_mb_s"] > 0 and figures["decode_mb_s"] > 0
    gemma = gemma3_kv_bytes(16)  # the real-model bytes the full run compresses (a tiny model)
    assert gemma.dtype == torch.uint8 and gemma.numel() > 0
    bk = asyncio.run(measure_bookkeeping(chunks_per_request=8, requests=2, rounds=1))
    assert bk.total_us_per_chunk > 0
    parts = bk.store_us_per_chunk + bk.lookup_us_per_chunk + bk.load_us_per_chunk
    assert abs(bk.total_us_per_chunk - parts) < 1e-6 * parts
    bk = asyncio.run(measure_bookkeeping(chunks_per_request=4, requests=2, rounds=1, hybrid=True, with_copies=True))
    assert bk.total_us_per_chunk > 0


def test_keys_bench_before_and_after_agree():
    from kvtier.tools.bench.keys import measure_keys

    result = asyncio.run(measure_keys(tokens=2048, repeat=1, grow_steps=4))
    cases = result["cases"]
    assert set(cases) == {"keys", "lookup miss", "lookup hit", "grow: keys/step", "grow: lookup/step"}
    assert cases["lookup hit"]["hit_tokens"] == 2048  # v1 and v2 keys found the same full hit
    for row in cases.values():
        assert row["v1"]["best_ms"] > 0 and row["v2"]["best_ms"] > 0


def test_eviction_policy_cost_bench_covers_every_policy(capsys):
    from kvtier.tiers.eviction import eviction_policy_names
    from kvtier.tiers.lru import BYTE_INDEX_NAMES
    from kvtier.tools.bench.policies import main, measure_policies

    results = measure_policies(chunks=300, steps=200, rounds=1, reuse=50)
    admission = results.pop("seen admission")
    assert admission["admission_us"] > 0
    assert set(results) == set(eviction_policy_names())
    for name, row in results.items():
        assert row["host_us"] > 0 and ("disk_us" in row) == (name in BYTE_INDEX_NAMES)
    assert main(["--chunks", "100", "--steps", "50", "--rounds", "1", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == set(eviction_policy_names()) | {"seen admission"}


def test_write_timeline_times_every_direct_write_of_a_round_and_restores_what_it_wrapped(tmp_path, capsys):
    """The write timeline probe: each round's direct writes carry exactly the round's records
    (a head page and the payload each), its shares are shares, and the functions it wrapped are
    the tier's own again afterwards."""
    from kvtier.tiers.lmdb import segments
    from kvtier.tiers.lmdb.writes import WriterSide
    from kvtier.tools.bench import write_timeline

    before = (segments._pwritev_all, segments._fallocate, os.fdatasync, WriterSide.write)
    assert write_timeline.main(["--sizes-kib", "256", "--round-mib", "8", "--rounds", "2", "--dir", str(tmp_path),
                                "--json"]) == 0
    assert (segments._pwritev_all, segments._fallocate, os.fdatasync, WriterSide.write) == before
    (line,) = capsys.readouterr().out.splitlines()
    report = json.loads(line)
    assert report["chunk"] == "256KiB" and len(report["rounds"]) == 2
    for row in report["rounds"]:
        assert row["written_bytes"] == 32 * (256 << 10) + 32 * 4096  # 32 records: a head page each
        assert row["writes"] >= 1 and 0 < row["first_write_ms"] < row["round_ms"]
        assert 0 <= row["share_2_in_flight"] <= row["share_1_in_flight"] <= 1 and row["share_1_in_flight"] > 0
        assert row["allocation_stall_ms"] >= 0 and row["mb_s"] > 0
    assert os.listdir(tmp_path) == []  # its directory is removed
