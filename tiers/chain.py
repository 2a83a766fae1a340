"""``ChainedTier``: an ordered list of tiers (LMDB, then the remote tier) behind one ``ChunkTier``.

The engine takes it as its disk tier, so host -> LMDB -> remote needs no change in the engine:

- ``put_many`` lands in the first tier (durably, as before) and writes behind to the lower tiers:
  ``write_through`` starts the lower tiers' stores at once (the call waits only until they have
  encoded the caller's buffers, never for the network); ``write_back_on_evict`` copies a record down
  only when the first tier nears its capacity (``writeback_fill_fraction`` of ``capacity_bytes``),
  oldest first, read back from the first tier - a victim cache. A lower tier's failure never fails
  the put: it is counted (``writebehind_failed``) and the chunk stays where it landed. A first
  tier's failure (full, I/O errors) does not keep the batch from the lower tiers: the put waits
  for them and succeeds when one holds all of it (``kept_below``), so the bytes, still on the
  host, are not lost to the fleet; it raises only when no tier took it.
- A new-key notice of a lower tier (a shared remote: another host wrote the chunk) reaches
  ``subscribe_arrivals`` with the chain's sequence, and every hit is a use the tiers below it
  hear of (``touch_many``): a chunk served from LMDB must not age out of the shared remote.
- ``get_many_into`` asks the tiers in order for what is still missing; a hit in a lower tier is
  promoted into the first tier (a copy of the bytes is written in the background, so the call does
  not wait for the first tier's sync). An error of any tier is a miss there, never an error: a remote
  that is down is never worse than recomputing.
- ``contains_many`` / ``list_keys`` see every tier, so chunks only the remote holds (written by
  another host) are hits.
- Removals: a tier's removal is reported by the chain only when no tier holds the key any more
  (checked with ``contains_many`` on the others), with the chain's own sequence taken before that
  check, so a put begun meanwhile (a later sequence) wins, as the contract orders.
- Sequences: a put's sequence is taken when the call starts, before any tier is fed, so every
  removal the chain reports after that point has a later sequence and wins over the put (the first
  tier may evict the key before the call returns: the put must not then win). At worst that costs a
  hit (the removal was of an older record); it never promises a key no tier holds. A snapshot's
  sequence stays below every put still in flight.
- Background work (write-behind, promotions, removal checks) is owned by the chain: ``flush`` and
  ``close`` wait for it without cancelling it, so a cancelled caller never loses a removal report.

Everything runs on the event-loop thread; the tiers do their own blocking work. The chain owns its
tiers: ``close`` closes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar

from kvtier.errors import ClosedError, KvtierError

from .base import (
    ChunkMeta,
    ChunkTier,
    GetItem,
    KeySnapshot,
    PutAbortedError,
    PutItem,
    Removal,
    RemovalFeed,
    TierStatistics,
    check_key,
)
from .owned_tasks import OwnedTasks, wait_through_cancel

__all__ = ["ChainedTier", "WRITE_POLICIES", "read_with_sources", "tier_statistics_dict"]

logger = logging.getLogger("kvtier.tiers.chain")

_Answer = TypeVar("_Answer")

WRITE_POLICIES = ("write_through", "write_back_on_evict")
# Background copies (write-behind, promotions) in flight at once; past it a copy is skipped and
# counted: the first tier holds the chunk already, so skipping costs a remote hit, not data.
_MAX_BACKGROUND = 64


def _settle(gate: "asyncio.Future[None]", primary: "asyncio.Future[Any]") -> None:
    """Open ``gate`` once the first tier's put has ended: on its success, and on a tier failure
    too (full, I/O errors: the lower tiers still get the bytes); closed for good (the lower stores
    dropped) when it was cancelled or refused the batch itself (a caller's mistake)."""
    if gate.done():
        return
    if primary.cancelled():
        gate.cancel()
    elif (exc := primary.exception()) is not None and (
            isinstance(exc, ClosedError) or not isinstance(exc, (KvtierError, OSError))):
        gate.set_exception(exc)
    else:
        gate.set_result(None)


def tier_statistics_dict(tier: ChunkTier) -> Dict[str, float]:
    """A tier's statistics (``TierStatistics``) as flat floats."""
    return dict(tier.statistics().as_dict())


async def read_with_sources(tier: ChunkTier, items: Sequence[GetItem]) -> Tuple[List[Optional[ChunkMeta]], List[Optional[int]]]:
    """``tier.get_many_into(items)``, plus per item the index of the chained tier that served it
    (0 for a plain tier; ``None``: a miss), for per-tier hit metrics. Cancelling it: as the read's."""
    if isinstance(tier, ChainedTier):
        return await tier.get_many_into_sources(items)
    metas = await tier.get_many_into(items)
    return metas, [None if m is None else 0 for m in metas]


class ChainedTier(ChunkTier):
    """``tiers[0]`` is the first (local, durable) tier; the rest are written behind and read through.

    ``write_policy``: ``"write_through"`` or ``"write_back_on_evict"`` (see the module docstring);
    ``promote``: copy lower-tier hits into the first tier.
    """

    name = "chain"

    def __init__(self, tiers: Sequence[ChunkTier], *, write_policy: str = "write_through",
                 promote: bool = True, writeback_fill_fraction: float = 0.9) -> None:
        if len(tiers) < 1:
            raise ValueError("ChainedTier needs at least one tier")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        if not 0.0 < writeback_fill_fraction <= 1.0:
            raise ValueError(f"writeback_fill_fraction must be in (0, 1], got {writeback_fill_fraction!r}")
        self.tiers: Tuple[ChunkTier, ...] = tuple(tiers)
        self.name = "+".join(t.name for t in self.tiers)
        self.write_policy = write_policy
        self.promote = promote
        self._fill = writeback_fill_fraction
        self._loop = asyncio.get_running_loop()
        self._sequence = 0
        self._removal_feed = RemovalFeed()
        self._background = OwnedTasks()
        self._puts_in_flight: Set[int] = set()  # sequences of puts that have not returned yet
        self._closing: Optional["asyncio.Task[None]"] = None
        self._closed = False
        # write_back_on_evict: keys in the first tier not copied down yet, oldest first.
        self._dirty: "OrderedDict[bytes, Tuple[ChunkMeta, int]]" = OrderedDict()
        self._writeback_running = False
        self._stats: Dict[str, int] = dict(
            puts=0, put_batches=0, gets=0, hits=0, misses=0, evictions=0, deletes=0, errors=0,
        )
        self._extra: Dict[str, float] = dict(
            writebehind_batches=0, writebehind_chunks=0, writebehind_failed=0, writebehind_skipped=0,
            promotions=0, promotions_failed=0, promotions_skipped=0, writeback_lost=0,
            removals_held=0, kept_below=0,
        )
        self._hits_per_tier = [0] * len(self.tiers)
        self._arrivals: List[Callable[[List[bytes], int], None]] = []
        for index, tier in enumerate(self.tiers):
            tier.subscribe_removals(self._removal_callback(index))
            tier.subscribe_arrivals(self._on_tier_arrived)

    # ------------------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"chained tier {self.name} is closed")

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    def _spawn_background(self, coro: Any, counter: str) -> bool:
        if len(self._background) >= _MAX_BACKGROUND or self._closed:
            coro.close()
            self._extra[counter] += 1
            return False
        self._background.spawn(coro).add_done_callback(self._background_done)
        return True

    def _background_done(self, task: "asyncio.Task[Any]") -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("chained tier background task failed: %r", task.exception())

    def _removal_callback(self, index: int) -> Callable[[Sequence[Removal]], None]:
        loop = self._loop

        def on_removed(removed: Sequence[Removal]) -> None:
            # A tier calls on the loop that subscribed, or (subscribed outside a loop) on its own
            # thread: hop to the chain's loop either way.
            keys = [r.key for r in removed]
            reasons = [r.reason for r in removed]
            try:
                loop.call_soon_threadsafe(self._on_tier_removed, index, keys, reasons)
            except RuntimeError:
                pass  # loop closed: nobody is listening any more

        return on_removed

    def _on_tier_removed(self, index: int, keys: List[bytes], reasons: List[str]) -> None:
        if self._closed or not keys:
            return
        for key in keys:
            if index == 0 and key in self._dirty:
                del self._dirty[key]
                self._extra["writeback_lost"] += 1
        seq = self._next_sequence()  # taken before the check: a put begun meanwhile wins
        # Never skipped (unlike copies): a removal the engine never hears of breaks "exactly once".
        self._background.spawn(self._confirm_removed(index, keys, reasons, seq)).add_done_callback(self._background_done)

    async def _confirm_removed(self, index: int, keys: List[bytes], reasons: List[str], seq: int) -> None:
        held = [False] * len(keys)
        for other, tier in enumerate(self.tiers):
            if other == index:
                continue
            try:
                present = await tier.contains_many(keys)
            except Exception:
                # A tier that cannot answer counts as not holding the key: reporting it gone costs
                # at most a lost hit, while keeping it would promise a chunk nobody can read.
                continue
            held = [h or p for h, p in zip(held, present)]
        removals = [Removal(k, seq, r) for k, r, h in zip(keys, reasons, held) if not h]
        self._extra["removals_held"] += sum(held)
        if removals:
            self._stats["evictions"] += len(removals)
            self._removal_feed.publish(removals)

    # --------------------------------------------------------------------------- contract

    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def degraded(self) -> bool:
        return any(t.degraded for t in self.tiers)

    @property
    def capacity_bytes(self) -> Optional[int]:
        return self.tiers[0].capacity_bytes

    def subscribe_removals(self, callback: Callable[[Sequence[Removal]], None]) -> None:
        """``callback(removals)`` when a key is gone from every tier; on the loop running now."""
        self._removal_feed.subscribe(callback)

    def subscribe_arrivals(self, callback: Callable[[List[bytes], int], None]) -> None:
        """``callback(keys, sequence)`` when a tier reports keys another writer made readable
        there (a shared remote's new-key notices), and when a promotion into the first tier has
        landed, at the chain's sequence: taken on arrival, so a removal the chain reports later
        (a tier's report comes after the arrival) wins."""
        self._arrivals.append(callback)

    def _on_tier_arrived(self, keys: List[bytes], _sequence: int) -> None:
        if self._closed or not keys:
            return
        seq = self._next_sequence()
        for callback in list(self._arrivals):
            try:
                callback(keys, seq)
            except Exception:
                logger.exception("chained tier: an arrivals callback failed")

    async def put_many(self, items: Sequence[PutItem]) -> int:
        """Store in the first tier (durable when it returns, all or nothing) and write behind to the
        lower tiers (their failures are counted, never raised). When the first tier fails (full,
        I/O errors), the lower tiers still store the batch and the call waits for them: it returns
        when one of them holds all of it (readable from the chain; counted in ``kept_below``),
        else it raises the first tier's error as it is. Returns the chain's sequence for the
        batch, taken when the call began: every removal the chain reports after that has a later one.

        Cancelling it: the first tier's put and the lower tiers' stores run on as they do for those
        tiers; the call returns (re-raising ``CancelledError``) only once every tier has finished
        reading the caller's buffers."""
        self._check_open()
        items = list(items)
        for key, _, _ in items:
            check_key(key)  # before any tier starts: a refused batch starts nothing anywhere
        if not items:
            return self._sequence
        # Taken before any tier sees the batch: a removal the chain reports from now on (the first
        # tier evicting one of these keys before this call returns) has a later sequence and wins.
        seq = self._next_sequence()
        self._puts_in_flight.add(seq)
        try:
            await self._put_all(items)
        finally:
            self._puts_in_flight.discard(seq)
        self._stats["puts"] += len(items)
        self._stats["put_batches"] += 1
        if self.write_policy == "write_back_on_evict" and len(self.tiers) > 1:
            for key, meta, raw in items:
                self._dirty.pop(key, None)
                self._dirty[key] = (meta, memoryview(raw).nbytes)
            self._maybe_write_back()
        return seq

    async def _put_all(self, items: List[PutItem]) -> None:
        """The first tier's put, and the lower tiers' stores started behind it (``put_many``)."""
        first = self.tiers[0]
        # Lower tiers encode while the first tier writes and send once it has ended (``_settle``):
        # a healthy put costs what the first tier's does, and a batch the first tier could not take
        # still lands below it, the caller's bytes being at hand.
        gate: "asyncio.Future[None]" = self._loop.create_future()
        lower: List[Tuple["asyncio.Future[Any]", "asyncio.Future[Any]"]] = []
        if self.write_policy == "write_through":
            lower = [self._write_behind(tier, items, gate) for tier in self.tiers[1:]]
        primary = asyncio.ensure_future(first.put_many(items))
        primary.add_done_callback(lambda p: _settle(gate, p))
        failure: Optional[BaseException] = None
        try:
            await asyncio.shield(primary)
        except ClosedError:
            raise
        except (KvtierError, OSError) as exc:
            failure = exc
        finally:
            # The buffer rule, cancelled or not: wait until every tier has stopped reading them.
            cancelled = await wait_through_cancel(primary)
            for fut, _ in lower:
                cancelled = await wait_through_cancel(fut) or cancelled
            if cancelled:
                raise asyncio.CancelledError
        if failure is not None and not await self._kept_below(items, [landed for _, landed in lower]):
            raise failure

    async def _kept_below(self, items: List[PutItem], landed: List["asyncio.Future[Any]"]) -> bool:
        """After the first tier failed a batch: True once a lower tier holds all of it - a write-behind
        started for it that landed, or (no write-behind: ``write_back_on_evict``, or one skipped)
        a store of it made now. Cancelling it: a store made now runs to its end first (the
        lower tier's buffer rule)."""
        kept = False
        for task in landed:
            try:
                if await asyncio.shield(task) is not None:
                    kept = True
            except asyncio.CancelledError:
                raise
            except Exception:  # counted by the write-behind's own callback
                pass
        if not kept:
            for tier in self.tiers[1:]:
                try:
                    await tier.put_many(items)
                    kept = True
                    break
                except (KvtierError, OSError) as exc:
                    self._extra["writebehind_failed"] += len(items)
                    logger.debug("store of %d chunks below a failed first tier failed: %s", len(items), exc)
        if kept:
            self._extra["kept_below"] += len(items)
        return kept

    def _write_behind(self, tier: ChunkTier, items: List[PutItem], gate: "asyncio.Future[None]"
                      ) -> Tuple["asyncio.Future[Any]", "asyncio.Future[Any]"]:
        """Start a lower tier's store that lands once ``gate`` succeeded (``ChunkTier.start_put``:
        the remote tier encodes meanwhile; a tier without its own split runs its whole put after the
        gate); returns (done once the caller's buffers are no longer read, the store's own task:
        its result is the tier's sequence, ``None`` for a store skipped here)."""
        if len(self._background) >= _MAX_BACKGROUND:
            self._extra["writebehind_skipped"] += 1
            done: "asyncio.Future[Any]" = self._loop.create_future()
            done.set_result(None)
            return done, done
        encoded, task = tier.start_put(items, after=gate)
        self._track_lower_put(task, len(items))
        return encoded, task

    def _track_lower_put(self, task: "asyncio.Future[Any]", count: int) -> None:
        self._background.spawn(task)  # the lower tier's task joins the chain's own work

        def done(t: "asyncio.Future[Any]") -> None:
            if not t.cancelled() and isinstance(t.exception(), PutAbortedError):
                self._extra["writebehind_skipped"] += count  # the first tier's put failed
            elif t.cancelled() or t.exception() is not None:
                self._extra["writebehind_failed"] += count
                if not t.cancelled():
                    logger.debug("write-behind of %d chunks failed: %s", count, t.exception())
            else:
                self._extra["writebehind_batches"] += 1
                self._extra["writebehind_chunks"] += count

        task.add_done_callback(done)

    def _maybe_write_back(self) -> None:
        if self._writeback_running or not self._dirty:
            return
        first = self.tiers[0]
        capacity = first.capacity_bytes
        if not capacity:
            return  # an unbounded first tier never evicts: nothing to save
        used = tier_statistics_dict(first).get("bytes", 0.0)
        if used < self._fill * capacity:
            return
        self._writeback_running = True
        if not self._spawn_background(self._write_back(), "writebehind_skipped"):
            self._writeback_running = False

    async def _write_back(self) -> None:
        """Copy the oldest dirty records down (read back from the first tier), ~64 MiB a round."""
        try:
            batch: List[Tuple[bytes, ChunkMeta, int]] = []
            total = 0
            while self._dirty and total < (64 << 20):
                key, (meta, nbytes) = self._dirty.popitem(last=False)
                batch.append((key, meta, nbytes))
                total += nbytes
            if not batch:
                return
            buffers = [bytearray(n) for _, _, n in batch]
            metas = await self.tiers[0].get_many_into([(k, memoryview(b)) for (k, _, _), b in zip(batch, buffers)])
            items = [(k, m, memoryview(b)) for (k, _, _), b, m in zip(batch, buffers, metas) if m is not None]
            self._extra["writeback_lost"] += len(batch) - len(items)
            for tier in self.tiers[1:]:
                try:
                    await tier.put_many(items)
                    self._extra["writebehind_batches"] += 1
                    self._extra["writebehind_chunks"] += len(items)
                except Exception as exc:
                    self._extra["writebehind_failed"] += len(items)
                    logger.debug("write-back of %d chunks failed: %s", len(items), exc)
        finally:
            self._writeback_running = False

    async def get_many_into(self, items: Sequence[GetItem]) -> List[Optional[ChunkMeta]]:
        """Per item the meta from the first tier that has it, or ``None``; lower-tier hits are
        promoted into the first tier in the background (from a copy of the bytes). Any tier's
        error is a miss in that tier (counted in ``errors``).

        Cancelling it: the tier being asked finishes with the buffers before the call ends (each
        tier's own buffer rule); tiers below it are not asked."""
        return (await self.get_many_into_sources(items))[0]

    async def get_many_into_sources(
        self, items: Sequence[GetItem]
    ) -> Tuple[List[Optional[ChunkMeta]], List[Optional[int]]]:
        """``get_many_into``, plus per item the index in ``tiers`` of the tier that served it
        (``None``: a miss), for per-tier hit metrics. Cancelling it: as ``get_many_into``."""
        self._check_open()
        items = list(items)
        results: List[Optional[ChunkMeta]] = [None] * len(items)
        sources: List[Optional[int]] = [None] * len(items)
        self._stats["gets"] += len(items)
        wanted = list(range(len(items)))
        for index, tier in enumerate(self.tiers):
            if not wanted:
                break
            metas = await self._ask(tier, tier.get_many_into([items[i] for i in wanted]))
            if metas is None:
                continue
            found = [(i, m) for i, m in zip(wanted, metas) if m is not None]
            for i, meta in found:
                results[i] = meta
                sources[i] = index
            self._hits_per_tier[index] += len(found)
            if found:
                # A use the tiers below hear of (their LRU), as the host's own touch: a chunk
                # served from the first tier must not age out of a shared remote behind it.
                for lower in self.tiers[index + 1:]:
                    lower.touch_many([items[i][0] for i, _ in found])
            if index > 0 and found and self.promote:
                copies = [(items[i][0], meta, memoryview(bytes(items[i][1]))) for i, meta in found]
                self._spawn_background(self._promote(copies), "promotions_skipped")
            wanted = [i for i in wanted if results[i] is None]
        hits = len(items) - len(wanted)
        self._stats["hits"] += hits
        self._stats["misses"] += len(wanted)
        return results, sources

    async def _ask(self, tier: ChunkTier, call: Awaitable[_Answer]) -> Optional[_Answer]:
        """``tier``'s answer to ``call``, or None where it failed: counted in ``errors``, and the
        chain reads it as a miss. The caller's own mistakes (``ValueError``, ``TypeError``) and
        ``ClosedError`` propagate. Cancelling it cancels ``call``."""
        try:
            return await call
        except (ValueError, TypeError, ClosedError):
            raise
        except Exception as exc:
            self._stats["errors"] += 1
            logger.debug("tier %s failed (a miss): %s", tier.name, exc)
            return None

    async def _promote(self, items: List[PutItem]) -> None:
        try:
            await self.tiers[0].put_many(items)
            self._extra["promotions"] += len(items)
            # Readable in the first tier now: an index that dropped one of them meanwhile (the
            # lower tier evicted it before this copy landed) hears of it as an arrival.
            self._on_tier_arrived([key for key, _, _ in items], 0)
        except Exception as exc:
            self._extra["promotions_failed"] += len(items)
            logger.debug("promotion of %d chunks failed: %s", len(items), exc)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Every tier of the chain hears of the use (``ChunkTier.touch_many``; each ignores the keys
        it does not hold, and a tier that does not evict by recency ignores all). Nothing once
        closed."""
        if self._closed:
            return
        for tier in self.tiers:
            tier.touch_many(keys)

    async def contains_many(self, keys: Sequence[bytes]) -> List[bool]:
        """True where any tier holds the key (a failing tier counts as not holding it)."""
        self._check_open()
        keys = list(keys)
        out = [False] * len(keys)
        for tier in self.tiers:
            rest = [i for i, v in enumerate(out) if not v]
            if not rest:
                break
            present = await self._ask(tier, tier.contains_many([keys[i] for i in rest]))
            if present is None:
                continue
            for i, p in zip(rest, present):
                out[i] = bool(p)
        return out

    async def list_keys(self) -> List[bytes]:
        """Keys held by any tier (a tier that cannot list is skipped and counted)."""
        self._check_open()
        seen: Dict[bytes, None] = {}
        for tier in self.tiers:
            try:
                for key in await tier.list_keys():
                    seen[key] = None
            except ClosedError:
                raise
            except Exception as exc:
                self._stats["errors"] += 1
                logger.warning("tier %s cannot list its keys: %s", tier.name, exc)
        return list(seen)

    async def snapshot_keys(self) -> KeySnapshot:
        """The keys of every tier, at a sequence below every put still in flight (such a put
        has its sequence already, but may not have landed yet). Cancelling drops the answer only."""
        seq = min(self._puts_in_flight, default=self._sequence + 1) - 1
        return KeySnapshot(frozenset(await self.list_keys()), seq)

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete from every tier; returns how many keys existed in at least one. The first error
        is raised after every tier was asked. Cancelling it: each tier's delete runs as it would."""
        self._check_open()
        keys = list(dict.fromkeys(keys))
        if not keys:
            return 0
        present = await self.contains_many(keys)
        error: Optional[BaseException] = None
        for tier in self.tiers:
            try:
                await tier.delete_many(keys)
            except (ValueError, TypeError):
                raise
            except Exception as exc:
                error = error or exc
        for key in keys:
            self._dirty.pop(key, None)
        n = sum(present)
        self._stats["deletes"] += n
        if error is not None:
            self._stats["errors"] += 1
            raise error
        return n

    async def flush(self) -> None:
        """Wait for write-behind copies, promotions and removal checks in flight, then each tier's
        own flush. Cancelling it stops only this wait: the chain's work runs on."""
        await self._background.wait_all()
        for tier in self.tiers:
            await tier.flush()

    async def sync_removals(self) -> None:
        """Each tier's ``sync_removals``, then the chain's removal checks of what they reported: a
        tier's report reaches the chain in two loop turns (the tier's feed, then the hop onto the
        chain's loop) and is published once no other tier holds the key. Cancelling it stops only
        this wait: the checks run on."""
        for tier in self.tiers:
            await tier.sync_removals()
        for _ in range(2):
            await asyncio.sleep(0)
        await self._background.wait_all()

    async def check(self) -> List[str]:
        problems: List[str] = []
        for tier in self.tiers:
            try:
                problems.extend(f"{tier.name}: {p}" for p in await tier.check())
            except Exception as exc:
                problems.append(f"{tier.name}: check failed: {exc}")
        return problems

    def statistics(self) -> TierStatistics:
        """The chain's own counters (a hit is a hit in any tier) and, in ``extra``, every tier's
        statistics flattened as ``<tier name>.<field>`` (the remote's breaker state, latencies,
        evictions seen...) plus ``hits.<tier name>`` and the write-behind/promotion counters."""
        extra = dict(self._extra)
        for index, tier in enumerate(self.tiers):
            name = tier.name
            extra[f"hits.{name}"] = float(self._hits_per_tier[index])
            for k, v in tier_statistics_dict(tier).items():
                extra[f"{name}.{k}"] = v
        extra["writeback_dirty"] = float(len(self._dirty))
        first = tier_statistics_dict(self.tiers[0])
        s = self._stats
        return TierStatistics(
            records=int(first.get("records", 0)), bytes=int(first.get("bytes", 0)),
            capacity_bytes=self.capacity_bytes, puts=s["puts"], put_batches=s["put_batches"],
            gets=s["gets"], hits=s["hits"], misses=s["misses"],
            corrupt=int(sum(tier_statistics_dict(t).get("corrupt", 0) for t in self.tiers)),
            mismatched=int(sum(tier_statistics_dict(t).get("mismatched", 0) for t in self.tiers)),
            quarantined=int(sum(tier_statistics_dict(t).get("quarantined", 0) for t in self.tiers)),
            evictions=s["evictions"], deletes=s["deletes"],
            errors=s["errors"] + int(sum(tier_statistics_dict(t).get("errors", 0) for t in self.tiers)),
            degraded=self.degraded, extra=extra,
        )

    async def close(self) -> None:
        """Wait for background copies and removal checks, then close every tier. Safe to call
        twice. Cancelling it stops only this wait: the chain goes on closing (its background work
        finishes, then its tiers close); call it again to wait for that."""
        if self._closing is None:
            self._closing = self._loop.create_task(self._close())
            self._closing.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        try:
            await self._background.wait_all()
        finally:
            self._closed = True
            for tier in self.tiers:
                await tier.close()
