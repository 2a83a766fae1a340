"""``LmdbTier.statistics()`` beside a remap: LMDB's info reads the meta pages inside the map, which a
map growth (or a reopen) replaces under the exclusive map lock while py-lmdb has released the GIL.
statistics() reads under the shared side, and never waits for it: while a remap holds the lock it
reports the size it last read."""

from __future__ import annotations

import threading

from kvtier.tiers.lmdb import LmdbTier


def test_statistics_does_not_touch_the_environment_while_a_remap_holds_the_map_lock(tmp_path):
    with LmdbTier(tmp_path / "cache", map_size_bytes=1 << 20, segment_threshold_bytes=None) as tier:
        size = tier.statistics().extra["map_size_bytes"]
        assert size == float(1 << 20)
        remapping, done = threading.Event(), threading.Event()

        def reopen() -> None:  # what the writer does after MDB_PANIC: close and reopen, exclusively
            with tier._db.map_lock.exclusive():
                tier._db.env.close()
                remapping.set()
                done.wait(30)
                tier._db.open(2 << 20)

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
