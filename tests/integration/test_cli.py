"""The `kvtier` command as a user runs it: demo, inspect, verify, gc, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lmdb
import pytest

from kvtier.tiers.lmdb.segments import SegmentPointer, is_pointer
from kvtier.tools.cli import main

# A segment pointer is magic | pid | counter | offset | length (u64) | ...: the length's high byte.
LENGTH_HIGH_BYTE = 4 + 4 + 4 + 8 + 7


def run_cli(*args: str, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo") / "cache"
    result = run_cli("demo", "--json", "--cache-dir", str(cache), "--producers", "6")
    assert result.returncode == 0, result.stderr
    return cache, json.loads(result.stdout)


def test_demo_json_reports_a_verified_run(demo_cache):
    _, summary = demo_cache
    assert summary["verified"] is True
    assert summary["failures"] == []
    assert summary["requests"] == 18
    assert summary["hit_tokens"] > 0
    assert summary["stored_bytes"] > 0
    assert 0.3 < summary["swa_bytes_saved_ratio"] < 1.0
    assert summary["loaded_bytes_from_disk"] > 0


def test_demo_default_removes_its_directory_and_json_names_none(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", "demo", "--producers", "3", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["verified"] is True and summary["failures"] == []
    assert summary["cache_dir"] is None  # never a path that no longer exists
    assert list(tmp_path.iterdir()) == []  # the temporary cache directory is gone


def test_inspect_lists_records_per_group(demo_cache, capsys):
    cache, summary = demo_cache
    assert main(["inspect", "--cache-dir", str(cache), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["groups"]) == {"0", "1"}
    assert report["records"] == sum(g["records"] for g in report["groups"].values())
    assert report["raw_bytes"] == summary["disk_stored_bytes"]
    # the demo's group-0 chunks (256 KiB) are in segment files, group 1's (64 KiB) inside LMDB
    assert report["segment_files"] >= 1 and report["segment_records"] == report["groups"]["0"]["records"]
    assert report["segment_live_bytes"] == report["groups"]["0"]["stored_bytes"]
    assert 0.9 < report["segment_live_fraction"] <= 1.0
    assert report["stored_bytes"] <= report["raw_bytes"] * 1.01
    assert main(["inspect", "--cache-dir", str(cache)]) == 0
    assert "group 1:" in capsys.readouterr().out


def test_verify_finds_each_flipped_record_and_gc_bounds_the_cache(tmp_path, demo_cache, capsys):
    import shutil

    cache = tmp_path / "copy"
    shutil.copytree(demo_cache[0], cache)
    os.chmod(cache, 0o700)
    assert main(["verify", "--cache-dir", str(cache)]) == 0
    capsys.readouterr()
    # The demo's group-0 chunks (256 KiB) live in segment files, group 1's (64 KiB) inside LMDB.
    # Damage three records: the last payload byte of an inline one (rewritten through LMDB itself:
    # a valid B-tree, a bad record), the last byte of a segment record in its file, and a segment
    # pointer itself (its length's high byte: it now claims ~6 EB).
    env = lmdb.open(str(cache), max_dbs=8, map_size=1 << 30)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True, db=chunks) as txn:
        values = {bytes(k): bytes(v) for k, v in txn.cursor()}
        inline = next(k for k, v in values.items() if not is_pointer(v))
        in_segments = [k for k, v in values.items() if is_pointer(v)][:2]
        assert len(in_segments) == 2, "not vacuous: the demo cache has segment records"
        value = bytearray(values[inline])
        value[-1] ^= 0x5A
        txn.put(inline, bytes(value))
        pointer = SegmentPointer.unpack(values[in_segments[0]])
        with open(cache / pointer.name, "r+b") as f:
            f.seek(pointer.offset + pointer.length - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
        value = bytearray(values[in_segments[1]])
        value[LENGTH_HIGH_BYTE] ^= 0x5A
        txn.put(in_segments[1], bytes(value))
    env.close()
    keys = [inline, *in_segments]
    assert main(["verify", "--cache-dir", str(cache), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(b["key"] for b in report["bad"]) == sorted(k.hex() for k in keys)
    reasons = {b["key"]: b["reason"] for b in report["bad"]}
    assert "short" in reasons[in_segments[1].hex()], reasons
    assert main(["verify", "--cache-dir", str(cache)]) == 0  # quarantined by the first run
    capsys.readouterr()

    assert main(["gc", "--cache-dir", str(cache), "--max-bytes", "1MiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bytes_after"] <= 1 << 20 < result["bytes_before"]
    assert result["evicted_records"] > 0
    # down to nothing: every segment file goes with its last record
    assert main(["gc", "--cache-dir", str(cache), "--max-bytes", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_after"] == 0
    assert sorted(cache.glob("seg-*.kvs")) == []


def test_verify_reports_missing_and_short_segments_and_inspect_counts_them(tmp_path, capsys):
    import asyncio

    from kvtier.tiers.lmdb import LmdbTier
    from kvtier.tiers.record_format import CodecConfig
    from kvtier.tools.testing.children import make_batch

    cache = tmp_path / "c"
    batches = [make_batch(9, b, [200_000, 300_000]) for b in range(2)]

    async def write() -> None:
        for batch in batches:  # one writing open each: two segment files (the default threshold)
            async with await LmdbTier.open(cache, codec=CodecConfig(compress=False)) as tier:
                await tier.put_many(batch)

    asyncio.run(write())
    files = sorted(cache.glob("seg-*.kvs"))
    assert len(files) == 2
    assert main(["inspect", "--cache-dir", str(cache), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["segment_files"], report["segment_records"]) == (2, 4)
    assert report["segment_live_bytes"] == report["stored_bytes"] > 1_000_000
    assert report["segment_file_bytes"] == sum(f.stat().st_size for f in files)
    assert 0.95 < report["segment_live_fraction"] <= 1.0
    assert main(["inspect", "--cache-dir", str(cache)]) == 0
    assert "segment files: 2," in capsys.readouterr().out
    # one file loses its tail (its last record is short), the other goes
    with open(files[0], "r+b") as f:
        f.truncate(files[0].stat().st_size - 5000)
    files[1].unlink()
    assert main(["verify", "--cache-dir", str(cache), "--no-quarantine", "--json"]) == 1
    bad = {b["key"]: b["reason"] for b in json.loads(capsys.readouterr().out)["bad"]}
    assert sorted(r.split(":")[0] for r in bad.values()) == [
        f"segment {files[0].name} is short", f"segment {files[1].name} is missing", f"segment {files[1].name} is missing"]
    assert main(["verify", "--cache-dir", str(cache)]) == 1  # reported and quarantined
    capsys.readouterr()
    assert main(["verify", "--cache-dir", str(cache), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 1
    assert main(["inspect", "--cache-dir", str(cache), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["segment_records"] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "--cache-dir", "/nonexistent/kvtier"], "no kvtier cache at /nonexistent/kvtier"),
        (["gc", "--cache-dir", "/nonexistent/kvtier", "--max-bytes", "1GiB"], "no kvtier cache"),
        (["demo", "--producers", "0"], "--producers must be in [1, 4096], got 0"),
    ],
)
def test_user_mistakes_are_one_line_errors(args, message):
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"kvtier: error: {result.stderr.strip().split('error: ', 1)[1]}"]
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_every_subcommand_has_help():
    for command in ["demo", "warmup", "inspect", "verify", "gc", "bench"]:
        result = run_cli(command, "--help")
        assert result.returncode == 0
        assert f"usage: kvtier {command}" in result.stdout


def _on_disk(directory) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.iterdir() if p.is_file())


def test_gc_reports_what_it_deleted_and_the_bytes_on_disk_truthfully(tmp_path, demo_cache, capsys):
    import re
    import shutil

    cache = tmp_path / "copy"
    shutil.copytree(demo_cache[0], cache)
    # Each process writes its own segment file: a second demo (other prompts) makes a second one.
    assert run_cli("demo", "--cache-dir", str(cache), "--producers", "3", "--seed", "1").returncode == 0
    files_before, disk_before = len(list(cache.glob("seg-*.kvs"))), _on_disk(cache)
    assert files_before >= 2, "not vacuous: the demo cache has several segment files"
    assert main(["gc", "--cache-dir", str(cache), "--max-bytes", "2MiB"]) == 0
    line = capsys.readouterr().out.strip()
    files_after, disk_after = len(list(cache.glob("seg-*.kvs"))), _on_disk(cache)
    assert files_after < files_before  # eviction deleted segment files with their last record
    match = re.fullmatch(
        r"kvtier gc: evicted (\d+) records: stored bytes (\d+) -> (\d+) \(--max-bytes 2097152\); compacted (\d+) records; "
        r"segment files (\d+) -> (\d+) \((\d+) -> (\d+) bytes\); on disk (\d+) -> (\d+) bytes "
        r"\(data\.mdb keeps its size: LMDB reuses its freed pages\)", line)
    assert match, line
    evicted, stored_before, stored_after, _, seg_before, seg_after, _, _, on_before, on_after = map(int, match.groups())
    assert evicted > 0 and stored_after <= 2 << 20 < stored_before
    assert (seg_before, seg_after) == (files_before, files_after)
    assert (on_before, on_after) == (disk_before, disk_after)
    help_text = run_cli("gc", "--help").stdout
    assert "bound on the records' stored bytes" in " ".join(help_text.split())
