"""Fault suite, disk full under load, through the engine: the cache directory lives on a small tmpfs
(root mounts one; where mounting is refused the test is skipped with the reason). A filler file
takes the last byte; stores made meanwhile, many at once, fail cleanly -- counted as drops and tier
errors, the handles say "not durable", nothing half-written -- while loads of earlier chunks keep
working bitwise; once the filler is deleted, stores are durable again, and after a restart every
prompt acknowledged durable loads whole."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path
from typing import List

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.policy import AttentionGroup, ModelLayout
from kvtier.tiers.files import FileTier
from kvtier.tools.testing.scenario import OffloadScenario, make_cpu_device
from mounts import tmpfs

LAYOUT = ModelLayout(groups=(AttentionGroup(16), AttentionGroup(4, sliding_window=8)))
FINGERPRINT = b"fault-suite-disk-full"


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 12 MiB tmpfs mounted under ``tmp_path`` (unmounted afterwards)."""
    with tmpfs(tmp_path / "mnt", "size=12m,mode=0700") as where:
        yield where


def fill(path: Path) -> int:
    """Write zeros until the filesystem is full; returns the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        block = bytes(64 << 10)
        while True:
            try:
                written += f.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        for size in (4096, 512, 1):  # the last partial block, too
            try:
                while True:
                    written += f.write(bytes(size))
            except OSError:
                pass
    return written


def device():
    # 64 KiB per full-attention chunk, 16 KiB per sliding-window chunk: ~190 KiB per prompt.
    return make_cpu_device(LAYOUT, num_blocks=400, num_layers=2, kv_heads=2, head_dim=64)


async def open_engine(kind: str, cache: Path, dev) -> OffloadEngine:
    # "lmdb": the defaults (these 16-64 KiB chunks stay inside LMDB); "lmdb-segments": every chunk
    # in segment files, so the full disk refuses segment appends
    segments = {"lmdb_segment_threshold_bytes": 8 << 10} if kind == "lmdb-segments" else {}
    config = EngineConfig(
        cache_dir=str(cache) if kind.startswith("lmdb") else None,
        **segments,
        host_capacity_bytes=8 << 20,  # room for the stores and loads in flight together
        lmdb_map_size_bytes=1 << 20,
        pressure_poll_interval_s=3600.0,
        spill_batch_max_chunks=6,  # one prompt per spill batch: many batches fail, each on its own
    )
    disk = await FileTier.open(cache, io_threads=4) if kind == "files" else None
    engine = OffloadEngine(LAYOUT, dev, config, fingerprint=FINGERPRINT, disk_tier=disk, pressure_sources={})
    await engine.start()
    return engine


async def close(engine: OffloadEngine) -> None:
    await engine.flush()
    engine.check()
    await engine.close()
    if engine.disk_tier is not None and not engine._owns_disk:
        await engine.disk_tier.close()


async def load_ok(engine: OffloadEngine, scenario: OffloadScenario, prompt: List[int]) -> bool:
    """Load the prompt's hit; bytes are checked bitwise by the scenario. True when the full hit loaded."""
    record = await scenario.consume(prompt + [1], expect_hit=-1)
    return record.hit == 32 and record.ok


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["lmdb", "lmdb-segments", "files"])
async def test_disk_full_under_load_fails_stores_cleanly_keeps_reads_and_recovers(small_fs: Path, kind: str) -> None:
    started = time.monotonic()
    cache, filler = small_fs / "cache", small_fs / "filler"
    dev = device()
    engine = await open_engine(kind, cache, dev)
    scenario = OffloadScenario(engine, seed=7)
    early = [scenario.tokens(33) for _ in range(8)]
    for prompt in early:
        assert (await scenario.produce(prompt)).durable

    await close(engine)
    filled = fill(filler)
    # Restarted on the full disk (the host is empty: the early prompts load from disk). Under load:
    # many stores at once, and loads of the early prompts among them.
    engine = await open_engine(kind, cache, dev)
    bytes_of_early = scenario.producer_bytes
    scenario = OffloadScenario(engine, seed=9)
    scenario.producer_bytes = bytes_of_early
    during = [scenario.tokens(33) for _ in range(12)]
    results = await asyncio.gather(
        *(scenario.produce(p) for p in during),
        *(load_ok(engine, scenario, p) for p in early),
    )
    produced, loaded = results[: len(during)], results[len(during):]
    assert all(loaded), "a load of an earlier, durable prompt failed while the disk was full"
    assert engine.statistics()["loaded_chunks"]["disk"] == 4 * len(early)  # FA {0, 1} + SWA {6, 7} each
    failed = [r for r in produced if not r.durable]
    stats = engine.statistics()
    assert failed, "the full disk refused nothing"
    assert stats["dropped"]["tier_error"] == 6 * len(failed) and stats["disk"]["errors"] >= len(failed)
    assert stats["disk"]["degraded"] == 1.0
    await engine.flush()
    engine.check()
    assert engine.lookup(failed[0].token_ids + [1]) in (0, 16, 32)  # host or nothing, never an error

    # Space returns: service resumes.
    filler.unlink()
    after = [scenario.tokens(33) for _ in range(3)]
    for prompt in after:
        assert (await scenario.produce(prompt)).durable, "stores stay broken after space returned"
    assert engine.statistics()["disk"]["degraded"] == 0.0
    for prompt in early + after:
        assert await load_ok(engine, scenario, prompt)
    await close(engine)

    # Restart: every prompt acknowledged durable is on disk, whole and bitwise.
    engine = await open_engine(kind, cache, dev)
    restarted = OffloadScenario(engine, seed=8)
    restarted.producer_bytes = scenario.producer_bytes
    durable = early + after + [r.token_ids for r in produced if r.durable]
    for prompt in durable:
        assert await load_ok(engine, restarted, prompt)
    if kind.startswith("lmdb"):
        assert await engine.disk_tier.check() == []
        assert bool(list(cache.glob("seg-*.kvs"))) == (kind == "lmdb-segments")  # not vacuous
    await close(engine)
    print(
        f"fault-suite: disk full ({kind}): filler took {filled >> 10} KiB of a 12 MiB tmpfs; "
        f"{len(failed)} of {len(during)} concurrent stores refused ({stats['dropped']['tier_error']} chunks dropped, "
        f"{int(stats['disk']['errors'])} tier errors), {len(early)} loads from disk ok meanwhile; "
        f"{len(after)} stores durable after space returned; {len(durable)} durable prompts intact after restart; "
        f"{time.monotonic() - started:.1f} s"
    )
