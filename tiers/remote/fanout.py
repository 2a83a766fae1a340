"""One command per key, spread over the nodes that own the keys: ``Fanout``. Event-loop thread only.

A batch becomes, per node, pipelines of at most ``pipeline_max_bytes`` (the transport copies a whole
pipeline into one buffer, so a huge one costs memory and speed), all sent concurrently; the call
returns once every pipeline has answered or failed. A key whose slot no node serves, and a reply
saying slots moved, make the router refresh its slot map soon.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

from kvtier.errors import TierIOError, TierTimeoutError

from .router import NodeRouter, NodeUnavailableError, RemoteNode, is_moved

__all__ = ["Fanout", "pipelines"]

Send = Callable[[RemoteNode, List[int]], Awaitable[List[Any]]]


def pipelines(indexes: Sequence[int], sizes: Sequence[int], cap: int) -> List[List[int]]:
    """Cut one node's items into pipelines of at most ``cap`` bytes (at least one item each)."""
    out: List[List[int]] = []
    cur: List[int] = []
    acc = 0
    for i in indexes:
        if cur and acc + sizes[i] > cap:
            out.append(cur)
            cur, acc = [], 0
        cur.append(i)
        acc += sizes[i]
    if cur:
        out.append(cur)
    return out


class Fanout:
    """Sends per-key commands through ``router``; counts, in the owner's ``extra`` counters,
    ``breaker_rejected`` (items refused by an open breaker), ``timeouts`` (pipelines) and ``moved``
    (batches that met moved slots). Event-loop thread only."""

    def __init__(self, router: NodeRouter, pipeline_max_bytes: int, extra: Dict[str, float]) -> None:
        self._router = router
        self._cap = pipeline_max_bytes
        self._extra = extra

    async def calls(self, rkeys: Sequence[bytes], sizes: Sequence[int], make: Callable[[int], Tuple[Any, ...]],
                    send: Optional[Send] = None) -> Tuple[List[Any], List[BaseException]]:
        """Run one command per key, grouped per node into size-capped pipelines, all concurrently
        (``send(node, indexes)`` runs one pipeline; by default ``node.call`` of ``make(i)`` each).

        Returns the per-key replies (an exception object where that key's command or its node
        failed) and the node-level failures. Every pipeline is waited for before returning.
        Cancelling it cancels the pipelines in flight; commands already sent may still be applied
        by the server (``RemoteNode.call``)."""
        router = self._router
        replies: List[Any] = [None] * len(rkeys)
        per, orphans = router.group(rkeys)
        failures: List[BaseException] = []
        for i in orphans:
            replies[i] = TierIOError("remote tier: no node serves this key's slot")
        if orphans:
            failures.append(replies[orphans[0]])
            router.refresh_soon()
        jobs: List[Tuple[RemoteNode, List[int]]] = []
        for name, indexes in per.items():
            node = router.nodes[name]
            for part in pipelines(indexes, sizes, self._cap):
                jobs.append((node, part))
        if send is None:
            send = lambda node, part: node.call([make(i) for i in part])  # noqa: E731
        outcomes = await asyncio.gather(*(send(node, part) for node, part in jobs), return_exceptions=True)
        moved = False
        for (node, part), outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                if isinstance(outcome, asyncio.CancelledError):
                    raise outcome
                failures.append(outcome)
                if isinstance(outcome, NodeUnavailableError):
                    self._extra["breaker_rejected"] += len(part)
                elif isinstance(outcome, TierTimeoutError):
                    self._extra["timeouts"] += 1
                for i in part:
                    replies[i] = outcome
                continue
            for i, reply in zip(part, outcome):
                replies[i] = reply
                if is_moved(reply):
                    moved = True
        if moved:
            self._extra["moved"] += 1
            router.refresh_soon()
        return replies, failures

    async def each(self, command: str, rkeys: Sequence[bytes]) -> Tuple[List[Any], List[BaseException]]:
        """``calls`` of ``(command, rkey)`` for every key (``DEL``, ``EXISTS``: replies are small)."""
        return await self.calls(rkeys, [len(k) for k in rkeys], lambda i: (command, rkeys[i]))
