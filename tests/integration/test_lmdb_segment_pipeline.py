"""The LMDB tier's pipelined put path: batch n+1's segment writes run while batch n commits, and
each batch is still acknowledged (and its pointers committed) only once its own payload is synced.

The payload I/O is held at a real blocking point: the segment writer's hook runs on the lane
thread right before each ``pwritev`` and on the writer thread before each ``fdatasync``; the tier's
I/O hook runs before each commit. The test records that order."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import List

import pytest

from kvtier.tiers.base import IOHook
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.record_format import CodecConfig
from kvtier.tools.testing.children import make_batch
from segment_checks import assert_served

THRESHOLD = 16 << 10
WAIT_S = 10.0
A_RUNS = 3  # batch A's direct writes: its 3 records, one run each (split so 3 lanes have one)


class _Order(IOHook):
    """Records "write" / "sync" (segment writer) and "commit" (tier); holds the first segment write
    (batch A's) until ``release_a``, the first write after A's (batch B's) until ``release_b``,
    and the first commit (A's) until B's write is held (``overlapped``: it was, in time)."""

    def __init__(self) -> None:
        self.events: List[str] = []
        self._lock = threading.Lock()
        self.a_held = threading.Event()
        self.release_a = threading.Event()
        self.b_held = threading.Event()
        self.release_b = threading.Event()
        self.overlapped = False

    def before(self, op: str) -> None:  # the tier's hook: puts, commits, reads
        if op == "commit":
            if "commit" not in self.events:
                # A's commit waits until B's first write is in flight: it is, at once, when B's
                # writes were begun before this commit (without the overlap it never comes).
                self.overlapped = self.b_held.wait(WAIT_S)
            self._add("commit")

    def segment(self, op: str) -> None:  # the segment writer's hook
        with self._lock:
            writes = self.events.count("write") + self.events.count("B write held")
            first_a = op == "write" and writes == 0
            first_b = op == "write" and writes == A_RUNS
            if first_a:
                self.a_held.set()
            if first_b:
                self.b_held.set()
                self.events.append("B write held")
            else:
                self.events.append(op)
        if first_a:
            self.release_a.wait(WAIT_S)
        if first_b:
            self.release_b.wait(WAIT_S)

    def _add(self, event: str) -> None:
        with self._lock:
            self.events.append(event)


@pytest.mark.asyncio
async def test_next_batch_writes_overlap_the_commit_and_each_ack_waits_for_its_own_sync(tmp_path: Path) -> None:
    warm = make_batch(1, 0, [65536])
    a = make_batch(2, 1, [65536, 65536, 65536])
    b = make_batch(3, 2, [65536, 65536, 65536])
    async with await LmdbTier.open(tmp_path / "c", codec=CodecConfig(compress=False),
                                   segment_threshold_bytes=THRESHOLD) as tier:
        await tier.put_many(warm)  # opens the segment writer
        order = _Order()
        tier._io_hook = order
        tier._writes.segment_writer.hook = order.segment
        put_a = asyncio.ensure_future(tier.put_many(a))
        assert await asyncio.to_thread(order.a_held.wait, WAIT_S)
        put_b = asyncio.ensure_future(tier.put_many(b))
        for _ in range(1000):  # B encoded and queued behind A on the writer
            if tier._writer._queue.qsize() >= 1:
                break
            await asyncio.sleep(0.005)
        assert tier._writer._queue.qsize() >= 1
        order.release_a.set()
        # A is acknowledged while B's payload write is still held ...
        assert await asyncio.wait_for(put_a, 3 * WAIT_S) > 0
        assert order.b_held.is_set() and not put_b.done()
        # ... because B's writes began before A's commit (the overlap), and A's sync came before it.
        assert order.overlapped
        assert order.events[:A_RUNS].count("write") == A_RUNS  # A's writes all came first
        assert order.events.index("B write held") < order.events.index("commit")
        assert order.events.index("sync") < order.events.index("commit")
        assert order.events.count("commit") == 1
        # B is not visible (no pointer to its unwritten bytes) until its own sync and commit.
        assert await tier.contains_many([key for key, _, _ in b]) == [False] * 3
        order.release_b.set()
        await asyncio.wait_for(put_b, WAIT_S)
        tail = order.events[order.events.index("commit") + 1:]
        assert tail[-2:] == ["sync", "commit"] and "write" not in tail[tail.index("sync"):]
        tier._io_hook = IOHook()
        await assert_served(tier, warm + a + b)
        assert await tier.check() == []
