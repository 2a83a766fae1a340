"""A start after an unclean close: a writer killed -9 leaves its LMDB file unstamped, so the next open
walks all of it (py-lmdb's offline verifier) before LMDB may map it. The engine serves meanwhile
(its disk chunks misses), and once the walk passed every chunk the killed writer acknowledged is a
hit, byte for byte. The walk is held at a real blocking point (the verifier waits on an event), so
"meanwhile" does not depend on how fast this machine walks."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import List

import pytest

from kvtier.engine import EngineConfig, OffloadEngine
from kvtier.tiers.deferred import DeferredTier
from kvtier.tiers.lmdb import LmdbTier, structure_walk_due
from kvtier.tools.testing.children import read_line, run_child
from kvtier.tools.testing.fault_child import (
    ENGINE_FINGERPRINT,
    _engine_device,
    check_engine_requests,
    engine_layout,
    engine_request,
)

lmdb_verify = pytest.importorskip("lmdb.verify")

SEED = 7


def killed_writer(cache: Path, tmp_path: Path, requests: int = 3) -> List[int]:
    """Run an engine-spill child on ``cache`` until it acknowledged ``requests`` requests as durable,
    then SIGKILL it. Returns the acknowledged request indices."""
    proc = run_child(["engine-spill", "--dir", str(cache), "--seed", str(SEED)], tmp_path / "child.err")
    acked: List[int] = []
    try:
        assert read_line(proc, 60.0) == "ready"
        while len(acked) < requests:
            parts = read_line(proc, 60.0).split()
            if parts and parts[0] == "ack":
                acked.append(int(parts[1]))
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -9
    return acked


@pytest.mark.asyncio
async def test_a_start_after_kill_9_serves_while_the_walk_runs_then_hits_what_was_acknowledged(
        tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    acked = killed_writer(cache, tmp_path)
    assert structure_walk_due(cache)  # killed: no verified clean close stamped the file

    gate = threading.Event()
    walked: List[str] = []
    real = lmdb_verify.verify

    def held(path: str, *args, **kwargs):
        walked.append(path)
        if not gate.wait(60.0):
            raise AssertionError("the walk was never released")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(lmdb_verify, "verify", held)
    layout = engine_layout()
    config = EngineConfig(cache_dir=str(cache), host_capacity_bytes=4 << 20, pressure_poll_interval_s=3600.0)
    engine = OffloadEngine(layout, _engine_device(layout, 8), config, fingerprint=ENGINE_FINGERPRINT,
                           pressure_sources={})
    try:
        # A start that waited for the walk would wait for the gate: it must answer first.
        await asyncio.wait_for(engine.start(), timeout=20.0)
        await asyncio.sleep(0.05)
        assert walked == [str(cache)] and not gate.is_set()
        assert isinstance(engine.disk_tier, DeferredTier) and engine.disk_tier.opened is None
        requests = [engine_request(SEED, index)[0] for index in acked]
        assert [engine.lookup(tokens + [0]) for tokens in requests] == [0] * len(requests)  # misses, meanwhile
        assert engine.statistics()["chunks_on_disk"] == 0

        gate.set()
        await engine.flush()  # waits for the open and the listing behind it
        assert isinstance(engine.disk_tier, LmdbTier) and engine.quarantined_cache_dir is None
        assert [engine.lookup(tokens + [0]) for tokens in requests] == [len(tokens) for tokens in requests]
        engine.check()
        await engine.check_disk()
    finally:
        gate.set()
        await engine.close()
    assert not structure_walk_due(cache)  # walked, then closed cleanly: stamped
    # Every acknowledged request loads back byte for byte in a fresh engine.
    assert await check_engine_requests(str(cache), SEED, acked) == []
