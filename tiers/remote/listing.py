"""The remote tier's listing of its namespace, and the periodic listing that backs up notifications.

Primitive: ``Listing`` (event-loop thread only). ``scan`` lists the namespace on every primary
reachable now (``SCAN``). ``reconcile`` is one round of the backstop: refresh the slot map, (re)start
the eviction listeners for new primaries, list, and report each known key found gone
(``external``: another host's delete, a node restarted empty, a notification lost - pub/sub is
at-most-once), and, with ``on_new``, hands over the keys it found that no notice announced. ``start`` runs rounds every ``interval_s``, or sooner when woken (a listener that lost
its subscription wakes it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, List, Optional, Set, Tuple

from kvtier.errors import ClosedError, TierIOError

from .counters import RemoteCounters
from .keyspace import Keyspace
from .notify import EvictionListener
from .router import NodeRouter, RemoteNode

__all__ = ["Listing"]

logger = logging.getLogger("kvtier.tiers.remote")

_SCAN_COUNT = 1000


class Listing:
    """See the module docstring. Counts in the tier's counters: ``errors`` (a primary whose listing
    failed, a round that failed), ``listings`` and ``removals_listed``. Event-loop thread only."""

    def __init__(self, router: NodeRouter, listener: EvictionListener, keys: Keyspace,
                 counters: RemoteCounters, *, interval_s: Optional[float], wakeup: asyncio.Event,
                 closed: Callable[[], bool], on_new: Optional[Callable[[List[bytes]], None]] = None) -> None:
        self._router = router
        self._listener = listener
        self._keys = keys
        self._stats, self._extra = counters.stats, counters.extra
        self._interval_s = interval_s
        self._wakeup = wakeup
        self._closed = closed
        self._on_new = on_new
        self._task: Optional["asyncio.Task[None]"] = None

    async def scan(self) -> Tuple[Set[bytes], Set[str]]:
        """Keys of this namespace on every primary reachable now, and the primaries that failed.
        Cancelling it: the listing stops, nothing else changes."""
        found: Set[bytes] = set()
        failed: Set[str] = set()
        pattern = self._keys.prefix + b"*"

        async def scan_node(node: RemoteNode) -> None:
            cursor: Any = 0
            while True:
                reply = (await node.call([("SCAN", cursor, "MATCH", pattern, "COUNT", _SCAN_COUNT)]))[0]
                if isinstance(reply, BaseException):
                    raise TierIOError(f"remote tier: SCAN on {node.name} failed: {reply}")
                cursor, names = reply
                for rk in names:
                    key = self._keys.chunk_key(bytes(rk))
                    if key is not None:
                        found.add(key)
                if int(cursor) == 0:
                    return

        nodes = self._router.primaries()
        outcomes = await asyncio.gather(*(scan_node(n) for n in nodes), return_exceptions=True)
        for node, outcome in zip(nodes, outcomes):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                failed.add(node.name)
                self._stats["errors"] += 1
        return found, failed

    async def reconcile(self) -> int:
        """One round of the backstop (module docstring): reports each known key that is gone - but
        only keys last seen before the listing began, on primaries that listed fine. Returns how
        many were reported. Cancelling it: nothing is reported."""
        keys = self._keys
        self._extra["listings"] += 1
        await self._router.refresh()
        await self._listener.sync()
        start_seq = keys.sequence
        keys.watch_removals()
        try:
            found, failed = await self.scan()
        finally:
            evicted_meanwhile = keys.watched_removals()

        def lost_node(rkey: bytes) -> bool:
            node = self._router.owner(rkey)
            return node is None or node.name in failed

        removals = keys.removed(keys.gone(start_seq, found, lost_node), "external")
        self._extra["removals_listed"] += len(removals)
        keys.report(removals)
        # Found and never announced - unless evicted while the listing ran (gone, or soon gone).
        fresh = [key for key in found if key not in keys.known and key not in evicted_meanwhile] \
            if self._on_new is not None else []
        keys.remember_new(found, start_seq)
        if fresh and self._on_new is not None:
            # Keys whose new-key notice was lost (a subscription that dropped): arrivals now.
            self._on_new(fresh)
        return len(removals)

    def start(self) -> None:
        """Run the periodic rounds as a task of this loop (nothing when ``interval_s`` is None)."""
        if self._interval_s is not None:
            self._task = asyncio.get_running_loop().create_task(self._loop(self._interval_s),
                                                                name="kvtier-remote-listing")

    async def _loop(self, interval: float) -> None:
        while not self._closed():
            try:
                await asyncio.wait_for(self._wakeup.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self._wakeup.clear()
            if self._closed():
                return
            try:
                await self.reconcile()
            except ClosedError:
                return
            except Exception as exc:  # keep the backstop alive; the next round tries again
                self._stats["errors"] += 1
                logger.warning("remote tier: listing failed: %s", exc)

    async def close(self) -> None:
        """Stop the periodic rounds and wait for the task to end. Cancelling it: the task is
        cancelled already; only the wait stops."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
