"""Fault suite, corruption: random byte flips across a copied cache directory (record payloads and
headers, LMDB leaf, branch and meta pages, free pages), garbage and truncated data files.

The flips run in a child process (``kvtier.tools.testing.corrupt_child corrupt-trials``), so that a crash --
SIGSEGV, SIGBUS, an LMDB assertion's abort -- fails the test with the trial that caused it instead
of killing pytest. Per trial: ``kvtier verify`` (library and command line) runs first, read-only;
then a read-write tier reads every key. Every read returns the original bytes or a miss; the
verifier lists exactly the records the reads missed; a damaged LMDB structure is a typed
``CorruptCacheError`` at open (py-lmdb's offline verifier runs before LMDB touches the file).
A damaged cache directory makes the engine move it aside and start on a fresh one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import List

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.engine.store import DiskStore
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.lmdb import CorruptCacheError, LmdbTier
from kvtier.tiers.record_format import CodecConfig
from kvtier.tools.testing.children import make_batch, read_line, run_child
from kvtier.tools.testing.corrupt_child import flip_bytes
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device

SEED = int(os.environ.get("KVTIER_FAULT_SEED", "20240607"))
TRIALS = 150
MAX_FLIPS = 60
LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))


# Where records live: "inline" every record inside LMDB; "segments" those of 8 KiB and more in
# segment files (raw records, two writing opens: two segment files, so that a flipped pointer can
# name another live segment).
STORES = {"inline": dict(segment_threshold_bytes=None),
          "segments": dict(segment_threshold_bytes=8 << 10, codec=CodecConfig(compress=False))}


async def build_pristine(path: Path, store: str = "inline") -> List[bytes]:
    """A cache of inline (in-leaf) and overflow records, with freed pages from a delete (and, for
    ``store="segments"``, records in two segment files)."""
    rng = random.Random(SEED)
    keys: List[bytes] = []
    opens = [range(12)] if store == "inline" else [range(6), range(6, 12)]
    for batches in opens:
        async with await LmdbTier.open(path, map_size_bytes=1 << 20, **STORES[store]) as tier:
            for batch in batches:
                sizes = [rng.choice((100, 600, 1500, 3000, 9000, 40000)) for _ in range(rng.randint(2, 6))]
                items = make_batch(SEED, batch, sizes)
                await tier.put_many(items)
                keys += [k for k, _, _ in items]
            if batches[-1] == 11:
                await tier.delete_many(keys[:3])
    return keys[3:]


def needs_offline_verifier() -> None:
    # Without py-lmdb's offline verifier (py-lmdb 3.0) nothing stops LMDB from walking a damaged
    # B-tree, which can crash the process: the structural half of this suite then cannot pass.
    pytest.importorskip("lmdb.verify", reason="needs py-lmdb >= 3.0 (lmdb.verify) to refuse damaged B-trees")


@pytest.mark.parametrize("store", sorted(STORES))
def test_random_flips_give_original_bytes_or_a_miss_and_verify_reports_each_bad_record(tmp_path: Path, store: str) -> None:
    needs_offline_verifier()
    started = time.monotonic()
    pristine = tmp_path / "pristine"
    keys = asyncio.run(build_pristine(pristine, store))
    segment_files = sorted(pristine.glob("seg-*.kvs"))
    assert (len(segment_files) >= 2) == (store == "segments"), segment_files  # not vacuous
    (tmp_path / "keys").write_text(" ".join(k.hex() for k in keys))
    proc = run_child(
        ["corrupt-trials", "--src", str(pristine), "--keys", str(tmp_path / "keys"), "--work", str(tmp_path / "work"),
         "--seed", str(SEED), "--trials", str(TRIALS), "--max-flips", str(MAX_FLIPS)],
        tmp_path / "stderr",
        module="kvtier.tools.testing.corrupt_child",
    )
    lines: List[str] = []
    try:
        while True:
            try:
                lines.append(read_line(proc, 120))
            except EOFError:
                break
    finally:
        proc.kill() if proc.poll() is None else None
        proc.wait()
    started_trials = [line for line in lines if line.startswith("start ")]
    assert proc.returncode == 0, (
        f"the trial child died with {proc.returncode} during {started_trials[-1:]} (seed {SEED}); "
        f"stderr: {(tmp_path / 'stderr').read_text()[-2000:]}"
    )
    results = [json.loads(line[len("result "):]) for line in lines if line.startswith("result ")]
    assert len(results) == TRIALS

    counts: Counter = Counter()
    for r in results:
        where = f"trial {r['trial']} ({r['where']}, {r['flips']} flips, seed {SEED})"
        reads, verify, cli = r["reads"], r["verify"], r["cli"]
        counts["flips"] += r["flips"]
        counts[f"{r['where']}_trials"] += 1
        assert reads["wrong"] == [], f"{where}: wrong bytes returned for {reads['wrong']}"
        if reads["open"] != "ok":
            # A damaged structure (or meta page) is refused at open, by every path, with a type.
            assert reads["open"].startswith("CorruptCacheError"), f"{where}: {reads['open']}"
            assert isinstance(verify, str) and verify.startswith("CorruptCacheError"), f"{where}: {verify}"
            assert cli["rc"] == 2 and cli["err"].startswith("kvtier: error:"), f"{where}: {cli}"
            counts["opens_refused"] += 1
            continue
        assert isinstance(verify, dict), f"{where}: the tier opened but verify failed: {verify}"
        assert reads["typed_read_errors"] == 0, f"{where}: {reads}"
        # Each bad record is reported, and only those: exactly the listed records reads missed.
        assert set(verify["bad"]) == set(reads["missed_keys"]), f"{where}: verify {verify} vs reads {reads}"
        assert verify["checked"] == verify["ok"] + len(verify["bad"])
        cli_report = json.loads(cli["out"])
        assert cli["rc"] == (1 if verify["bad"] else 0), f"{where}: {cli}"
        assert sorted(b["key"] for b in cli_report["bad"]) == verify["bad"], f"{where}: {cli_report}"
        counts["hits"] += reads["hits"]
        counts["misses"] += reads["misses"]
        counts["bad_records_reported"] += len(verify["bad"])
        if r["where"] == "segments":
            counts["bad_in_segment_trials"] += len(verify["bad"])
    print(
        f"fault-suite: corruption ({store}): {TRIALS} trials, {counts['flips']} byte flips ({counts['records_trials']} in "
        f"record pages, {counts['structure_trials']} in structure pages, {counts['anywhere_trials']} anywhere, "
        f"{counts['segments_trials']} in segment files); "
        f"{counts['opens_refused']} opens refused with CorruptCacheError; {counts['hits']} reads returned the "
        f"original bytes, {counts['misses']} were misses, 0 wrong, no crash; verify reported "
        f"{counts['bad_records_reported']} bad records, each one a read missed; {time.monotonic() - started:.1f} s"
    )
    # Not vacuous: the trials met both damaged records and damaged structure.
    assert counts["bad_records_reported"] > 0 and counts["opens_refused"] > 0 and counts["hits"] > 0
    assert (counts["bad_in_segment_trials"] > 0) == (store == "segments")


_OPEN_CHILD = textwrap.dedent(
    """
    import sys
    from kvtier.errors import KvtierError
    from kvtier.tiers.lmdb import LmdbTier
    for path in sys.argv[1:]:
        for readonly in (True, False):
            try:
                LmdbTier(path, readonly=readonly, verify_structure=False).close_sync()
                print(path, "opened")
            except KvtierError as exc:
                print(path, type(exc).__name__)
    """
)


def _reached_page_missing(directory: Path) -> bool:
    """py-lmdb's offline verifier (the oracle here): does some tree reach a page past the end?"""
    from lmdb import verify as lmdb_verify

    return any("beyond EOF" in problem for problem in lmdb_verify.verify(str(directory)))


