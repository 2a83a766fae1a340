"""Eviction notifications from every primary: ``EvictionListener``. Event-loop thread only.

A Valkey/Redis server evicts silently (a GET just misses); with ``notify-keyspace-events Ee`` it
publishes each evicted (and expired) key on ``__keyevent@0__:evicted`` / ``:expired``. The messages
are node-local, so there is one subscription per primary, each on its own connection (a pub/sub
connection cannot serve commands, and must not take a slot of the node's bounded pool). Pub/sub is
at-most-once: a subscription that drops and comes back calls ``on_gap`` so the owner runs its
listing (the backstop) soon. With ``on_new``, the same subscription also takes
``__keyevent@0__:new`` (flag ``n``: a key that did not exist was written) and ``:del`` (flag ``g``:
another writer deleted one, e.g. a corrupt record it found), so an owner learns of records other
writers add or delete without listing the namespace (a delete reaches ``on_keys`` as an eviction).

``barrier`` tells an owner when the notices sent so far have all arrived: it publishes a marker on a
channel of the listener's own on each primary, and a primary writes a subscriber's messages in the
order it generated them, so the marker comes back after every notice the primary sent before it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import redis.asyncio as aioredis

from .router import NodeRouter, RemoteNode

__all__ = ["EvictionListener", "EVICTION_CHANNELS", "NEW_KEY_CHANNEL"]

logger = logging.getLogger("kvtier.tiers.remote")

EVICTION_CHANNELS = (b"__keyevent@0__:evicted", b"__keyevent@0__:expired")
NEW_KEY_CHANNEL = b"__keyevent@0__:new"
DEL_CHANNEL = b"__keyevent@0__:del"  # flag g: another host's delete (a corrupt record it found)
MARKER_CHANNEL_PREFIX = b"__kvtier__:marker:"  # one channel per listener: its own barrier markers
_BACKOFF_S = (0.2, 5.0)  # reconnect delay: first, cap
_DRAIN_MAX = 1000  # messages handed over in one burst


class EvictionListener:
    """Keeps one subscription per primary of ``router``; ``on_keys(names)`` gets the evicted key
    names (raw server names; the owner filters its namespace), ``on_gap()`` is called after a
    subscription was re-established; ``on_new(names)``, when given, the names of keys written new
    (``NEW_KEY_CHANNEL``). ``configure``: add ``Ee`` (and ``n`` with ``on_new``) to each primary's
    ``notify-keyspace-events`` (keeping its other flags). Its timeouts are the router's. Event-loop
    thread only; the callbacks are called there, each node's in the order the node sent them."""

    def __init__(self, router: NodeRouter, *, configure: bool,
                 on_keys: Callable[[List[bytes]], None], on_gap: Callable[[], None],
                 on_new: Optional[Callable[[List[bytes]], None]] = None) -> None:
        self._router = router
        self._timeout_s = router.timeout_s
        self._connect_timeout_s = router.connect_timeout_s
        self._configure = configure
        self._on_keys = on_keys
        self._on_gap = on_gap
        self._on_new = on_new
        self._marker_channel = MARKER_CHANNEL_PREFIX + uuid.uuid4().hex.encode()
        self._channels = (EVICTION_CHANNELS + ((NEW_KEY_CHANNEL, DEL_CHANNEL) if on_new is not None else ())
                          + (self._marker_channel,))
        self._subscribed: Set[str] = set()  # nodes whose subscription is established now
        # marker -> (the node whose subscription must bring it back, the barrier waiting for it)
        self._markers: Dict[bytes, Tuple[str, "asyncio.Future[None]"]] = {}
        self._marker_count = 0
        self._tasks: Dict[str, "asyncio.Task[None]"] = {}
        self.enabled: Dict[str, bool] = {}  # node name -> notifications known to be on
        self.restarts = 0
        self._closed = False

    async def sync(self) -> None:
        """Subscribe on primaries new to the slot map, stop listening to nodes that left it.
        Returns once each new subscription is established (or ``timeout_s`` passed): evictions
        right after ``open`` must not fall into the gap before the first SUBSCRIBE."""
        primaries = {node.name: node for node in self._router.primaries()}
        for name in [n for n in self._tasks if n not in primaries]:
            self._tasks.pop(name).cancel()
            self.enabled.pop(name, None)
        loop = asyncio.get_running_loop()
        subscribed: List["asyncio.Future[None]"] = []
        for name, node in primaries.items():
            if name in self._tasks:
                continue
            if self._configure and node.breaker.state == "closed":
                await self._enable(node)
            ready: "asyncio.Future[None]" = loop.create_future()
            subscribed.append(ready)
            self._tasks[name] = loop.create_task(
                self._listen(node.host, node.port, name, ready), name=f"kvtier-remote-notify-{name}"
            )
        if subscribed:
            await asyncio.wait(subscribed, timeout=self._timeout_s)

    async def _enable(self, node: RemoteNode) -> None:
        try:
            reply = (await node.call([("CONFIG", "GET", "notify-keyspace-events")]))[0]
            if isinstance(reply, BaseException):
                raise reply
            raw = reply.get(b"notify-keyspace-events", b"") if isinstance(reply, dict) else bytes(reply[1])
            flags = raw.decode()
            needed = "Eeng" if self._on_new is not None else "Ee"  # "A" covers "e" and "g", never "n"
            wanted = flags + "".join(c for c in needed if c not in flags and not (c in "eg" and "A" in flags))
            if wanted != flags:
                res = (await node.call([("CONFIG", "SET", "notify-keyspace-events", wanted)]))[0]
                if isinstance(res, BaseException):
                    raise res
            self.enabled[node.name] = True
        except Exception as exc:  # a managed server may forbid CONFIG: the listing still works
            self.enabled[node.name] = False
            logger.warning("remote tier: cannot enable eviction notifications on %s (%s); "
                           "evictions are seen by the periodic listing only", node.name, exc)

    async def _listen(self, host: str, port: int, name: str, ready: "asyncio.Future[None]") -> None:
        """Subscribe for as long as the listener is open; reconnect with bounded backoff.
        ``ready`` is resolved after the first attempt (subscribed or failed)."""
        delay = _BACKOFF_S[0]
        first = True
        while not self._closed:
            client = aioredis.Redis(host=host, port=port, socket_connect_timeout=self._connect_timeout_s,
                                    socket_timeout=None, retry=None,  # type: ignore[arg-type]  # no retries
                                    decode_responses=False)
            pubsub = client.pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(*self._channels), self._timeout_s)
                # SUBSCRIBE's confirmations: only from them on does the server send this
                # connection the channels' messages (redis-py does not wait for them).
                await self._confirmed(pubsub, name)
                self._subscribed.add(name)
                if not ready.done():
                    ready.set_result(None)
                if not first:
                    self.restarts += 1
                    self._on_gap()  # the gap may have swallowed evictions
                first = False
                delay = _BACKOFF_S[0]
                while not self._closed:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None:
                        continue
                    batch = [message]
                    for _ in range(_DRAIN_MAX):  # what is already there: one report per burst
                        more = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.0)
                        if more is None:
                            break
                        batch.append(more)
                    self._deliver(batch, name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection lost, node down: retry later
                logger.debug("remote tier: eviction listener on %s: %s", name, exc)
                if not ready.done():
                    ready.set_result(None)  # open() does not wait for a node that is down
                first = False
            finally:
                self._subscribed.discard(name)
                try:
                    await pubsub.aclose()
                    await client.aclose()
                except Exception:
                    pass
            if self._closed:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_S[1])

    async def _confirmed(self, pubsub: Any, name: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        confirmed = 0
        early: List[Dict[str, Any]] = []
        while confirmed < len(self._channels):
            message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=0.05)
            if message is None:
                if loop.time() > deadline:
                    raise TimeoutError(f"no SUBSCRIBE confirmation within {self._timeout_s} s")
            elif message.get("type") == "subscribe":
                confirmed += 1
            else:
                early.append(message)
        if early:
            self._deliver(early, name)

    def _deliver(self, messages: List[Dict[str, Any]], name: str) -> None:
        """Hand one burst from node ``name`` over in the node's order: a run of evictions to
        ``on_keys``, a run of new keys to ``on_new`` (a key written, evicted and written again stays
        in that order); a barrier's marker ends the run before it, then releases its barrier."""
        run: List[bytes] = []
        new = False
        for m in messages:
            if m.get("type") != "message":
                continue
            channel = bytes(m.get("channel") or b"")
            if channel == self._marker_channel:
                if run:
                    self._hand(run, new)
                    run = []
                self._marker_back(bytes(m["data"]), name)
                continue
            is_new = channel == NEW_KEY_CHANNEL
            if run and is_new != new:
                self._hand(run, new)
                run = []
            new = is_new
            run.append(bytes(m["data"]))
        if run:
            self._hand(run, new)

    def _marker_back(self, marker: bytes, name: str) -> None:
        # A cluster forwards a PUBLISH to every node's subscribers: only the copy that came back on
        # the node it was published on follows that node's own notices.
        waiting = self._markers.get(marker)
        if waiting is not None and waiting[0] == name and not waiting[1].done():
            waiting[1].set_result(None)

    async def barrier(self) -> None:
        """Return once every notice that each subscribed primary sent before this call has been
        handed to the callbacks: a marker published on each comes back on its subscription behind
        them. A primary whose subscription is down, or that does not take the PUBLISH, is skipped
        (a gap's notices are the listing's, ``on_gap``); at most ``timeout_s`` is waited for the
        markers. Cancelling it stops the wait only."""
        loop = asyncio.get_running_loop()
        nodes = [node for node in self._router.primaries() if node.name in self._subscribed]
        mine: List[bytes] = []
        try:
            for node in nodes:
                self._marker_count += 1
                marker = f"{node.name} {self._marker_count}".encode()
                self._markers[marker] = (node.name, loop.create_future())
                mine.append(marker)
            answers = await asyncio.gather(
                *(node.call([("PUBLISH", self._marker_channel, marker)]) for node, marker in zip(nodes, mine)),
                return_exceptions=True)
            waits = [self._markers[marker][1] for marker, answer in zip(mine, answers)
                     if not isinstance(answer, BaseException) and not isinstance(answer[0], BaseException)]
            if waits:
                await asyncio.wait(waits, timeout=self._timeout_s)
        finally:
            for marker in mine:
                self._markers.pop(marker, None)

    def _hand(self, names: List[bytes], new: bool) -> None:
        # A delete is handed over as an eviction: either way the record is gone.
        if new:
            assert self._on_new is not None
            self._on_new(names)
        else:
            self._on_keys(names)

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
