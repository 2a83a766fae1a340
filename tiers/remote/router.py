"""Connections to the remote nodes and routing of keys to them.

Primitives: ``NodeRouter`` (the slot map and one client per primary), ``RemoteNode`` (a primary:
its client, its circuit breaker, its concurrency bound). Everything runs on the event-loop thread.

Why not ``redis.asyncio.cluster.RedisCluster``: measured here, its defaults are wrong for a cache
(10 retries with backoff made a stalled node take 11-19 s to fail), it raises past
``max_connections`` instead of queueing, and one pipeline across a stalled node fails whole. So
routing is done here with redis-py's plain asyncio client per primary: ``CLUSTER SLOTS`` gives the
slot map, ``redis.crc.key_slot`` the slot of a key, each batch becomes one pipeline per node (cut at
``pipeline_max_bytes``), every node has its own semaphore (at most ``concurrency`` pipelines in
flight, exactly the size of its connection pool, so the pool never overflows), its own breaker, and
no client-side retries: a failed call fails once, fast, and the caller (a cache) treats it as a miss
or a failed store. A ``MOVED``/``ASK`` reply (slots moved) refreshes the slot map, rate-limited; the
command that got it counts as failed this time.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, RedisError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.errors import TierIOError, TierTimeoutError

from .breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from .getreader import GetConnection, LiveReads, Reply
from .url import RemoteAddress

__all__ = ["NodeRouter", "RemoteNode", "NodeUnavailableError"]

logger = logging.getLogger("kvtier.tiers.remote")

_SLOTS = 16384
_REFRESH_MIN_INTERVAL_S = 1.0


class NodeUnavailableError(TierIOError):
    """The node's circuit breaker is open: the call was refused without touching the network."""


class _Abandoned(Exception):
    """The batch was abandoned before this pipeline was sent."""


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