def damaged_copies(pristine: Path, root: Path) -> List[Path]:
    """Copies of ``pristine`` with a garbage, an empty-headed, and several truncated data files,
    each cutting off a page some tree reaches. The cut nearest the end that does is found by the
    offline verifier: the pages after it are free (allocated once, never reached again)."""
    needs_offline_verifier()
    data = (pristine / "data.mdb").read_bytes()
    probe = root / "probe"
    probe.mkdir(mode=0o700)
    cut = len(data)
    while True:
        cut -= 4096
        (probe / "data.mdb").write_bytes(data[:cut])
        if _reached_page_missing(probe):
            break
    shutil.rmtree(probe)
    variants = {
        "garbage": random.Random(1).randbytes(len(data)),
        "zeros": bytes(len(data)),
        "tiny": data[:100],
        "one-meta": data[:5000],
        "two-pages": data[:8192],
        "half": data[: len(data) // 2],
        "short-of-a-reached-page": data[:cut],
        "mid-page": data[: cut + 4096 - 100],
    }
    out = []
    for name, content in variants.items():
        d = root / name
        d.mkdir(mode=0o700)
        (d / "data.mdb").write_bytes(content)
        os.chmod(d / "data.mdb", 0o600)
        out.append(d)
    return out


def test_garbage_or_truncated_data_file_is_a_typed_error_not_a_crash(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine"
    asyncio.run(build_pristine(pristine))
    copies = damaged_copies(pristine, tmp_path)
    # In a child: before the size check, a truncated file made LMDB read past its end (SIGBUS).
    res = subprocess.run([sys.executable, "-c", _OPEN_CHILD, *map(str, copies)], capture_output=True, timeout=120)
    assert res.returncode == 0, f"opening damaged files crashed the process ({res.returncode}): {res.stderr.decode()[-2000:]}"
    outcomes = [line.split() for line in res.stdout.decode().splitlines()]
    assert len(outcomes) == 2 * len(copies)
    for path, outcome in outcomes:
        assert outcome == "CorruptCacheError", f"{Path(path).name}: {outcome}"


def test_a_data_file_ending_before_its_last_allocated_page_opens_when_no_tree_reaches_past_the_end(
        tmp_path: Path) -> None:
    # A commit may allocate pages and free them unwritten; what kvtier gc leaves often ends so.
    # Such a file is healthy: refusing it moved a good cache aside at the next start.
    pristine = tmp_path / "pristine"
    keys = asyncio.run(build_pristine(pristine))
    data = (pristine / "data.mdb").read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir(mode=0o700)
    free_tail = 0
    while True:  # the free pages at the end, by the verifier
        (cut / "data.mdb").write_bytes(data[: len(data) - 4096 * (free_tail + 1)])
        if _reached_page_missing(cut):
            break
        free_tail += 1
    assert free_tail > 0, "the pristine cache should end in a free page (it deletes records)"
    (cut / "data.mdb").write_bytes(data[: len(data) - 4096 * free_tail])
    os.chmod(cut / "data.mdb", 0o600)

    async def read_back() -> List[bytes]:
        async with await LmdbTier.open(cut, verify_structure=False) as tier:
            return sorted((await tier.snapshot_keys()).keys)

    assert asyncio.run(read_back()) == sorted(keys)


def structurally_damaged(pristine: Path, root: Path) -> Path:
    """A copy whose B-tree py-lmdb's verifier rejects (flips in branch/leaf/meta pages)."""
    needs_offline_verifier()
    from lmdb import verify as lmdb_verify

    for seed in range(200):
        d = root / f"structure-{seed}"
        d.mkdir(mode=0o700)
        shutil.copyfile(pristine / "data.mdb", d / "data.mdb")
        flip_bytes(d / "data.mdb", random.Random(seed), 8, "structure")
        try:
            if lmdb_verify.verify(str(d)):
                return d
        except lmdb_verify.VerifyError:
            pass
        shutil.rmtree(d)
    raise AssertionError("no structural damage in 200 tries")


def config(cache_dir: Path, **overrides) -> EngineConfig:
    return EngineConfig(cache_dir=str(cache_dir), host_capacity_bytes=1 << 20, lmdb_map_size_bytes=1 << 20,
                        pressure_poll_interval_s=3600.0, **overrides)


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["garbage", "half", "structure"])
async def test_engine_moves_a_damaged_cache_dir_aside_and_keeps_serving(tmp_path: Path, damage: str) -> None:
    cache = tmp_path / "cache"
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"q") as engine:
        scenario = OffloadScenario(engine)
        old = scenario.tokens(33)
        await scenario.produce(old)
    if damage == "structure":
        damaged = structurally_damaged(cache, tmp_path)
    else:
        [damaged] = [d for d in damaged_copies(cache, tmp_path) if d.name == damage]
    shutil.copyfile(damaged / "data.mdb", cache / "data.mdb")
    broken = (cache / "data.mdb").read_bytes()

    # Off: a typed error, the directory untouched, and nothing of the failed start left behind.
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache, quarantine_corrupt_cache_dir=False),
                           fingerprint=b"q")
    with pytest.raises(CorruptCacheError):
        async with engine:
            pass
    assert (cache / "data.mdb").read_bytes() == broken
    assert engine.quarantined_cache_dir is None

    # On (the default): moved aside, recreated, serving.
    async with OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"q") as engine:
        aside = Path(engine.quarantined_cache_dir)
        assert aside.parent == cache.parent and aside.name.startswith("cache.corrupt-")
        assert (aside / "data.mdb").read_bytes() == broken  # kept for inspection
        assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
        scenario = OffloadScenario(engine, seed=1)
        assert engine.lookup(old + [1]) == 0  # a cold cache, not a wrong one
        fresh = scenario.tokens(33)
        assert (await scenario.produce(fresh)).durable
        await scenario.consume(fresh + [1], expect_hit=32)
        await engine.flush()
        engine.check()
    # The fresh directory is sound and holds what was stored.
    with LmdbTier(cache, readonly=True, verify_structure=True) as tier:
        assert tier.verify(quarantine=False).ok == 6


@pytest.mark.asyncio
async def test_a_start_that_fails_after_opening_the_cache_releases_it(tmp_path: Path, monkeypatch) -> None:
    # `async with` never calls __aexit__ when __aenter__ raises: the engine must release the tier it
    # opened itself, or the directory stays "already open in this process" and its threads run on.
    cache = tmp_path / "cache"

    def broken(self, tier) -> None:
        raise RuntimeError("injected failure after the disk tier opened")

    monkeypatch.setattr(DiskStore, "_subscribe_removals", broken)
    engine = OffloadEngine(LAYOUT, make_cpu_device(LAYOUT), config(cache), fingerprint=b"q")
    with pytest.raises(RuntimeError, match="injected"):
        async with engine:
            pass
    assert engine.disk_tier is not None and engine.disk_tier.closed
    monkeypatch.undo()
    with LmdbTier(cache):  # would raise "already open in this process" had the tier leaked
        pass
