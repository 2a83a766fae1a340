"""Two hosts, one cache: two engine processes with their own cache directories share one Valkey
cluster; host B hits and loads bitwise what host A prefilled, even restarted with an empty LMDB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


CHILD = str(Path(__file__).with_name("remote_fleet_child.py"))


def run_host(mode: str, url: str, cache_dirs, namespace: str, bytes_file: Path) -> list:
    proc = subprocess.run(
        [sys.executable, CHILD, mode, url, ",".join(map(str, cache_dirs)), namespace, str(bytes_file)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_host_b_hits_what_host_a_stored_and_still_after_an_empty_restart(valkey_cluster, tmp_path):
    namespace = f"fleet{os.getpid()}"
    bytes_file = tmp_path / "a-bytes.bin"
    [a] = run_host("store", valkey_cluster.url, [tmp_path / "host-a"], namespace, bytes_file)
    # FA block 16 + SWA block 4 (W 8, R 3), 33 tokens: the seed scenario's stored sets.
    assert a["stored"] == {"0": [0, 1], "1": [1, 2, 3, 5, 6, 7]}
    assert a["remote_puts"] == 8 and a["writebehind_chunks"] == 8

    # Host B, another process, never saw the prompt: its LMDB is empty, the cluster has it. Its
    # engine then restarts twice: over the same directory, and over a new empty one.
    b, b2, b3 = run_host("load", valkey_cluster.url,
                         [tmp_path / "host-b", tmp_path / "host-b", tmp_path / "host-b-new"], namespace, bytes_file)
    assert b["hit"] == 32 and b["ok"]
    assert b["loaded"] == {"0": [0, 1], "1": [5, 6, 7]}  # checked bitwise in the child
    assert b["remote_hits"] == 5 and b["lmdb_hits"] == 0 and b["promotions"] == 5

    # B again over its own directory: promoted into its LMDB, so the hit is local now.
    assert b2["hit"] == 32 and b2["lmdb_hits"] == 5 and b2["remote_hits"] == 0

    # B restarted with an empty LMDB (a new machine): still hits through the cluster.
    assert b3["hit"] == 32 and b3["ok"] and b3["remote_hits"] == 5
