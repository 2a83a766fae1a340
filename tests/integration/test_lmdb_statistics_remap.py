"""``LmdbTier.statistics()`` beside a remap: LMDB's info reads the meta pages inside the map, which a
map growth (or a reopen) replaces under the exclusive map lock while py-lmdb has released the GIL.
statistics() reads under the shared side, and never waits for it: while a remap holds the lock it
reports the size it last read."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from kvtier.tiers.lmdb import LmdbTier


def test_statistics_does_not_touch_the_environment_while_a_remap_holds_the_map_lock(tmp_path):
    with LmdbTier(tmp_path / "cache", map_size_bytes=1 << 20, segment_threshold_bytes=None) as tier:
        size = tier.statistics().extra["map_size_bytes"]
        assert size == float(1 << 20)
        remapping, done = threading.Event(), threading.Event()

        def reopen() -> None:  # what the writer does after MDB_PANIC: close and reopen, exclusively
            with tier._map_lock.exclusive():
                tier._env.close()
                remapping.set()
                done.wait(30)
                tier._open_env(2 << 20)

        worker = threading.Thread(target=reopen)
        worker.start()
        try:
            assert remapping.wait(30)
            # The environment is closed under the lock: reading its info now would fail (or, in a
            # growth, read unmapped meta pages). The call neither waits nor reads it.
            stats = tier.statistics()
            assert stats.extra["map_size_bytes"] == size
            assert worker.is_alive()  # still holding the lock: the call did not wait for it
        finally:
            done.set()
            worker.join(30)
        assert tier.statistics().extra["map_size_bytes"] == float(2 << 20)  # the reopened map, read again


# In a child, so that a crash is a return code, not a dead pytest: puts grow a 1 MiB map many times
# while two threads read statistics() in a loop.
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
