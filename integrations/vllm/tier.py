"""``KvtierTier``: kvtier as a secondary tier under vLLM's CPU tier (``TieringOffloadingSpec``).

vLLM's CPU tier is the primary: vLLM copies GPU <-> CPU rows itself. Rows cascade down here
(``submit_store``: read the pinned primary rows, encode kvtier records, write them to LMDB and,
when configured, the remote tier) and are promoted back (``submit_load``: decode records straight
into the primary rows vLLM allocated). vLLM calls every method from its scheduler process, under
its tiering lock, sometimes from its tier-poll thread; none of them may block.

Threads:
- the caller's thread (vLLM's scheduler or tier-poll thread): ``lookup``, ``submit_*``,
  ``get_finished_jobs``, ``take_events``, ``has_pending_work``. They touch only this object's
  plain state (the index, the in-flight counts, the job table), post work to the loop with one
  ``call_soon_threadsafe`` and drain one queue of completions. Each call costs O(keys) microseconds
  (one keyed BLAKE3 per key) and never waits for I/O or for the loop.
- kvtier's loop thread (``LoopThread``): the tiers' async methods; puts and gets end by putting
  one completion record on the queue. The tiers' own threads (LMDB writer, read pool) do the I/O.
- blocking (never from a scheduler step): the constructor (opens the store, lists its keys),
  ``drain_jobs`` and ``shutdown`` (vLLM calls them on reset and exit), ``settle`` (tools, tests).

Keys: vLLM builds this tier before it seeds NONE_HASH, so the key scheme (hash algorithm and
NONE_HASH, read from vLLM: ``layout.py``) is bound at the first lookup or submit
(``_bound_layout``), which also leaves the layout file; before that, lookups miss. One writer per
``cache_dir`` is ``writer_lock.py``; a job's records and its hit metrics are ``jobs.py``.

Store: the tier stands on a ``DiskStore`` (``kvtier.engine.store``) as the engine does: the same
verified open, damaged directory moved aside, remote chain, removal subscription and ordered
``DiskIndex``, from the ``StoreConfig`` its keys give (``VllmTierConfig.store_config``).

Index: the kvtier keys readable now = keys listed at start + stores that completed - records
the disk tier removed (eviction, quarantine) - loads that missed, ordered by the tier's mutation
sequence (a removal reported after a newer record of the key landed does not take it out). The
loop thread changes it; the caller's thread only reads it (``in``, ``len``). ``lookup`` answers
RETRY while a store of the key is in flight, HIT only for an indexed key, MISS otherwise or when
the tier is closed. A key the disk admission declines (``disk_admission``: vLLM cascades every
chunk it stores into its CPU tier, so ``seen`` declines a chunk's first store) is neither written
nor in flight nor indexed: its lookup is a MISS; the job is reported successful with 0 bytes
written, so vLLM counts no cascade failure and its back-pressure detector skips it. A record can still vanish between the HIT and the load (eviction,
corruption): the load then reports the key failed, vLLM recomputes it, and the key leaves the
index; no byte of a failed key is ever reported loaded.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Sequence, cast

from typing_extensions import override

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingMetricMetadata
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.engine.store import DiskStore
from kvtier.errors import KvtierError
from kvtier.tiers.admission import WINDOW_FACTOR, Admission, AdmitAll, SeenBefore, make_admission, tier_chunks
from kvtier.tiers.base import ChunkMeta, ChunkTier
from kvtier.tiers.chain import read_with_sources

from .config import SEEN_TAIL, VllmTierConfig, VllmTierConfigError
from .jobs import TIER_NAMES, Done, Job, count_hits, metric_definitions
from .keys import VllmLayout, split_offload_key
from .layout import layout_from_spec, parallel_sharing_note, vllm_key_scheme
from .loop import LoopThread
from .records import record_meta
from .writer_lock import release_writer_lock, take_writer_lock

__all__ = ["KvtierTier", "CacheDirInUseError", "layout_from_spec", "vllm_key_scheme"]


class CacheDirInUseError(KvtierError):
    """Another process (or tier) already writes this ``cache_dir``: refused at start, because its
    evictions would never reach this tier's index (a hit admitted for a key it removed)."""


logger = logging.getLogger("kvtier.integrations.vllm")


_warned_ephemeral_keys = False


