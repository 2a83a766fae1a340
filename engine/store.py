"""The store: what every front end stands on below its host memory.

Primitives: ``DiskStore`` (``DiskStore.open(StoreConfig, ...)`` or construct then ``start``;
``tier``, ``local_tier``, ``index``, ``refresh``, ``problems``, ``settle``, ``close``). The engine
(``engine.py``) and the vLLM tier (``integrations/vllm/tier.py``) each hold one; neither opens a
tier, chains the remote or keeps its own index of what the disk holds.

What ``start`` does, in order:

1. the LMDB tier at ``cache_dir``: its structure verified before LMDB maps it
   (``lmdb_verify_on_open``), a damaged directory moved aside and recreated empty
   (``quarantine_corrupt_cache_dir``; never for a ``read_only`` store), or a tier the caller passed;
2. the remote tier chained behind it when ``remote_url`` is set (host -> LMDB -> remote,
   ``tiers/chain.py``); an unreachable remote starts degraded and heals;
3. the removal subscription: a record the tier drops (capacity eviction, quarantine, delete) leaves
   the index at once, or a lookup would admit a hit whose chunk is gone;
4. the listing into the ordered ``DiskIndex`` (``disk_index.py``), ordered by the tier's mutation
   sequence against removals that race with it. It runs on after ``start`` returns: ``start`` waits
   for it at most ``disk_index_wait_s``, so a store starts in the same time at any size (the LMDB
   tier builds its eviction index on its writer thread too: ``index_in_background``). Meanwhile the
   store serves: a key not listed yet is a miss, a write lands and joins the index, a removal keeps
   its key out; the tier's snapshot is read on its worker and merged here a page per loop turn.
   ``listing`` says whether it runs; ``wait_listed``, ``settle``, ``refresh`` and ``problems``
   wait for it; ``close`` cancels it.

Threads. Every call and every index change on the event-loop thread that started the store (a
removal reported from a tier's own thread is handed over). The index may be *read* from another
thread with ``in`` and ``len`` (single dict operations under the GIL): the vLLM tier's scheduler
thread does, and never waits for the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from kvtier.errors import ClosedError, KvtierError, TierIOError
from kvtier.tiers.base import ChunkTier, Removal
from kvtier.tiers.deferred import DeferredTier

from .config import StoreConfig
from .disk_index import DiskIndex, keys_of

__all__ = ["DiskStore", "StoreConfig"]

logger = logging.getLogger("kvtier.engine")

# Keys merged into the index per loop turn while the start-up listing runs: ~1.5 ms of the loop.
LISTING_PAGE_KEYS = 4096


class DiskStore:
    """The disk (and remote) half of a front end: one ``ChunkTier`` and the ordered index of which
    keys it holds.

    ``fingerprint`` binds the remote tier's keys and records to the model layout (``None``: a front
    end whose records carry bindings of their own, each in its chunk key). ``tier`` is a tier the
    caller opened (a ``FileTier``, a fault wrapper): used as is, never chained, never closed here.
    ``max_raw_bytes`` bounds a record the LMDB tier accepts (default: the tier's). Hooks, each
    called on the loop: ``on_removed(key)`` for every key that leaves the index,
    ``on_evicted(count)`` for the records of each removal report the store did not ask for (all but
    deletes), ``on_error(where)`` for a foreign exception from the tier (``"refresh"``).

    With no ``cache_dir``, no ``remote_url`` and no ``tier`` the store is empty: ``tier`` is None,
    the index stays empty, ``refresh`` and ``problems`` find nothing.
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        fingerprint: Optional[bytes],
        tier: Optional[ChunkTier] = None,
        max_raw_bytes: Optional[int] = None,
        on_removed: Optional[Callable[[bytes], None]] = None,
        on_evicted: Optional[Callable[[int], None]] = None,
        on_error: Optional[Callable[[str], None]] = None,
    ) -> None:
        if not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a StoreConfig, got {type(config).__name__}")
        self.config = config
        self.fingerprint = None if fingerprint is None else bytes(fingerprint)
        self._tier: Optional[ChunkTier] = tier
        self._local: Optional[ChunkTier] = tier
        self._owns_tier = tier is None
        self._max_raw_bytes = max_raw_bytes
        self._on_evicted = on_evicted
        self._on_error = on_error
        self.index = DiskIndex(on_removed=on_removed)
        self.quarantined_cache_dir: Optional[str] = None
        self._listing: "Optional[asyncio.Task[None]]" = None
        self._started = False
        self._closed = False

    @classmethod
    async def open(cls, config: StoreConfig, **kwargs: Any) -> "DiskStore":
        """Construct (arguments as the constructor) and ``start``. Cancelling it, or a failure,
        closes whatever it had opened."""
        store = cls(config, **kwargs)
        await store.start()
        return store

    # ------------------------------------------------------------------ open

    async def start(self) -> None:
        """Open the tiers, subscribe to removals, start listing the keys and wait for the listing at
        most ``disk_index_wait_s`` (module docstring). A listing that fails leaves the keys it had
        not merged out of the index (logged: those chunks are misses until a refresh or the next
        start; new writes still land); a failure to open raises, and so does a tier closed before
        the listing ends within the wait. On any failure or a cancel the tiers it opened are closed
        (and the listing cancelled) before it raises."""
        if self._started:
            raise RuntimeError("DiskStore.start() called twice")
        self._started = True
        try:
            if self._owns_tier and self.config.cache_dir is not None:
                self._tier = self._local = await self._open_cache_dir(self.config.cache_dir)
            if self._owns_tier and self.config.remote_url is not None:
                self._tier = await self._chain_remote(self._tier, self.config.remote_url)
            if self._tier is not None:
                self._subscribe_removals(self._tier)
                self._tier.subscribe_arrivals(self._arrived)
                self._listing = asyncio.ensure_future(self._list_into_index(self._tier))
                self._listing.add_done_callback(_outcome_read)
                wait_s = self.config.disk_index_wait_s
                if wait_s is None or wait_s > 0:
                    await asyncio.wait({self._listing}, timeout=wait_s)
                if self._listing.done() and not self._listing.cancelled():
                    self._listing.result()  # a tier closed under the listing
            local = self._local
            if isinstance(local, DeferredTier) and local.opening.done() and not local.opening.cancelled():
                local.opening.result()  # an open that failed within the wait fails start, as a blocking one does
        except BaseException:
            await self.close()
            raise

    async def _open_cache_dir(self, path: str) -> ChunkTier:
        from kvtier.tiers.lmdb import LmdbTier, open_replacing_damaged, structure_walk_due

        config = self.config
        kwargs: Dict[str, Any] = dict(
            capacity_bytes=config.disk_capacity_bytes,
            map_size_bytes=config.lmdb_map_size_bytes,
            codec=config.codec_config(),
            reader_check_interval_s=config.reader_check_interval_s,
            verify_structure=config.lmdb_verify_on_open,
            segment_threshold_bytes=config.lmdb_segment_threshold_bytes,
            segment_compaction_live_fraction=config.lmdb_segment_compaction_live_fraction,
            eviction_policy=config.eviction_policy,
            read_workers=config.read_workers,
            readonly=config.read_only,
            index_in_background=True,
        )
        if self._max_raw_bytes is not None:
            kwargs["max_raw_bytes"] = self._max_raw_bytes
        quarantine = config.quarantine_corrupt_cache_dir and not config.read_only

        async def open_tier() -> ChunkTier:
            tier, aside = await open_replacing_damaged(path, lambda: LmdbTier.open(path, **kwargs), quarantine=quarantine)
            if aside is not None:
                self.quarantined_cache_dir = str(aside)
            return tier

        if not (quarantine and config.lmdb_verify_on_open and structure_walk_due(Path(path).expanduser())):
            return await open_tier()
        # The file changed since a verified clean close (a writer killed, a tool that did not
        # verify): the walk takes ~25 us a record. Serve meanwhile, the disk a miss until it is open
        # (``DeferredTier``); damage it finds is handled as a blocking open's is: moved aside, a
        # fresh directory opened. ``start`` still waits for it up to ``disk_index_wait_s``.
        deferred = DeferredTier(asyncio.ensure_future(open_tier()), name=LmdbTier.name)
        deferred.opening.add_done_callback(lambda _: self._opened(deferred))
        return deferred

    def _opened(self, deferred: DeferredTier) -> None:
        """A deferred open ended: the store's own calls go to the tier itself from now on (the paths
        a front end built meanwhile keep the wrapper, which forwards)."""
        tier = deferred.opened
        if tier is None:
            exc = None if deferred.opening.cancelled() else deferred.opening.exception()
            if exc is not None:
                logger.error("opening the cache directory %s failed: %r; its chunks are misses", self.config.cache_dir, exc)
            return
        if self._local is deferred:
            self._local = tier
        if self._tier is deferred:
            self._tier = tier

    async def _chain_remote(self, disk: Optional[ChunkTier], url: str) -> ChunkTier:
        """``disk`` and a ``RemoteTier`` behind it in a ``ChainedTier`` (the remote alone when there
        is no disk). A remote that cannot be reached at start does not stop the store: it starts
        degraded (a warning is logged; the tier's ``degraded`` and ``breaker_open`` say so) and heals
        when the server answers again - a remote is a cache, never worse than recomputing."""
        from kvtier.tiers.chain import ChainedTier
        from kvtier.tiers.remote import RemoteTier

        config = self.config
        remote = await RemoteTier.open(
            url,
            namespace=config.remote_namespace,
            fingerprint=self.fingerprint,
            codec=config.codec_config(),
            timeout_s=config.remote_timeout_s,
            connect_timeout_s=config.remote_connect_timeout_s,
            concurrency=config.remote_concurrency,
            pipeline_max_bytes=config.remote_pipeline_max_bytes,
            breaker_failures=config.remote_breaker_failures,
            breaker_reset_s=config.remote_breaker_reset_s,
            listing_interval_s=config.remote_listing_interval_s,
            watch_new_keys=config.remote_watch_new_keys,
            require_connection=False,
        )
        if disk is None:
            return remote
        return ChainedTier([disk, remote], write_policy=config.remote_write_policy,
                           promote=config.remote_promote_to_disk)

    def _subscribe_removals(self, tier: ChunkTier) -> None:
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()

        def on_removed(removals: Sequence[Removal]) -> None:
            # The tier contract delivers on this loop; a tier that calls from its own thread is
            # handed over rather than trusted.
            removals = list(removals)
            if threading.get_ident() == loop_thread:
                self._removed(removals)
            else:
                loop.call_soon_threadsafe(self._removed, removals)

        tier.subscribe_removals(on_removed)

    def _removed(self, removals: Sequence[Removal]) -> None:
        for key, sequence in keys_of(removals):
            self.index.remove(key, sequence)
        if self._on_evicted is not None:
            # Deletes are asked for; the rest (capacity, quarantine, gone from a listing) are evictions.
            self._on_evicted(sum(1 for r in removals if r.reason != "deleted"))

    def _arrived(self, keys: List[bytes], sequence: int) -> None:
        """Keys another writer made readable in the tier (a shared remote's new-key notices) join
        the index at the tier's ``sequence``, as a put of them would: a key indexed already takes
        the later sequence, so a removal of its older record that the tier reports after the
        arrival (a chain checks its other tiers first) does not take the new one out; a removal
        with a later sequence wins."""
        token = self.index.begin()
        try:
            for key in keys:
                self.index.add(key, token, sequence)
        finally:
            self.index.end(token)

    async def _list_into_index(self, tier: ChunkTier) -> None:
        """The start-up listing (a task on the loop): the tier's snapshot, read on its worker, then
        merged a page per loop turn. Ordered like a refresh: a removal reported while it runs keeps
        its key out. Raises only ``ClosedError`` (the tier closed under it) and ``CancelledError``."""
        token = self.index.begin()
        try:
            taken = await tier.snapshot_keys()
            for page in _pages(taken.keys, LISTING_PAGE_KEYS):
                self.index.admit(page, token, taken.sequence)
                await asyncio.sleep(0)  # serve between pages
        except (ClosedError, asyncio.CancelledError):
            raise
        except KvtierError as exc:
            logger.warning("cannot list the disk tier's chunks; those not yet indexed are misses: %s", exc)
        except Exception:  # a foreign tier error: logged and counted, the store serves on
            logger.exception("listing the disk tier's chunks failed; those not yet indexed are misses")
            if self._on_error is not None:
                self._on_error("listing")
        finally:
            self.index.end(token)

    @property
    def listing(self) -> bool:
        """True while the start-up listing still runs (keys not merged yet are misses)."""
        return self._listing is not None and not self._listing.done()

    async def wait_listed(self) -> None:
        """Wait until the start-up listing has ended (merged, failed or cancelled). Cancelling it
        stops the wait only: the listing runs on."""
        if self._listing is not None and not self._listing.done():
            await asyncio.wait({self._listing})

    # ------------------------------------------------------------------ running

    @property
    def tier(self) -> Optional[ChunkTier]:
        """The tier the front end reads and writes: the LMDB tier, the chain of it and the remote,
        the remote alone, or the caller's tier. None for an empty store."""
        return self._tier

    @property
    def local_tier(self) -> Optional[ChunkTier]:
        """The local disk tier (the LMDB tier at ``cache_dir``, or the caller's tier) without the
        remote in front of it; None without one."""
        return self._local

    @property
    def owns_tier(self) -> bool:
        """True when the store opened its tiers itself (and closes them)."""
        return self._owns_tier

    async def refresh(self) -> Tuple[int, int]:
        """Re-read which keys the tier holds, for a cache directory another process writes. Returns
        (keys added, keys removed); (0, 0) for an empty store. Keys written while the listing runs
        stay; keys indexed before it began and absent from it leave; a key the tier reports
        removed meanwhile stays out (``DiskIndex.refresh``); it waits for the start-up listing
        first. A foreign exception from the tier is a
        ``TierIOError`` (its ``__cause__`` kept; ``on_error("refresh")``) and leaves the index as it
        was. Cancelling it leaves the index as it was."""
        if self._tier is None:
            return 0, 0
        await self.wait_listed()  # a refresh merged beside it could not tell its keys from stale ones
        token = self.index.begin()
        try:
            taken = await self._tier.snapshot_keys()
            return self.index.refresh(taken.keys, token, taken.sequence)
        except (KvtierError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a foreign tier error reaches the caller typed, its cause kept
            if self._on_error is not None:
                self._on_error("refresh")
            raise TierIOError(f"listing the disk tier failed: {exc!r}") from exc
        finally:
            self.index.end(token)

    async def settle(self) -> None:
        """Wait until the start-up listing has ended, the writes queued so far landed and the
        removals the tier reported by then reached the index (the tier's ``flush``, then one loop
        turn: a tier queues its removal reports on this loop before the flush's answer). Cancelling
        it stops the wait only."""
        if self._tier is None:
            return
        await self.wait_listed()
        await self._tier.flush()
        await asyncio.sleep(0)

    async def problems(self) -> List[str]:
        """Disagreements between the index and the tier: indexed keys the tier does not hold (a
        lookup would admit a hit that the load fails) and the tier's own ``check()``. Meant for
        an idle store; it ``settle``s first, so a removal still on its way (a corrupt record a last
        load found, quarantined on the writer thread, its report queued on the loop) is not
        counted as a disagreement; after listing the tier it waits for the removals the tier had
        not heard of yet (``ChunkTier.sync_removals``: a shared remote's eviction notices in
        flight), so a record another host's write evicted just before is not one either.
        Cancelling it drops the answer only."""
        if self._tier is None:
            return []
        await self.settle()
        problems: List[str] = []
        before = self.index.keys()
        listed = set(await self._tier.list_keys())
        # A record gone before the listing whose report was still on its way (a shared remote's
        # eviction notice) leaves the index now: the tier's reports of it, then one loop turn.
        await self._tier.sync_removals()
        await asyncio.sleep(0)
        # Keys indexed before and after the listing (a removal meanwhile takes a key out).
        ghosts = [k for k in before if k in self.index and k not in listed]
        if ghosts:
            problems.append(f"{len(ghosts)} indexed keys are not on the disk tier (first {ghosts[0].hex()[:12]})")
        problems.extend(f"disk tier: {p}" for p in await self._tier.check())
        return problems

    def statistics(self) -> Dict[str, float]:
        """The tier's statistics as flat floats (a chain's per-tier ones included); {} when empty."""
        from kvtier.tiers.chain import tier_statistics_dict

        return tier_statistics_dict(self._tier) if self._tier is not None else {}

    async def close(self) -> None:
        """Close the tiers the store opened (a caller's tier stays open); queued writes land first.
        Safe to call twice. Cancelling it: the tier's close runs on as that tier's does."""
        if self._closed:
            return
        self._closed = True
        if self._listing is not None and not self._listing.done():
            self._listing.cancel()  # its worker's read finishes on its own; the tier's close waits for it
            await asyncio.wait({self._listing})
        if not self._owns_tier:
            return
        if self._tier is not None:  # a chain closes the LMDB tier in it
            await self._tier.close()


def _pages(keys: Iterable[bytes], size: int) -> "Iterable[List[bytes]]":
    """``keys`` in lists of at most ``size``."""
    it = iter(keys)
    while True:
        page = list(itertools.islice(it, size))
        if not page:
            return
        yield page


def _outcome_read(task: "asyncio.Task[None]") -> None:
    # A listing that ends after start returned reports to nobody: a closed tier is the closing
    # store's business, not an unretrieved-exception warning.
    if not task.cancelled() and task.exception() is not None:
        logger.debug("the disk listing ended: %r", task.exception())
