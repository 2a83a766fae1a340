"""``RemoteTier``: chunk records in a Valkey/Redis server or cluster shared by a fleet of hosts.

Primitives, and the thread each runs on:

- ``RemoteTier.open`` (classmethod, event loop): connects (one node, or the cluster's slot map from
  any seed), turns on eviction notifications on every primary, starts one notification listener per
  primary and the periodic listing (the backstop).
- ``put_many`` / ``get_many_into`` / ``delete_many`` / ``contains_many`` / ``list_keys`` /
  ``snapshot_keys`` / ``check`` / ``flush`` / ``close`` (async, event loop), ``statistics`` /
  ``subscribe_removals`` (sync, event loop). Counters, the set of known keys and the sequence are
  touched only on the event-loop thread.
- The tier's own ``ThreadPoolExecutor`` (``kvtier-remote-*``) runs the record codec (one hop per
  slice of a batch, ``tiers.codec_pool``; zstd and the checksum release the GIL). Network I/O is redis-py's asyncio
  client on the loop (``router.py``), except ``GET`` pipelines: kvtier's own reader
  (``getreader.py``) lands each raw record's payload straight in the caller's buffer.

Storage: one key per chunk, ``kvtier:<namespace>:<fingerprint tag>:<hex chunk key>``, holding
kvtier's checksummed record (``tiers/record_format.py``) - never a metadata key beside a data key, which an
eviction could split. The record's checksum is computed over the full namespaced key, so a value
copied from another namespace or fingerprint fails it (a miss, deleted, counted in ``corrupt``); a
record whose header names another fingerprint than the tier's is a miss too (``mismatched``,
deleted). Records are content-addressed and immutable: two hosts writing one key write the same
bytes, so there is no coherence protocol, only write-once/read-many sharded by key.

Failure model: every call is bounded by ``timeout_s`` per node (no client retries); a node that times
out or fails ``breaker_failures`` times in a row is skipped for ``breaker_reset_s`` (reads of its keys
are misses, writes to it fail at once), then one PING probes it. A put is all or nothing: when any
node fails, what landed on the others is deleted again before ``put_many`` raises.

Server-side removals reach subscribers as ``Removal`` records: evictions (and expiries) through
keyspace notifications (``notify-keyspace-events Ee``; node-local, so one subscription per primary),
deletes made through this tier at once, and keys found gone by the periodic listing (``external``:
another host's delete, a node restarted empty, a notification lost - pub/sub is at-most-once). Only
keys this instance knows of (it wrote, listed or read them) are reported, each once.

With ``watch_new_keys``, the same subscriptions carry ``__keyevent@0__:new`` (flag ``n``): each
record another writer adds to this namespace reaches ``subscribe_arrivals`` callbacks on the loop,
in the node's order with its evictions, so a reader indexes it without listing the namespace
(a listing is O(keys); the notices are O(writes)). A notice lost while a subscription was down
costs hits until the backstop listing, which the re-subscription wakes, hands the keys it finds
unannounced over the same way; never a wrong hit: a notice is sent once the record is written whole.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from redis.exceptions import OutOfMemoryError

from kvtier.errors import ClosedError, CorruptRecordError, TierFullError, TierIOError, TierTimeoutError

from ..base import (
    ChunkMeta,
    ChunkTier,
    GetItem,
    KeySnapshot,
    PutAbortedError,
    PutItem,
    Removal,
    StartedPut,
    TierStatistics,
    check_key,
    wait_for_gate,
)
from ..owned_tasks import OwnedTasks, wait_through_cancel
from ..record_format import CodecConfig
from .coding import CodecThreads, Mismatch, decode_records, encode_records
from .counters import RemoteCounters
from .fanout import Fanout
from .getreader import DirectValue, LiveReads, fetched_size
from .keyspace import Keyspace
from .listing import Listing
from .notify import EvictionListener
from .router import NodeRouter, RemoteNode
from .url import RemoteAddress, parse_remote_url

__all__ = ["RemoteTier", "PutAbortedError"]

logger = logging.getLogger("kvtier.tiers.remote")

_TOUCHES_IN_FLIGHT = 4  # touch_many batches running at once; more are skipped (a hint)
_DEFAULT_MAX_VALUE_BYTES = 512 << 20  # the server default of proto-max-bulk-len
_NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_INLINE_DECODE_BYTES = 256 << 10


class RemoteTier(ChunkTier):
    """Chunk records on a Valkey/Redis node or cluster; see the module docstring.

    Build with ``await RemoteTier.open("redis://127.0.0.1:6379", namespace=..., fingerprint=...)``
    or ``"redis+cluster://h1:p1,h2:p2"``. Event-loop thread only: every method is called on the
    loop it was opened on. It wires its parts (each event-loop only): ``Keyspace`` (names, known
    keys, sequence, removals), ``NodeRouter`` and ``Fanout`` (nodes, per-node pipelines),
    ``RemoteCounters`` (counters, statistics),
    ``EvictionListener`` and ``Listing`` (removals seen on the server), ``CodecThreads`` (the
    record codec's own threads).
    """

    name = "remote"

    def __init__(self, address: RemoteAddress, *, namespace: str, fingerprint: Optional[bytes],
                 codec: CodecConfig, timeout_s: float, connect_timeout_s: float, concurrency: int,
                 pipeline_max_bytes: int, breaker_failures: int, breaker_reset_s: float,
                 listing_interval_s: Optional[float], configure_notifications: bool,
                 io_threads: int, direct_get: bool = True, watch_new_keys: bool = False) -> None:
        self.address = address
        self.namespace = namespace
        self._direct_get = direct_get
        self._fingerprint = fingerprint
        self._codec = codec
        self._keys = Keyspace(namespace, fingerprint)
        self._router = NodeRouter(
            address, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
            concurrency=concurrency, breaker_failures=breaker_failures, breaker_reset_s=breaker_reset_s,
        )
        self._coding = CodecThreads(io_threads)
        self._loop = asyncio.get_running_loop()
        self._tasks = OwnedTasks()
        self._closed = False
        self._write_failed = False  # a put failed underneath; cleared by the next put that lands
        self._max_value_bytes = _DEFAULT_MAX_VALUE_BYTES
        self._counters = RemoteCounters()
        self._stats, self._extra = self._counters.stats, self._counters.extra
        self._fanout = Fanout(self._router, pipeline_max_bytes, self._extra)
        wakeup = asyncio.Event()
        self._arrivals: List[Callable[[List[bytes], int], None]] = []
        self._touching = 0  # touch_many pipelines running
        self._listener = EvictionListener(
            self._router, configure=configure_notifications, on_keys=self._on_evicted, on_gap=wakeup.set,
            on_new=self._on_new if watch_new_keys else None,
        )
        self._listing = Listing(
            self._router, self._listener, self._keys, self._counters, interval_s=listing_interval_s,
            wakeup=wakeup, closed=lambda: self._closed,
            on_new=(lambda keys: self._arrived(keys, "arrivals_listed")) if watch_new_keys else None,
        )

    # ------------------------------------------------------------------------------ construction

    @classmethod
    async def open(
        cls,
        url: Union[str, RemoteAddress],
        *,
        namespace: str = "default",
        fingerprint: Optional[bytes] = None,
        codec: Optional[CodecConfig] = None,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        concurrency: int = 8,
        pipeline_max_bytes: int = 8 << 20,
        breaker_failures: int = 3,
        breaker_reset_s: float = 5.0,
        listing_interval_s: Optional[float] = 30.0,
        configure_notifications: bool = True,
        io_threads: int = 2,
        require_connection: bool = True,
        direct_get: bool = True,
        watch_new_keys: bool = False,
    ) -> "RemoteTier":
        """Connect and start the eviction listeners. ``TierIOError`` when no node answers.

        ``namespace`` separates caches sharing one server (``[A-Za-z0-9._-]{1,64}``);
        ``fingerprint`` (the model layout fingerprint) binds every key and record to one model.
        ``timeout_s`` bounds each node call (socket timeout; the whole pipeline gets twice that);
        ``concurrency`` is the most pipelines in flight per node (= its connection pool);
        ``pipeline_max_bytes`` caps one pipeline (measured: a pipeline is copied into one buffer);
        ``breaker_failures`` / ``breaker_reset_s`` tune the circuit breaker; ``listing_interval_s``
        is the backstop listing period (``None``: off); ``configure_notifications`` lets the tier
        add ``Ee`` to ``notify-keyspace-events`` on each primary (a managed server that forbids
        CONFIG leaves only the listing). ``require_connection``: raise ``TierIOError`` when no node
        answers (the default); ``False`` starts degraded and heals when the server comes back.
        ``direct_get``: read ``GET`` replies with kvtier's own reader, which lands each raw
        record's payload straight in the caller's buffer (``getreader.py``; the default);
        ``False`` reads them through redis-py's client like every other command.
        ``watch_new_keys``: also subscribe to the primaries' new-key notices and hand this
        namespace's new keys to ``subscribe_arrivals`` callbacks (module docstring).

        Cancelling it: nothing is left running; no tier is returned.
        """
        address = url if isinstance(url, RemoteAddress) else parse_remote_url(url)
        if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
            raise ValueError(f"namespace must match [A-Za-z0-9._-]{{1,64}}, got {namespace!r}")
        if fingerprint is not None and not isinstance(fingerprint, bytes):
            raise TypeError(f"fingerprint must be bytes or None, not {type(fingerprint).__name__}")
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s),
                            ("breaker_reset_s", breaker_reset_s)):
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if listing_interval_s is not None and not listing_interval_s > 0:
            raise ValueError(f"listing_interval_s must be positive or None, got {listing_interval_s!r}")
        for name, value, low in (("concurrency", concurrency, 1), ("pipeline_max_bytes", pipeline_max_bytes, 1),
                                 ("breaker_failures", breaker_failures, 1), ("io_threads", io_threads, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self = cls(
            address, namespace=namespace, fingerprint=fingerprint,
            codec=codec if codec is not None else CodecConfig(), timeout_s=float(timeout_s),
            connect_timeout_s=float(connect_timeout_s), concurrency=concurrency,
            pipeline_max_bytes=pipeline_max_bytes, breaker_failures=breaker_failures,
            breaker_reset_s=float(breaker_reset_s), listing_interval_s=listing_interval_s,
            configure_notifications=configure_notifications, io_threads=io_threads,
            direct_get=direct_get, watch_new_keys=watch_new_keys,
        )
        try:
            try:
                await self._router.start()
            except TierIOError as exc:
                if require_connection:
                    raise
                # A fleet member starting while the remote is down serves from its own tiers; the
                # breaker probes (one node) or the listing's slot refresh (cluster) heal it later.
                logger.warning("remote tier %s unreachable at start, running degraded: %s", address.url, exc)
                self._router.start_unreachable()
            await self._listener.sync()
            self._max_value_bytes = await self._router.max_value_bytes(_DEFAULT_MAX_VALUE_BYTES)
        except BaseException:
            await self._shutdown()
            raise
        self._listing.start()
        return self

    # --------------------------------------------------------------------------------- helpers

    def rkey(self, key: bytes) -> bytes:
        """The server-side name of ``key``'s record (tests plant and inspect with it)."""
        self._check_key(key)
        return self._keys.rkey(key)

    def set_call_hook(self, hook: Optional[Callable[[RemoteNode, Sequence[Tuple[Any, ...]]], None]]) -> None:
        """Fault injection: ``hook(node, commands)`` runs right before each pipeline is sent to
        ``node`` (``node.name`` is ``host:port``; ``commands`` are tuples like ``("SET", name,
        value)``). A ``redis.exceptions.ConnectionError`` or ``OSError`` it raises is, to the tier,
        that pipeline's connection failing."""
        self._router.set_hook(hook)

    _check_key = staticmethod(check_key)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"remote tier at {self.address.url} is closed")

    # ---------------------------------------------------------------------------- public, sync

    @property
    def sequence(self) -> int:
        """The last mutation sequence this instance assigned (puts, deletes, removals seen)."""
        return self._keys.sequence

    @property
    def degraded(self) -> bool:
        """True while any primary's circuit breaker is not closed, or after a put failed
        underneath (not for a full server) until a later put lands."""
        return self._write_failed or self._router.any_open()

    @property
    def capacity_bytes(self) -> Optional[int]:
        return None  # the server's maxmemory is the server's business

    def subscribe_removals(self, callback: Callable[[Sequence[Removal]], None]) -> None:
        """``callback(removals)`` for every record of this namespace that stops being readable and
        this instance knew of: ``evicted`` (server eviction or expiry, from notifications),
        ``deleted`` (``delete_many``, or a put's rollback over an older copy), ``quarantined``
        (corrupt or foreign value found by a read), ``external`` (found gone by the listing). It
        runs on the loop that was running when this was called (handed over with
        ``call_soon_threadsafe``)."""
        self._keys.feed.subscribe(callback)

    def statistics(self) -> TierStatistics:
        """Counters of this instance (items, not batches, unless named so). ``records`` / ``bytes``
        are the keys this instance knows to be on the server and the record bytes it wrote of them
        (the server holds the fleet's records; its own memory is in ``INFO memory``). ``extra``:
        put/get bytes moved, latency totals and maxima (seconds per batch), timeouts, full (stores
        refused for memory), breaker_rejected (items skipped while a breaker was open),
        breaker_open (primaries whose breaker is not closed), breaker_opens, evictions_notified,
        removals_listed, listings, listener_restarts, rollbacks, moved, nodes, get_direct (values
        whose payload the reader placed straight in the caller's buffer)."""
        return self._counters.statistics(self._keys, self._router, self._listener, self.degraded)

    # ---------------------------------------------------------------------------------- puts

    async def put_many(self, items: Sequence[PutItem]) -> int:
        """Encode and store a batch; returns the sequence that made it visible. All or nothing: if
        any node fails, the records that landed on other nodes are deleted again before the error
        is raised (a record that survives a failed rollback is still a valid record of its key:
        content-addressed, so never wrong, only not counted as stored). ``TierFullError`` when a
        server is out of memory (``noeviction``), ``TierTimeoutError`` when a node did not answer
        in time, ``TierIOError`` for other failures (circuit open, connection lost). Duplicate keys:
        the last one wins. Empty batch: returns the current sequence.

        Cancelling it: the batch runs on as a tier task and still lands all or nothing; the call
        returns (re-raising ``CancelledError``) only once the encoder has finished reading the
        caller's buffers, so they may be reused at once.
        """
        if not items:
            self._check_open()
            return self._keys.sequence
        encoded, task = self.start_put(items)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await wait_through_cancel(encoded)
            raise

    def start_put(self, items: Sequence[PutItem], *, after: Optional["asyncio.Future[Any]"] = None
                  ) -> StartedPut:
        """Start ``put_many``'s work without waiting for it: returns a future done once the caller's
        buffers have been read (encoded), and the tier task that lands the batch (its result is the
        sequence, its exception the failure). With ``after``, nothing is sent before that future
        has succeeded; if it fails, the batch is dropped (``PutAbortedError``). The chained tier
        writes behind with it: encoding overlaps the first tier's put, sending follows its end
        (the chain opens the gate on a tier failure too, so the batch still lands here). Arguments are checked here, before anything
        starts."""
        self._check_open()
        batch: Dict[bytes, Tuple[bytes, ChunkMeta, memoryview]] = {}
        for key, meta, raw in items:
            self._check_key(key)
            if not isinstance(meta, ChunkMeta):
                raise TypeError(f"expected ChunkMeta, not {type(meta).__name__}")
            batch.pop(key, None)
            batch[key] = (key, meta, raw if isinstance(raw, memoryview) else memoryview(raw))
        encoded: "asyncio.Future[None]" = self._loop.create_future()
        if not batch:
            encoded.set_result(None)
        keys = list(batch)
        self._keys.start_writing(keys)
        task = self._tasks.spawn(self._put_batch(list(batch.values()), encoded, after))
        task.add_done_callback(lambda _: self._keys.done_writing(keys))
        return encoded, task

    async def _put_batch(self, batch: List[Tuple[bytes, ChunkMeta, memoryview]],
                         encoded: "asyncio.Future[None]", after: Optional["asyncio.Future[Any]"] = None) -> int:
        if not batch:
            return self._keys.sequence
        started = time.perf_counter()
        rkeys = self._keys.rkeys(key for key, _, _ in batch)
        codec = self._codec
        try:
            records: List[bytes] = await self._coding.run(
                lambda part: encode_records(part, codec),
                list(zip(rkeys, batch)), [raw.nbytes for _, _, raw in batch], 0,
            )
        finally:
            if not encoded.done():
                encoded.set_result(None)
        await wait_for_gate(after, f"remote tier: store of {len(batch)} records")  # failed: send nothing
        sizes = [len(r) for r in records]
        if max(sizes) > self._max_value_bytes:
            self._stats["errors"] += 1
            self._extra["full"] += len(batch)
            raise TierFullError(
                f"remote tier: a record of {max(sizes)} bytes exceeds the server's proto-max-bulk-len "
                f"of {self._max_value_bytes} bytes; nothing of the batch was sent"
            )
        replies, failures = await self._fanout.calls(rkeys, sizes, lambda i: ("SET", rkeys[i], records[i]))
        stored = [i for i, r in enumerate(replies) if r is True or r == b"OK"]
        if len(stored) != len(batch):
            full = any(isinstance(r, OutOfMemoryError) for r in replies)
            await self._rollback([rkeys[i] for i in stored], [batch[i][0] for i in stored])
            self._stats["errors"] += 1
            self._write_failed = not full
            if full:
                self._extra["full"] += len(batch)
                raise TierFullError(
                    f"remote tier: server out of memory for {len(batch)} records "
                    f"({sum(sizes)} bytes; maxmemory with noeviction?)"
                )
            timeouts = [f for f in failures if isinstance(f, TierTimeoutError)]
            first = timeouts[0] if timeouts else (failures[0] if failures else None)
            if first is None:
                bad = next((r for r in replies if isinstance(r, BaseException)), None)
                raise TierIOError(f"remote tier: {len(batch) - len(stored)} of {len(batch)} stores failed: "
                                  f"{type(bad).__name__}: {bad}") from bad
            raise type(first)(f"remote tier: store of {len(batch)} records failed: {first}") from first
        self._write_failed = False
        seq = self._keys.next_sequence()
        for (key, _, _), size in zip(batch, sizes):
            self._keys.remember(key, seq, size)
        # Evicted while the put was in flight: maybe this batch's copy, maybe an older one. Report
        # it after the put's sequence - at worst a lost hit, never a promise of a missing chunk.
        late = self._keys.evicted_during(key for key, _, _ in batch)
        if late:
            self._count_evictions(self._keys.removed(late, "evicted"))
        self._stats["puts"] += len(batch)
        self._stats["put_batches"] += 1
        self._counters.batch_done("put", sum(sizes), started)
        return seq

    async def _rollback(self, rkeys: List[bytes], keys: List[bytes]) -> None:
        """Delete the part of a failed batch that landed; best effort, bounded by the timeouts."""
        if not rkeys:
            return
        self._extra["rollbacks"] += 1
        _, failures = await self._fanout.each("DEL", rkeys)
        if failures:
            self._stats["errors"] += 1
            logger.warning("remote tier: rollback of %d records incomplete: %s", len(rkeys), failures[0])
        # A key this instance knew before the batch held an older copy, now deleted.
        self._keys.report(self._keys.removed(keys, "deleted"))

    # ---------------------------------------------------------------------------------- gets

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Fetch and decode each record into its buffer (exactly the chunk's raw size). Per item
        the record's ``ChunkMeta`` or ``None`` on a miss: absent, its node unavailable or failing
        (counted in ``errors``; never raised: a remote failure is never worse than recomputing),
        corrupt or copied from another namespace (deleted, ``corrupt``, reported ``quarantined``),
        written for another fingerprint (deleted, ``mismatched``, reported ``quarantined``), or of
        another raw size than the buffer (``mismatched``, left in place).

        Cancelling it: while the values are still on the network, the connections reading them
        (straight into the buffers) are aborted and the call ends at once; once decoding into the buffers has begun, the call returns (re-raising
        ``CancelledError``) only after it has finished, so the buffers are free when it ends.
        """
        self._check_open()
        checked: List[Tuple[bytes, memoryview]] = []
        for key, buf in items:
            self._check_key(key)
            view = buf if isinstance(buf, memoryview) else memoryview(buf)
            if view.readonly or not view.c_contiguous:
                raise TypeError("get_many_into needs writable, C-contiguous buffers")
            checked.append((key, view.cast("B") if view.format != "B" or view.ndim != 1 else view))
        self._stats["gets"] += len(checked)
        if not checked:
            return []
        state: Dict[str, Any] = {"phase": "fetching", "live": LiveReads()}
        decoded: "asyncio.Future[None]" = self._loop.create_future()
        task = self._tasks.spawn(self._get_batch(checked, state, decoded))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if state["phase"] == "fetching":
                state["phase"] = "abandoned"  # the task sees it before it decodes into any buffer
                state["live"].abandon()  # values arriving straight into the buffers: stop them now
                raise
            await wait_through_cancel(decoded)
            raise

    async def _get_batch(self, checked: List[Tuple[bytes, memoryview]], state: Dict[str, Any],
                         decoded: "asyncio.Future[None]") -> List[Optional[ChunkMeta]]:
        started = time.perf_counter()
        results: List[Optional[ChunkMeta]] = [None] * len(checked)
        try:
            rkeys = self._keys.rkeys(key for key, _ in checked)
            send = None
            if self._direct_get:
                send = lambda node, part: node.get_into(  # noqa: E731
                    [rkeys[i] for i in part], [checked[i][1] for i in part], state["live"])
            replies, failures = await self._fanout.calls(
                rkeys, [buf.nbytes for _, buf in checked], lambda i: ("GET", rkeys[i]), send
            )
            if state["phase"] == "abandoned":
                self._stats["misses"] += len(checked)
                return results
            if failures:
                self._stats["errors"] += len(failures)
            state["phase"] = "decoding"
            found = [(i, r) for i, r in enumerate(replies) if isinstance(r, (bytes, bytearray, DirectValue))]
            self._extra["get_direct"] += sum(1 for _, r in found if isinstance(r, DirectValue))
            jobs = [(rkeys[i], data, checked[i][1]) for i, data in found]
            fingerprint = self._fingerprint

            outcomes = await self._coding.run(lambda part: decode_records(part, fingerprint), jobs,
                                              [b.nbytes for _, _, b in jobs], _INLINE_DECODE_BYTES)
        finally:
            if not decoded.done():
                decoded.set_result(None)
        bad: List[bytes] = []
        bad_keys: List[bytes] = []
        got = 0
        for (i, data), outcome in zip(found, outcomes):
            key = checked[i][0]
            if isinstance(outcome, CorruptRecordError):
                self._stats["corrupt"] += 1
                bad.append(rkeys[i])
                bad_keys.append(key)
            elif isinstance(outcome, Mismatch):
                self._stats["mismatched"] += 1
                if outcome.foreign:
                    bad.append(rkeys[i])
                    bad_keys.append(key)
            else:
                size = fetched_size(data, checked[i][1])
                results[i] = outcome
                got += size
                self._keys.remember_new([key], self._keys.sequence, size)
        if bad:
            await self._quarantine(list(dict.fromkeys(bad)), list(dict.fromkeys(bad_keys)))
        hits = sum(1 for r in results if r is not None)
        self._stats["hits"] += hits
        self._stats["misses"] += len(checked) - hits
        self._extra["get_batches"] += 1
        self._counters.batch_done("get", got, started)
        return results

    async def _quarantine(self, rkeys: List[bytes], keys: List[bytes]) -> None:
        """Delete values that must never be served again. Nothing to move them to on a shared
        server: kvtier keeps no copy of another host's bad bytes."""
        _, failures = await self._fanout.each("DEL", rkeys)
        if failures:
            self._stats["errors"] += 1
        self._stats["quarantined"] += len(keys)
        self._keys.know(keys)  # reported even if unknown before (``Keyspace.know``)
        self._keys.report(self._keys.removed(keys, "quarantined"))

    # ------------------------------------------------------------------------- other requests

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete records; returns how many existed. Each deleted key this instance knew is
        reported (``deleted``). ``TierIOError`` when a node failed (the other nodes' deletes
        stand). Cancelling it: the deletes run on as a tier task."""
        self._check_open()
        for key in keys:
            self._check_key(key)
        unique = list(dict.fromkeys(keys))
        if not unique:
            return 0
        return await asyncio.shield(self._tasks.spawn(self._delete(unique)))

    async def _delete(self, keys: List[bytes]) -> int:
        replies, failures = await self._fanout.each("DEL", self._keys.rkeys(keys))
        gone = [keys[i] for i, r in enumerate(replies) if r == 1]
        self._stats["deletes"] += len(gone)
        self._keys.know(gone)
        self._keys.report(self._keys.removed(gone, "deleted"))
        if failures:
            self._stats["errors"] += 1
            raise TierIOError(f"remote tier: delete failed on a node: {failures[0]}") from failures[0]
        return len(gone)

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """Which keys have a value on the server (``EXISTS``, no checksum). A key whose node is
        unavailable is ``False``. Cancelling it: no effect."""
        self._check_open()
        for key in keys:
            self._check_key(key)
        if not keys:
            return []
        replies, failures = await self._fanout.each("EXISTS", self._keys.rkeys(keys))
        if failures:
            self._stats["errors"] += 1
        return [r == 1 for r in replies]

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """``keys`` were just used from a copy above this tier (a host's slab or LMDB): a ``TOUCH``
        of them (in the background, one pipeline per node) moves those the server holds to the
        young end of its LRU, as a GET would, so a chunk hot on one host does not age out of the
        shared server and miss on every other host (``ChunkTier.touch_many``). A recency hint:
        never raises, skipped (counted in ``touches_skipped``) while ``_TOUCHES_IN_FLIGHT`` are
        still running or once closed; ``flush`` waits for the ones running."""
        if self._closed or not keys:
            return
        if self._touching >= _TOUCHES_IN_FLIGHT:
            self._extra["touches_skipped"] += len(keys)
            return
        try:
            rkeys = self._keys.rkeys(check_key(k) for k in keys)
        except (ValueError, TypeError):
            return
        self._touching += 1
        self._tasks.spawn(self._touch(rkeys))

    async def _touch(self, rkeys: List[bytes]) -> None:
        try:
            _, failures = await self._fanout.each("TOUCH", rkeys)
            self._extra["touches"] += len(rkeys)
            if failures:
                self._stats["errors"] += 1
        except Exception as exc:  # a hint: a failed touch costs recency, nothing else
            logger.debug("remote tier: touch failed: %r", exc)
        finally:
            self._touching -= 1

    async def list_keys(self) -> List[bytes]:
        """Every key of this namespace on the primaries reachable now (``SCAN``; a node that fails
        is skipped and counted in ``errors``: its records are unreadable anyway). Cancelling it:
        no effect beyond the listing stopping."""
        self._check_open()
        found, _ = await self._listing.scan()
        self._keys.remember_new(found, self._keys.sequence)
        return list(found)

    async def snapshot_keys(self) -> KeySnapshot:
        """Keys and the sequence they reflect (every removal reported up to it)."""
        seq = self._keys.sequence
        return KeySnapshot(frozenset(await self.list_keys()), seq)

    async def flush(self) -> None:
        """Wait for batches in flight (puts are synchronous to their callers; nothing is queued).
        Cancelling it: only the wait stops."""
        await self._tasks.wait_all()

    async def sync_removals(self) -> None:
        """Wait until the eviction and delete notices each primary sent before the call reached this
        tier and were reported (``EvictionListener.barrier``; a primary whose subscription is down
        is left to the listing). Cancelling it stops the wait only."""
        self._check_open()
        await self._listener.barrier()

    async def check(self) -> List[str]:
        """Problems seen now: primaries not answering, breakers open, cluster state, notifications
        off. Empty when healthy. Cancelling it: no effect."""
        self._check_open()
        problems: List[str] = []
        for node in self._router.primaries():
            problem = await node.problem(self.address.cluster)
            if problem is not None:
                problems.append(problem)
            if not self._listener.enabled.get(node.name, False):
                problems.append(f"node {node.name}: eviction notifications off (listing only)")
        return problems

    async def close(self) -> None:
        """Wait for batches in flight, stop listeners and the listing, close connections. Safe to
        call twice; later calls raise ``ClosedError``. Cancelling it: the tier stays closed; a
        second ``close`` finishes the release."""
        self._closed = True
        await self.flush()
        await self._shutdown()

    async def _shutdown(self) -> None:
        self._closed = True
        await self._listing.close()
        await self._listener.close()
        await self._router.close()
        self._coding.shutdown()

    # --------------------------------------------------------------- evictions: notifications

    def _on_evicted(self, names: List[bytes]) -> None:
        self._count_evictions(self._keys.removed(self._keys.evicted(names), "evicted"))

    def _count_evictions(self, removals: List[Removal]) -> None:
        self._stats["evictions"] += len(removals)
        self._extra["evictions_notified"] += len(removals)
        self._keys.report(removals)

    def subscribe_arrivals(self, callback: Callable[[List[bytes], int], None]) -> None:
        """``callback(keys, sequence)`` on the loop for each burst of this namespace's keys that a
        writer (another host, or this one) made readable, at this tier's ``sequence`` (a removal
        reported later has a later one). Only with ``watch_new_keys``; otherwise never called."""
        self._arrivals.append(callback)

    def _on_new(self, names: List[bytes]) -> None:
        self._arrived([k for k in (self._keys.chunk_key(name) for name in names) if k is not None],
                      "arrivals_notified")

    def _arrived(self, keys: List[bytes], counter: str) -> None:
        """New keys of this namespace, from a notice or found by the backstop listing (a notice
        lost while a subscription was down): known from now on, handed to the subscribers."""
        if not keys or self._closed:
            return
        seq = self._keys.next_sequence()
        self._keys.remember_new(keys, seq)  # known, so its eviction is reported
        self._extra[counter] += len(keys)
        for callback in list(self._arrivals):
            try:
                callback(keys, seq)
            except Exception:
                logger.exception("remote tier: an arrivals callback failed")

    # ----------------------------------------------------------------- evictions: the listing

    async def reconcile(self) -> int:
        """One round of the backstop listing (``Listing.reconcile``): refresh the slot map,
        (re)start listeners for new primaries, list every primary, and report each known key that
        is gone (``external``) - but only keys last seen before the listing began, on primaries
        that listed fine. Returns how many were reported. Cancelling it: nothing is reported."""
        self._check_open()
        return await self._listing.reconcile()