class KvtierTier(SecondaryTierManager):
    """A vLLM secondary tier backed by kvtier: durable, checksummed, compressed, shareable.

    Built by vLLM's ``SecondaryTierFactory`` from ``{"type": "KvtierTier", "module_path":
    "kvtier.integrations.vllm", ...}``; the other keys are ``VllmTierConfig``'s.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = VllmTierConfig.from_dict(config)
        self.locality = Locality(self.config.locality) if self.config.locality else None
        self._rows = primary_kv_view
        self._row_bytes = primary_kv_view.strides[0]  # type: ignore[index]  # typeshed: Optional; CPython always gives a tuple
        # The layout's key scheme is bound at the first lookup or submit (``_bound_layout``).
        self.layout = layout_from_spec(offloading_spec, self._row_bytes, self.config)
        self._key_scheme_unknown_logged = False
        note = parallel_sharing_note(self.layout)
        if note is not None:
            logger.warning(note)

        self._storing: Counter = Counter()
        self._jobs: Dict[int, Job] = {}
        # completions a lookup drained (to keep the index fresh), handed out by get_finished_jobs
        self._pending_results: List[Done] = []
        self._completions: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._outstanding = 0
        self._outstanding_cv = threading.Condition()
        self._events: Optional[List[OffloadingEvent]] = [] if self._events_enabled(offloading_spec) else None
        # with events on: the vLLM key of every chunk a stored event announced (for its removal)
        self._announced: Dict[bytes, OffloadKey] = {}
        self._closed = False
        # Which cascaded chunks are written: asked on the caller's thread, in submit order (vLLM
        # never enters the tier twice at once); the CPU tier's rows against the disk's.
        self._tails_only = self.config.disk_admission == SEEN_TAIL
        self._admission = self._make_admission(len(primary_kv_view))
        self.counters: Counter = Counter()
        # per kvtier tier ("disk", "remote"): hits (chunks), hit_tokens, hit_bytes, load_s (sum)
        self.tier_hits: Counter = Counter()
        self._stats = OffloadingConnectorStats()  # what get_stats hands vLLM next
        # Where a damaged cache_dir's files were moved at start (None: it was sound, or new).
        self.quarantined_cache_dir: Optional[str] = None
        self.read_only = self.config.read_only or self._cache_dir_unwritable()
        self._writer_lock: Optional[int] = None

        if not self.read_only:  # before the open: a second writer never touches the directory
            self._take_writer_lock()
        self._loop = LoopThread()
        store: Optional[DiskStore] = None
        try:
            store = self._loop.run(DiskStore.open(
                self.config.store_config(read_only=self.read_only), fingerprint=self.layout.fingerprint,
                max_raw_bytes=max(self._row_bytes, 1 << 20), on_removed=self._left_index,
            ), self.config.op_timeout_s)
            self.quarantined_cache_dir = store.quarantined_cache_dir
            if self._writer_lock is not None and self.quarantined_cache_dir is not None:
                self._release_writer_lock()  # the lock file moved aside with the damaged directory
                self._take_writer_lock()
        except BaseException:
            if store is not None:
                self._loop.run(store.close(), self.config.op_timeout_s)
            self._release_writer_lock()
            self._loop.stop(self.config.op_timeout_s)
            raise
        self.store = store
        self._index = store.index  # changed on the loop thread only; read here with `in` and len()
        # The tiers jobs read and write (the chain of LMDB and the remote, or LMDB alone), and LMDB:
        # never None, a vLLM store always has its cache_dir.
        self.chunk_tier = cast(ChunkTier, store.tier)
        self.disk_tier = cast(ChunkTier, store.local_tier)

    # ------------------------------------------------------------------------------ construction

    def _make_admission(self, cpu_rows: int) -> Admission:
        """``disk_admission``'s object, over vLLM's CPU tier rows and the disk's capacity in rows
        (``seen-tail``: ``seen``'s Bloom generations whatever the disk's size)."""
        cap = self.config.disk_capacity_bytes
        if cap is None:
            return AdmitAll()
        rows, disk = tier_chunks([cpu_rows], cap, [self._row_bytes])
        if self._tails_only:
            return SeenBefore(max(1, WINDOW_FACTOR * (rows + disk)))
        return make_admission(self.config.disk_admission, rows, disk)

    def _admitted(self, keys: Sequence[OffloadKey], chunk_keys: Sequence[bytes], new: Sequence[Any],
                  req_context: ReqContext) -> List[bool]:
        """Per new (key, chunk key, row) of a store job, whether it is written (the admission's
        answer; under ``seen-tail`` only the job's last key per group is asked, by the end-token
        positions ``req_context`` records)."""
        if isinstance(self._admission, AdmitAll):
            return [True] * len(new)
        answers = self._admission.decide([chunk_key for _, chunk_key, _ in new])
        if not self._tails_only:
            return answers
        last: Dict[int, Any] = {}  # group id -> (end token, chunk key) of the job's last key
        for key, chunk_key in zip(keys, chunk_keys):
            group, end = split_offload_key(key)[1], req_context.get_offload_key_position(key) or 0
            if group not in last or end > last[group][0]:
                last[group] = (end, chunk_key)
        tails = {chunk_key for _, chunk_key in last.values()}
        return [admit or chunk_key not in tails for (_, chunk_key, _), admit in zip(new, answers)]

    def _events_enabled(self, spec: Any) -> bool:
        if not self.config.enable_kv_events:
            return False
        kv_events = getattr(spec, "kv_events_config", None)
        if kv_events is None or not kv_events.enable_kv_cache_events:
            logger.warning("KvtierTier enable_kv_events is set but vLLM's KV cache events are off")
            return False
        return True

    def _warn_if_keys_are_ephemeral(self) -> None:
        global _warned_ephemeral_keys
        if self.layout.keys_outlive_process(os.environ.get("PYTHONHASHSEED")) or _warned_ephemeral_keys:
            return
        _warned_ephemeral_keys = True
        logger.warning(
            "kvtier: vLLM hashes prefix blocks with %s and PYTHONHASHSEED is not set, so block "
            "hashes are random per process: chunks stored now can never be hit after a restart, "
            "by another server, or by an offline warmup. Set PYTHONHASHSEED to one value on every "
            "server (and for `kvtier warmup --key-scheme vllm`), or use --prefix-caching-hash-algo sha256.",
            self.layout.hash_algorithm,
        )

    def _cache_dir_unwritable(self) -> bool:
        """An existing ``cache_dir`` this process may not write (a read-only mount, permissions):
        served read-only, said once."""
        path = self.config.cache_dir
        if not os.path.isdir(path) or os.access(path, os.W_OK):
            return False
        logger.warning("kvtier: cache_dir %s cannot be written (a read-only mount or its permissions): "
                       "serving its records read-only; nothing will be stored", path)
        return True

    def _take_writer_lock(self) -> None:
        """One writer per ``cache_dir``: an exclusive ``flock`` held until ``shutdown``."""
        fd = take_writer_lock(self.config.cache_dir)
        if isinstance(fd, str):
            raise CacheDirInUseError(
                f"kvtier: cache_dir {self.config.cache_dir} is already written by another KvtierTier (pid {fd}); "
                "two schedulers writing one directory are not supported (its evictions would not reach this "
                "index): give each server its own cache_dir and share through remote_url, or set read_only"
            )
        self._writer_lock = fd

    def _release_writer_lock(self) -> None:
        fd, self._writer_lock = self._writer_lock, None
        release_writer_lock(fd)

    def _left_index(self, chunk_key: bytes) -> None:
        """Loop thread: a key left the index (the disk removed its record, or a load found it
        unreadable). Its removed event, if announced, follows the completions queued before it."""
        self._completions.put(("removed", [chunk_key]))

    def _bound_layout(self, log_unknown: bool = True) -> Optional[VllmLayout]:
        """The layout with vLLM's key scheme, bound once, at the first call that needs a key (or
        the first ``get_finished_jobs``, or ``shutdown``): vLLM seeds NONE_HASH after it builds its
        tiers, and before it hashes any request. None (logged once) while NONE_HASH is unset:
        lookups miss and submits fail, never a key of another seed."""
        if self.layout.key_scheme_bound:
            return self.layout
        try:
            scheme = vllm_key_scheme(self.config.hash_algorithm)
        except VllmTierConfigError as exc:
            scheme, why = None, str(exc)
        else:
            why = "vLLM has not seeded NONE_HASH yet"
        if scheme is None:
            if log_unknown and not self._key_scheme_unknown_logged:
                self._key_scheme_unknown_logged = True
                logger.error("kvtier: no vLLM key scheme, every lookup misses: %s", why)
            return None
        self.layout = self.layout.with_key_scheme(*scheme)
        self._warn_if_keys_are_ephemeral()
        self._write_layout_file(self.layout)
        return self.layout

    def _write_layout_file(self, layout: VllmLayout) -> None:
        """Leave the layout beside the records, so `kvtier warmup --key-scheme vllm` keys alike
        (once per layout: a rebuilt engine binds the same layout and finds its file). A few
        hundred bytes, once per tier, on the first lookup's thread."""
        path = Path(self.config.cache_dir) / layout.file_name
        if self.read_only or path.exists():
            return
        try:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(layout.to_json())
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("kvtier: cannot leave the vLLM layout file %s: %s", path, exc)

    def _chunk_keys(self, keys: Sequence[OffloadKey]) -> Optional[List[bytes]]:
        layout = self._bound_layout()
        return None if layout is None else layout.chunk_keys(keys)

    # ------------------------------------------------------------------------------ helpers

    def _row(self, chunk_id: int) -> memoryview:
        """The primary row of slot ``chunk_id`` as flat bytes (a view: no copy)."""
        cid = int(chunk_id)
        return self._rows[cid : cid + 1].cast("B")

    def _meta(self, key: OffloadKey, req_context: ReqContext) -> ChunkMeta:
        _, group_id = split_offload_key(key)
        return record_meta(self.layout, group_id, req_context.get_offload_key_position(key), self._row_bytes)

    def _usable(self) -> bool:
        return not self._closed and self._loop.alive and not (self.disk_tier is not None and self.disk_tier.closed)

    def _begin(self) -> None:
        with self._outstanding_cv:
            self._outstanding += 1

    def _finish(self, done: Done) -> None:
        """Loop thread: publish one completion (after this, drain_jobs may return)."""
        self._completions.put(done)
        with self._outstanding_cv:
            self._outstanding -= 1
            self._outstanding_cv.notify_all()

    def _fail_now(self, job_id: int, reason: str) -> None:
        self.counters[reason] += 1
        self._completions.put(Done(job_id, False, None, 0, 0.0))

    def _drain(self) -> List[Done]:
        """Apply removals and completions in arrival order; return the completions."""
        done: List[Done] = []
        while True:
            try:
                item = self._completions.get_nowait()
            except queue.Empty:
                return done
            if isinstance(item, Done):
                self._apply(item)
                done.append(item)
            else:
                self._announce_removed(item[1])

    def _announce_removed(self, chunk_keys: Iterable[bytes]) -> None:
        """Chunks that left the index: a removed event for those a stored event announced."""
        if self._events is None:
            return
        gone = [self._announced.pop(k) for k in chunk_keys if k in self._announced]
        if gone:
            self._events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True, locality=self.locality))

    def _announce(self, job: "Job") -> None:
        """A stored event for a store job's keys, in the order completions and removals arrive."""
        if self._events is None or not job.keys:
            return
        self._announced.update(zip(job.chunk_keys, job.keys))
        self._events.append(OffloadingEvent(keys=list(job.keys), medium=self.medium, removed=False,
                                            locality=self.locality))

    def _apply(self, done: Done) -> None:
        job = self._jobs.get(done.job_id)
        if job is None:
            return
        if job.kind == "store":  # the loop indexed the keys a successful store wrote
            for key in job.written:
                self._storing[key] -= 1
                if self._storing[key] <= 0:
                    del self._storing[key]
            if done.success:
                self._announce(job)
        else:  # the loop took the keys that did not load out of the index
            count_hits(done, self._stats, self.tier_hits)

    # ------------------------------------------------------------------------------ vLLM's calls

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain_into_pending()
        chunk_keys = self._chunk_keys([key])
        if chunk_keys is None:
            return LookupResult.MISS
        (chunk_key,) = chunk_keys
        if chunk_key in self._storing:
            return LookupResult.RETRY
        if chunk_key in self._index and self._usable():
            return LookupResult.HIT
        return LookupResult.MISS

    @override
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """vLLM marks these chunks used (a hit its CPU tier serves is one): kvtier's disk tier hears
        of the use for the ones it holds (``ChunkTier.touch_many`` on the tier's loop), so a chunk
        kept hot in vLLM's CPU tier does not age out of the disk. Scheduler thread; O(keys)."""
        chunk_keys = self._chunk_keys(list(keys))
        if not chunk_keys or not self._usable():
            return
        held = [key for key in chunk_keys if key in self._index]
        if held:
            self._loop.call(self.chunk_tier.touch_many, held)

    def _drain_into_pending(self) -> None:
        """Keep completions drained by a lookup for the next ``get_finished_jobs``."""
        self._pending_results.extend(self._drain())

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        chunk_keys = self._chunk_keys(keys)
        job = Job("store", keys, chunk_keys or [])
        self._jobs[job_id] = job
        if chunk_keys is None:
            return self._fail_now(job_id, "stores_refused_unseeded")
        if self.read_only:
            return self._fail_now(job_id, "stores_refused_read_only")
        if not self._usable():
            return self._fail_now(job_id, "stores_refused_closed")
        if self._outstanding >= self.config.max_inflight_jobs:
            return self._fail_now(job_id, "stores_refused_busy")
        items = []
        new = [(key, chunk_key, chunk_id) for key, chunk_key, chunk_id in zip(keys, chunk_keys, job_metadata.chunk_ids)
               if chunk_key not in self._index and chunk_key not in self._storing]
        admitted = self._admitted(keys, chunk_keys, new, job_metadata.req_context)
        for (key, chunk_key, chunk_id), admit in zip(new, admitted):
            if not admit:
                self.counters["stores_declined"] += 1
                continue
            items.append((chunk_key, self._meta(key, job_metadata.req_context), self._row(chunk_id)))
            self._storing[chunk_key] += 1
            job.written.append(chunk_key)
        if not items:
            self._completions.put(Done(job_id, True, None, 0, 0.0))
            return
        self._begin()
        self._loop.post(lambda: self._store(job_id, items))

    async def _store(self, job_id: int, items: List[Any]) -> None:
        start = time.monotonic()
        success = False
        token = self._index.begin()  # a removal of these keys reported before the put returns wins
        try:
            sequence = await self.chunk_tier.put_many(items)
            for key, _, _ in items:
                self._index.add(key, token, sequence)
            success = True
        except Exception as exc:  # every failure, kvtier's or foreign: vLLM keeps its CPU copy
            self.counters["store_failures"] += 1
            logger.warning("kvtier store of %d chunks failed: %s: %s", len(items), type(exc).__name__, exc)
        finally:
            self._index.end(token)
            self._finish(Done(job_id, success, None, len(items) * self._row_bytes, time.monotonic() - start))

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        chunk_keys = self._chunk_keys(keys)
        self._jobs[job_id] = Job("load", keys, chunk_keys or [])
        if chunk_keys is None:
            return self._fail_now(job_id, "loads_refused_unseeded")
        if not self._usable():
            return self._fail_now(job_id, "loads_refused_closed")
        items = [(ck, self._row(cid)) for ck, cid in zip(chunk_keys, job_metadata.chunk_ids)]
        expected = [self._meta(k, job_metadata.req_context) for k in keys]
        self._begin()
        self._loop.post(lambda: self._load(job_id, items, expected))

    def _tokens_per_chunk(self, group_id: int) -> int:
        group = self.layout.groups[self.layout.group_index(group_id)]
        return group.tokens_per_block * self.layout.blocks_per_chunk

    async def _load(self, job_id: int, items: List[Any], expected: List[ChunkMeta]) -> None:
        start = time.monotonic()
        ok: set = set()
        served: Counter = Counter()  # (tier name, "chunks" | "tokens") -> count
        try:
            metas, sources = await read_with_sources(self.chunk_tier, items)
            for (chunk_key, _), meta, want, source in zip(items, metas, expected, sources):
                if meta is None:
                    self.counters["load_misses"] += 1
                elif (meta.fingerprint, meta.group_index, tuple(meta.shape)) != (
                    want.fingerprint, want.group_index, want.shape
                ) or (want.chunk_index and meta.chunk_index != want.chunk_index):
                    self.counters["load_mismatches"] += 1
                else:
                    ok.add(chunk_key)
                    name = TIER_NAMES[min(source or 0, 1)]
                    served[(name, "chunks")] += 1
                    served[(name, "tokens")] += self._tokens_per_chunk(want.group_index)
        except Exception as exc:  # a broken tier is a miss for every key of the job, never bytes
            self.counters["load_failures"] += 1
            logger.warning("kvtier load of %d chunks failed: %s: %s", len(items), type(exc).__name__, exc)
        finally:
            for chunk_key, _ in items:
                if chunk_key not in ok:  # a store of it in flight lands later and indexes it again
                    self._index.discard(chunk_key)
            by_tier = tuple((name, served[(name, "chunks")], served[(name, "tokens")],
                             served[(name, "chunks")] * self._row_bytes)
                            for name in TIER_NAMES if served[(name, "chunks")])
            self._finish(Done(job_id, len(ok) == len(items), frozenset(ok),
                               len(ok) * self._row_bytes, time.monotonic() - start,
                               by_tier, by_tier[-1][0] if by_tier else None))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._bound_layout(log_unknown=False)  # every step: the layout file appears before a request
        finished, self._pending_results = self._pending_results + self._drain(), []
        results = []
        for done in finished:
            job = self._jobs.pop(done.job_id, None)
            if job is None:
                continue
            successful_keys = None
            if job.kind == "load" and not done.success:
                ok = done.ok_chunk_keys or frozenset()
                loaded = tuple(k for k, ck in zip(job.keys, job.chunk_keys) if ck in ok)
                successful_keys = loaded or None
                self.counters["promotions_failed"] += 1
            self.counters[f"{job.kind}s_{'ok' if done.success else 'failed'}"] += 1
            # A store's bytes as written, 0 included (nothing written: declined or already held),
            # so vLLM's back-pressure detector does not time bytes that never moved.
            nbytes = done.transfer_bytes if job.kind == "store" else done.transfer_bytes or None
            results.append(JobResult(job_id=done.job_id, success=done.success, successful_keys=successful_keys,
                                     transfer_time=done.transfer_s or None, transfer_bytes=nbytes))
        return results

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: Dict[str, Any]) -> Dict[str, OffloadingMetricMetadata]:
        """vLLM's Prometheus metrics this tier reports through ``get_stats``, per kvtier tier."""
        return metric_definitions()

    @override
    def get_stats(self) -> Optional[OffloadingConnectorStats]:
        """The hit counters and load times since the last call (vLLM's stats hook; scheduler thread)."""
        self._drain_into_pending()
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    @override
    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (results stay for ``get_finished_jobs``)."""
        deadline = time.monotonic() + self.config.op_timeout_s
        with self._outstanding_cv:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0 or not self._loop.alive:
                    raise TimeoutError(f"kvtier: {self._outstanding} jobs still running after {self.config.op_timeout_s} s")
                self._outstanding_cv.wait(left)

    @override
    def shutdown(self) -> None:
        """Wait for running jobs, close the tiers (queued writes land), stop the loop. Safe twice."""
        if self._closed:
            return
        self._bound_layout(log_unknown=False)
        try:
            self.drain_jobs()
        finally:
            self._closed = True
            try:
                self._loop.run(self.store.close(), self.config.op_timeout_s)
            finally:
                self._release_writer_lock()
                self._loop.stop(self.config.op_timeout_s)

    def settle(self) -> None:
        """Block until the jobs submitted so far finished, their writes landed and the removals the
        disk reported by then reached the index (between requests, as a server's idle moment:
        tools and tests, never from a scheduler step)."""
        self.drain_jobs()
        self._loop.run(self._settled(), self.config.op_timeout_s)

    async def _settled(self) -> None:
        await self._loop.idle()
        await self.store.settle()

    def statistics(self) -> Dict[str, float]:
        """This tier's counters plus the chunk tier's (records, bytes, corrupt, evictions, ...)."""
        stats = {f"vllm_{k}": float(v) for k, v in self.counters.items()}
        stats.update({f"vllm_{k}": float(v) for k, v in self.tier_hits.items()})
        stats.update(self.store.statistics())
        stats["indexed_chunks"] = float(len(self._index))
        return stats

    def index_contains(self, key: OffloadKey) -> bool:
        """Whether ``lookup`` would find ``key`` in the index (tests and tools)."""
        chunk_keys = self._chunk_keys([key])
        return chunk_keys is not None and chunk_keys[0] in self._index

    def run_on_loop(self, coro: Any) -> Any:
        """Run a coroutine on kvtier's loop and wait (tools and tests, never from a scheduler step)."""
        return self._loop.run(coro, self.config.op_timeout_s)
