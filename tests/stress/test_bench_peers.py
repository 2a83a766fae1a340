"""Opt-in: the bench's peer subjects (vLLM fs, LMCache disk, SGLang file, each +fsync) on tiny sizes.

Their imports alone take 10-40 s on 2 busy cores, so this is not in the default run:
``python -m pytest tests/stress/test_bench_peers.py``. A peer that is not installed must appear in
the report's ``peers_skipped`` with its reason, never silently vanish.
"""

from __future__ import annotations

import asyncio

import pytest

from kvtier.tools.bench import run_bench

pytestmark = pytest.mark.stress


def test_peers_run_side_by_side_and_read_back_every_byte(tmp_path):
    report = asyncio.run(
        run_bench(sizes=(256 << 10,), total_bytes=4 << 20, rounds=2, parts={"tiers"}, cache_dir=str(tmp_path),
                  peers=True)
    )
    assert report.failures == []  # every peer read back exactly the bytes written
    names = {row.name for row in report.rows}
    skipped = report.machine.get("peers_skipped", [])
    for peer in ("vllm fs", "lmcache disk", "sglang file"):
        if any(s.lower().startswith(peer.split()[0]) for s in skipped):
            continue
        assert f"{peer} write (no fsync) 256KiB" in names
        assert f"kvtier lmdb write vs {peer} +fsync 256KiB" in names
        assert f"kvtier lmdb cold read vs {peer} 256KiB" in names