class RemoteNode:
    """One primary: ``name`` is ``host:port``. Event-loop thread only (the loop the tier opened on)."""

    def __init__(self, host: str, port: int, *, timeout_s: float, connect_timeout_s: float,
                 concurrency: int, breaker_failures: int, breaker_reset_s: float) -> None:
        self.host = host
        self.port = port
        self.name = f"{host}:{port}"
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: List[GetConnection] = []  # GET connections between pipelines
        self._closed = False
        self.client = aioredis.Redis(
            host=host, port=port, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
            retry=_no_retry(), retry_on_error=[], max_connections=concurrency, decode_responses=False,
            socket_keepalive=True, health_check_interval=0,
        )
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)
        self.slots = asyncio.Semaphore(concurrency)
        self._probe: Optional["asyncio.Future[bool]"] = None
        self.timeouts = 0
        # Fault-injection point (like tiers.base.IOHook): called with the node and the pipeline's
        # commands right before it is sent; the fault suite kills or stops a server from it
        # mid-batch, or raises the error a broken connection would (mapped like the real one).
        self.hook: Optional[Callable[["RemoteNode", Sequence[Tuple[Any, ...]]], None]] = None

    async def _ready(self) -> None:
        """Raise ``NodeUnavailableError`` unless calls may go (breaker closed, or healed by a probe)."""
        breaker = self.breaker
        state = breaker.state
        if state == CLOSED:
            return
        if state == HALF_OPEN:
            if self._probe is None:
                self._probe = asyncio.ensure_future(self._run_probe())
            healed = await asyncio.shield(self._probe)
            if healed:
                return
        raise NodeUnavailableError(f"remote tier: node {self.name} is unavailable (circuit open)")

    async def _run_probe(self) -> bool:
        """Single-flight PING through the half-open breaker; always settles the breaker."""
        try:
            allowed = self.breaker.allow()
            if not allowed:
                return self.breaker.state == CLOSED
            try:
                async with self.slots:  # the pool holds exactly ``concurrency`` connections
                    await asyncio.wait_for(self.client.ping(), self.timeout_s)
            except BaseException:
                self.breaker.failure()
                return False
            self.breaker.success()
            return True
        finally:
            self._probe = None

    async def call(self, commands: Sequence[Tuple[Any, ...]]) -> List[Any]:
        """Run ``commands`` as one non-transactional pipeline; per-command errors come back as
        exception objects in the list. Raises ``NodeUnavailableError`` (breaker open),
        ``TierTimeoutError`` (no answer within ``timeout_s``; opens the breaker), ``TierIOError``
        (connection failed). Cancelling it: the connection in use is dropped by redis-py; commands
        already sent may still be applied by the server."""
        await self._ready()
        async with self.slots:
            try:
                if self.hook is not None:
                    self.hook(self, commands)
                pipe = self.client.pipeline(transaction=False)
                for args in commands:
                    pipe.execute_command(*args)
                # A second bound over the socket timeout: a connect that hangs in the pool, or a
                # server that trickles bytes, still ends within about two timeouts.
                results = await asyncio.wait_for(pipe.execute(raise_on_error=False), 2 * self.timeout_s)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                raise self._failed(exc) from exc
        self.breaker.success()
        return list(results)

    def _failed(self, exc: BaseException) -> TierIOError:
        """The typed error of a pipeline that failed underneath, the breaker told: a timeout trips
        it at once (``TierTimeoutError``), any other failure counts one (``TierIOError``)."""
        if isinstance(exc, (RedisTimeoutError, asyncio.TimeoutError)):
            self.timeouts += 1
            self.breaker.trip()
            return TierTimeoutError(f"remote tier: node {self.name} did not answer within {self.timeout_s} s")
        self.breaker.failure()
        return TierIOError(f"remote tier: node {self.name} failed: {exc}")

    async def problem(self, cluster: bool) -> Optional[str]:
        """What is wrong with the node now, ``None`` when it answers (``PING``; in a cluster,
        ``CLUSTER INFO`` must say the state is ok). A half-open breaker is probed by this, and
        healed if the node answers."""
        command: Tuple[Any, ...] = ("CLUSTER", "INFO") if cluster else ("PING",)
        try:
            reply = (await self.call([command]))[0]
        except TierIOError as exc:
            return f"node {self.name}: {exc}"
        if isinstance(reply, BaseException):
            return f"node {self.name}: {reply}"
        if cluster and b"cluster_state:ok" not in bytes(reply):
            return f"node {self.name}: cluster state not ok"
        return None

    async def get_into(self, rkeys: Sequence[bytes], targets: Sequence[memoryview],
                       live: LiveReads) -> List[Reply]:
        """``GET`` each key as one pipeline on a ``GetConnection``: a raw record of its target's size
        lands straight in the target (``DirectValue``), any other value comes back whole
        (``bytearray``), an error reply as redis-py's exception object, an absent key as ``None``.
        Errors, timeouts and the breaker as ``call``. While it reads, its connection is in
        ``live``: ``live.abandon()`` stops every write into the targets at once (and keeps a call
        that has not sent yet from sending), and this call then raises ``TierIOError`` without
        counting against the breaker.
        Cancelling it: the connection is aborted before the cancellation propagates, so nothing
        writes into the targets after it ends."""
        await self._ready()
        async with self.slots:
            conn: Optional[GetConnection] = None
            try:
                if self.hook is not None:
                    self.hook(self, [("GET", rk) for rk in rkeys])
                conn = await self._get_connection()
                if live.abandoned:
                    raise _Abandoned()
                live.connections.add(conn)
                replies = await asyncio.wait_for(conn.get(rkeys, targets), 2 * self.timeout_s)
            except (RedisTimeoutError, asyncio.TimeoutError) as exc:
                raise self._failed(exc) from exc
            except (RedisError, OSError, _Abandoned) as exc:
                if live.abandoned:  # aborted for the caller: not the node's fault
                    raise TierIOError(f"remote tier: read from {self.name} abandoned") from exc
                raise self._failed(exc) from exc
            finally:
                if conn is not None:
                    live.connections.discard(conn)
                    if conn.broken is not None:
                        pass
                    elif self._closed:  # the node was closed (or left the slot map) meanwhile
                        conn.abort()
                    else:
                        self._idle.append(conn)
        self.breaker.success()
        return replies

    async def _get_connection(self) -> GetConnection:
        while self._idle:
            conn = self._idle.pop()
            if conn.broken is None:
                return conn
        loop = asyncio.get_running_loop()
        transport, conn = await asyncio.wait_for(
            loop.create_connection(GetConnection, self.host, self.port), self.connect_timeout_s
        )
        sock = transport.get_extra_info("socket")
        if sock is not None:  # as the redis-py client's connections: a dead peer is noticed
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return conn

    async def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.abort()
        self._idle.clear()
        try:
            await self.client.aclose()
        except Exception:  # a broken connection cannot stop a close
            pass


