"""Opt-in: ``LmdbTier.statistics()`` called in a tight loop from two threads while puts grow a 1 MiB
map five times. Out of the default run: on this project's 2-core machines the second put can wait
for minutes for LMDB's write transaction while the two readers spin (seen on every branch since it
was written), so the run is a stress check, bounded by its 300 s timeout, not a unit regression;
the default run keeps the deterministic check that statistics() never touches the environment
while a remap holds the map lock (tests/integration/test_lmdb_statistics_remap.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.stress

_GROW_WHILE_READING = textwrap.dedent(
    """
    import asyncio, sys, threading
    import numpy as np
    from kvtier.tiers.base import ChunkMeta
    from kvtier.tiers.lmdb import LmdbTier
    from kvtier.tiers.record_format import CodecConfig

    async def main():
        async with await LmdbTier.open(sys.argv[1], map_size_bytes=1 << 20, segment_threshold_bytes=None,
                                       codec=CodecConfig(compress=False)) as tier:
            stop = threading.Event()
            seen = []

            def read():
                while not stop.is_set():
                    seen.append(tier.statistics().extra["map_size_bytes"])

            readers = [threading.Thread(target=read) for _ in range(2)]
            for t in readers:
                t.start()
            try:
                for i in range(48):
                    raw = np.full(512 << 10, i, np.uint8)
                    await tier.put_many([(b"grow-%d" % i, ChunkMeta(b"g", 0, i, "uint8", (raw.size,)), raw)])
            finally:
                stop.set()
                for t in readers:
                    t.join()
            final = tier.statistics()
            print(int(final.extra["map_growths"]), len(seen), int(min(seen)), int(max(seen)), int(final.extra["map_size_bytes"]))

    asyncio.run(main())
    """
)


def test_statistics_under_concurrent_map_growth_never_crashes(tmp_path):
    res = subprocess.run([sys.executable, "-c", _GROW_WHILE_READING, str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"the child died with {res.returncode}: {res.stderr[-2000:]}"
    growths, calls, smallest, largest, final = map(int, res.stdout.split())
    assert growths >= 4 and calls > 0
    assert smallest >= 1 << 20 and largest <= final  # only sizes the map had, never 0 or garbage