class NodeRouter:
    """Slot map and primaries of one remote address (one node, or a cluster). Event-loop thread
    only. ``timeout_s`` bounds each node call, ``connect_timeout_s`` each connect."""

    def __init__(self, address: RemoteAddress, *, timeout_s: float, connect_timeout_s: float,
                 concurrency: int, breaker_failures: int, breaker_reset_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._node_kwargs = dict(
            timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, concurrency=concurrency,
            breaker_failures=breaker_failures, breaker_reset_s=breaker_reset_s,
        )
        self.nodes: Dict[str, RemoteNode] = {}
        self._starts: List[int] = [0]
        self._owners: List[str] = []
        self._refreshing: Optional["asyncio.Task[None]"] = None
        self._last_refresh = -1e9
        self.refreshes = 0
        self._hook: Optional[Callable[[RemoteNode, Sequence[Tuple[Any, ...]]], None]] = None

    def set_hook(self, hook: Optional[Callable[[RemoteNode, Sequence[Tuple[Any, ...]]], None]]) -> None:
        """Install ``hook(node, commands)``, called before every pipeline on every node (fault
        injection)."""
        self._hook = hook
        for node in self.nodes.values():
            node.hook = hook

    def _node(self, host: str, port: int) -> RemoteNode:
        name = f"{host}:{port}"
        node = self.nodes.get(name)
        if node is None:
            node = RemoteNode(host, port, **self._node_kwargs)  # type: ignore[arg-type]
            node.hook = self._hook
            self.nodes[name] = node
        return node

    async def start(self) -> None:
        """Connect: one node, or learn the cluster's slot map from any seed. ``TierIOError`` when
        no seed answers."""
        if not self.address.cluster:
            host, port = self.address.seeds[0]
            node = self._node(host, port)
            self._starts, self._owners = [0], [node.name]
            reply = (await node.call([("PING",)]))[0]
            if isinstance(reply, BaseException):
                raise TierIOError(f"remote tier: node {node.name} refused PING: {reply}")
            return
        await self._refresh_slots()

    def start_unreachable(self) -> None:
        """Carry on after ``start`` failed: the single node's breaker is open (its probes heal it);
        a cluster has no slot map yet (every key is unserved until a refresh succeeds)."""
        if not self.address.cluster:
            self.nodes[self._owners[0]].breaker.trip()
        else:
            self._starts, self._owners = [0], [""]

    async def _refresh_slots(self) -> None:
        candidates = [(n.host, n.port) for n in self.nodes.values()] + list(self.address.seeds)
        errors: List[str] = []
        loop = asyncio.get_running_loop()
        self._last_refresh = loop.time()
        for host, port in dict.fromkeys(candidates):
            node = self._node(host, port)
            try:
                reply = (await node.call([("CLUSTER", "SLOTS")]))[0]
            except TierIOError as exc:
                errors.append(str(exc))
                continue
            if isinstance(reply, BaseException):
                errors.append(f"{node.name}: {reply}")
                continue
            ranges: List[Tuple[int, int, str]] = []
            for entry in reply:
                start, end, primary = int(entry[0]), int(entry[1]), entry[2]
                phost = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                if not phost:
                    phost = host  # a node that does not know its own address answers ""
                ranges.append((start, end, self._node(phost, int(primary[1])).name))
            ranges.sort()
            starts: List[int] = []
            owners: List[str] = []
            covered = 0
            for start, end, owner in ranges:
                if start > covered:
                    starts.append(covered)
                    owners.append("")  # slots nobody serves
                starts.append(start)
                owners.append(owner)
                covered = end + 1
            if covered < _SLOTS:
                starts.append(covered)
                owners.append("")
            self._starts, self._owners = starts, owners
            self.refreshes += 1
            live = set(owners)
            for name in [n for n in self.nodes if n not in live]:
                await self.nodes.pop(name).close()
            return
        raise TierIOError("remote tier: no cluster node answered CLUSTER SLOTS: " + "; ".join(errors))

    def refresh_soon(self) -> None:
        """Schedule a slot-map refresh (after a MOVED/ASK reply), at most one per second."""
        if not self.address.cluster or self._refreshing is not None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._last_refresh < _REFRESH_MIN_INTERVAL_S:
            return

        async def run() -> None:
            try:
                await self._refresh_slots()
            except TierIOError as exc:
                logger.warning("%s", exc)
            finally:
                self._refreshing = None

        self._refreshing = loop.create_task(run())

    async def refresh(self) -> None:
        """Refresh the slot map now (cluster mode); errors are logged, the old map is kept."""
        if not self.address.cluster:
            return
        try:
            await self._refresh_slots()
        except TierIOError as exc:
            logger.warning("%s", exc)

    def owner(self, rkey: bytes) -> Optional[RemoteNode]:
        """The primary serving ``rkey``'s slot, or ``None`` when no node serves it."""
        if len(self._owners) == 1:
            name = self._owners[0]
        else:
            slot = key_slot(rkey)
            name = self._owners[bisect.bisect_right(self._starts, slot) - 1]
        return self.nodes.get(name) if name else None

    def group(self, rkeys: Sequence[bytes]) -> Tuple[Dict[str, List[int]], List[int]]:
        """Indexes of ``rkeys`` per node name, and the indexes no node serves."""
        per: Dict[str, List[int]] = {}
        orphans: List[int] = []
        for i, rkey in enumerate(rkeys):
            node = self.owner(rkey)
            if node is None:
                orphans.append(i)
            else:
                per.setdefault(node.name, []).append(i)
        return per, orphans

    async def max_value_bytes(self, default: int) -> int:
        """The largest value every primary accepts (``proto-max-bulk-len``; ``default`` where CONFIG
        is forbidden or the node is down): a bigger one gets the connection reset, not an error,
        which would look like a dead node to the breaker."""
        limits = []
        for node in self.primaries():
            try:
                reply = (await node.call([("CONFIG", "GET", "proto-max-bulk-len")]))[0]
                value = reply.get(b"proto-max-bulk-len") if isinstance(reply, dict) else reply[1]
                limits.append(int(value))  # type: ignore[arg-type]  # None or junk: TypeError, skipped
            except Exception:  # CONFIG forbidden or node down: keep the server default
                continue
        return min(limits) if limits else default

    def primaries(self) -> List[RemoteNode]:
        return [self.nodes[n] for n in dict.fromkeys(self._owners) if n]

    def breaker_states(self) -> Dict[str, str]:
        return {name: node.breaker.state for name, node in self.nodes.items()}

    def any_open(self) -> bool:
        return any(node.breaker.state != CLOSED for node in self.primaries())

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        for node in list(self.nodes.values()):
            await node.close()
        self.nodes.clear()


def is_moved(reply: Any) -> bool:
    """A reply saying the slot lives elsewhere now (or the cluster is reconfiguring)."""
    return isinstance(reply, (AskError, TryAgainError, ClusterDownError))


__all__ += ["is_moved", "OPEN", "HALF_OPEN", "CLOSED"]
