"""``KvtierHiCacheStorage``: kvtier's LMDB tier as SGLang's HiCache L3 storage backend.

SGLang loads it with ``--hicache-storage-backend dynamic`` and, in
``--hicache-storage-backend-extra-config``, ``backend_name`` / ``module_path`` /
``class_name`` (its ``StorageBackendFactory`` calls ``KvtierHiCacheStorage(storage_config,
kwargs)``), plus this backend's keys (``config.SglangStorageConfig``; ``cache_dir`` is required).
It serves every interface HiCache calls: v0 (``get`` / ``set`` / ``exists`` and their batches, on
page tensors), v1 (``batch_get_v1`` / ``batch_set_v1`` over the registered KV host pool, with
``"interface_v1": 1``) and v2 (``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` over every
registered host pool: kv, swa, mamba, draft, the DeepSeek-V4 pools: any pool with SGLang's page
accessors).

Threads: SGLang calls from its storage threads (prefetch, backup, hit query) and waits for each
answer. Each call computes keys on the caller's thread, hands one coroutine to kvtier's loop thread
(``_LoopThread``) and waits at most ``op_timeout_s``; the LMDB tier's own threads do the I/O. Bytes
never travel between the tier and SGLang's host pool while SGLang is not waiting: a write copies
each page out of the host pool before the hop (``get_data_page`` already copies most layouts) and a
read decodes into pages of its own (``get_dummy_flat_data_page``) that the caller's thread copies into
the host pool (``set_from_flat_data_page``) only after the read returned in time. A call past its
bound answers "not stored" / "not loaded"; its work finishes in the background into those private
pages.

Answers: a page is a hit only when its record is in the tier's index; ``batch_exists_v2`` folds the
pools' presence with ``hits.restorable_prefixes`` (SGLang's own fold, on kvtier's coverage math). A
record damaged after it was written is found by its checksum when read: that page answers False
(SGLang recomputes it), the tier quarantines the record, and no later query reports it. No call
raises into SGLang's controller: every failure (the tier's, a foreign one, a timeout) is a miss or
a failed store, counted in ``statistics()`` and logged.

Keys: ``keys.PoolBinding`` per registered pool (model, weights version, shard, the pool's layout),
``keys.PageKeys`` per binding; every record's fingerprint is its pool's namespace, checked on read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Coroutine, Dict, Hashable, List, Optional, Sequence, Tuple, TypeVar

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.engine.store import DiskStore
from kvtier.tiers.base import ChunkMeta, ChunkTier
from kvtier.tiers.chain import tier_statistics_dict
from kvtier.tiers.record_format import element_size

from .config import SglangStorageConfig
from .hits import PoolQuery, restorable_prefixes
from .keys import PageKeys, PoolBinding

__all__ = ["KvtierHiCacheStorage", "open_page_store"]

logger = logging.getLogger("kvtier.integrations.sglang")


class _LoopThread:
    """kvtier's event loop on a daemon thread of its own, where the tier lives; SGLang's threads
    wait on it with a bound (``run``). The vLLM tier's ``LoopThread`` is the same idea, but importing
    it imports vLLM (its package does), which an SGLang server need not have."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvtier-sglang-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``coro`` on the loop, waited for at most ``timeout_s`` (any thread but the loop's); on
        timeout it is cancelled (the tier's work already handed over still finishes) and
        ``TimeoutError`` raised."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        done, _ = concurrent.futures.wait([future], timeout_s)
        if not done:
            future.cancel()
            raise TimeoutError(f"kvtier: no answer within {timeout_s} s")
        return future.result()

    def stop(self, timeout_s: float) -> None:
        """Stop the loop after what was already handed to it, join the thread, close the loop."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("kvtier: the SGLang backend's loop thread did not stop within %s s", timeout_s)
        else:
            self.loop.close()

T = TypeVar("T")
# Pools whose bytes are sharded by tensor-parallel rank even in a rank-replicated (MLA) model.
_TP_SHARDED_POOLS = frozenset({PoolName.MAMBA.value})
_DRAFT_POOLS = frozenset({PoolName.DRAFT.value, PoolName.DRAFT_SWA.value})
_POOL_ORDER = {p.value: i for i, p in enumerate(PoolName)}
# Keys whose last read failed, remembered until a store rewrites them (bounded: oldest forgotten).
_MAX_UNREADABLE_KEYS = 1 << 16


async def open_page_store(config: SglangStorageConfig) -> DiskStore:
    """The backend's store, opened as the engine and the vLLM tier open theirs (``DiskStore``: a
    verified open, a damaged directory moved aside and replaced when ``quarantine_corrupt_cache_dir``,
    the remote tier chained behind when ``remote_url`` is set). No store-wide fingerprint: each pool
    has its own layout, and a page's key binds the model and its pool (``keys.py``)."""
    return await DiskStore.open(config.store_config(), fingerprint=None)


def _dtype_name(tensor: torch.Tensor) -> str:
    """The record's dtype: the page's own (byte planes compress by element) when the record
    format knows it, else raw bytes."""
    name = str(tensor.dtype).removeprefix("torch.")
    try:
        element_size(name)
    except ValueError:
        return "uint8"
    return name


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous tensor (shares its memory)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _private_page(page: torch.Tensor) -> torch.Tensor:
    """``page`` flat and in memory of its own: a view into the host pool is copied, so SGLang may
    reuse the slot as soon as the call returns, even one that timed out."""
    flat = page.reshape(-1)
    return flat.clone() if flat._base is not None else flat


class _Page:
    """One page of one call: its key, its record meta, and the tensor the bytes come from or land
    in (private: see the module docstring); ``host_index`` where it goes in the host pool."""

    __slots__ = ("key", "meta", "tensor", "pool", "host_index")

    def __init__(self, key: bytes, meta: ChunkMeta, tensor: torch.Tensor, pool: Any = None,
                 host_index: Optional[int] = None) -> None:
        self.key, self.meta, self.tensor, self.pool, self.host_index = key, meta, tensor, pool, host_index


class KvtierHiCacheStorage(HiCacheStorage):
    """kvtier's HiCache L3 backend (see the module docstring). Every public method may be called
    from any SGLang thread and returns within ``op_timeout_s`` (the constructor within
    ``open_timeout_s``)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.config = SglangStorageConfig.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        self.registered_pools: Dict[Any, Any] = {}
        self.counters: Counter = Counter()
        self._keys: Dict[str, Tuple[Any, PageKeys, torch.dtype]] = {}
        self._closed = False
        self._logged: set = set()
        # A record that failed its read (corrupt, of another binding) stays in the tier's index
        # until the tier's writer quarantines it; meanwhile no query reports it and a store
        # rewrites it. Any thread; guarded by the lock.
        self._unreadable: "OrderedDict[bytes, None]" = OrderedDict()
        self._unreadable_lock = threading.Lock()
        self._loop = _LoopThread()
        try:
            self._disk_store = self._loop.run(open_page_store(self.config), self.config.open_timeout_s)
            tier = self._disk_store.tier
            assert tier is not None, "a store with a cache_dir always has a tier"
            self._tier: ChunkTier = tier
            self.quarantined_cache_dir = self._disk_store.quarantined_cache_dir
        except BaseException:
            self._loop.stop(self.config.op_timeout_s)
            raise

    # ------------------------------------------------------------------ keys and pools

    def _pool(self, name: Hashable) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None and str(name) == PoolName.KV.value:
            pool = self.mem_pool_host
        return pool

    def _shard(self, name: str, pool: Any) -> str:
        c = self.storage_config
        replicated = c.is_mla_model and name not in _TP_SHARDED_POOLS
        if replicated and name in _DRAFT_POOLS:
            # An MHA drafter on an MLA target holds rank-sharded heads; only MLA-like drafts replicate.
            replicated = any(tag in type(pool).__name__ for tag in ("MLA", "DeepSeekV4"))
        parts = [] if replicated else [f"tp{c.tp_rank}/{c.tp_size}"]
        if c.pp_size > 1:
            parts.append(f"pp{c.pp_rank}/{c.pp_size}")
        if c.attn_cp_size > 1:
            parts.append(f"cp{c.attn_cp_rank}/{c.attn_cp_size}")
        if c.dcp_size > 1:
            parts.append(f"dcp{c.dcp_rank}/{c.dcp_size}/page{c.logical_page_size}")
        return ",".join(parts)

    def _page_keys(self, name: Hashable) -> Optional[Tuple[Any, PageKeys, torch.dtype]]:
        """(host pool, its ``PageKeys``, its page dtype) of pool ``name``, bound once per registered
        pool object; None for a pool not registered."""
        pool = self._pool(name)
        if pool is None:
            return None
        label = str(name)
        cached = self._keys.get(label)
        if cached is not None and cached[0] is pool:
            return cached
        page = pool.get_dummy_flat_data_page()
        binding = PoolBinding(
            model=self.storage_config.model_name or "", weights_version=self.config.weights_version, pool=label,
            pool_class=type(pool).__name__, layout=str(getattr(pool, "layout", "")), dtype=str(page.dtype),
            page_size=int(pool.page_size or 1), page_numel=int(page.numel()),
            page_bytes=int(page.numel() * page.element_size()),
            format_tag=getattr(pool, "storage_format_tag", None), shard=self._shard(label, pool))
        entry = (pool, PageKeys(binding, self.config.tenant_salt), page.dtype)
        self._keys[label] = entry
        return entry

    @staticmethod
    def _meta(keys: PageKeys, name: str, tensor: torch.Tensor) -> ChunkMeta:
        dtype = _dtype_name(tensor)
        count = tensor.numel() if dtype != "uint8" else tensor.numel() * tensor.element_size()
        return ChunkMeta(fingerprint=keys.namespace, group_index=_POOL_ORDER.get(name, 255), chunk_index=0,
                         dtype=dtype, shape=(int(count),))

    # ------------------------------------------------------------------ the one hop to the tier

    def _run(self, what: str, make: Callable[[], Coroutine[Any, Any, T]], default: T) -> T:
        """``make()`` on the loop, waited for at most ``op_timeout_s``; ``default`` on any failure."""
        if self._closed:
            self.counters[f"{what}_refused_closed"] += 1
            return default
        try:
            return self._loop.run(make(), self.config.op_timeout_s)
        except TimeoutError:
            self.counters[f"{what}_timeouts"] += 1
            self._log_once(f"{what}-timeout", "kvtier: %s took longer than op_timeout_s=%s s: answered as a miss "
                           "(the I/O finishes in the background)", what, self.config.op_timeout_s)
        except Exception as exc:  # every failure, kvtier's or foreign, is a miss, never an exception into SGLang
            self.counters[f"{what}_failures"] += 1
            self._log_once(f"{what}-{type(exc).__name__}", "kvtier: %s failed: %s: %s", what, type(exc).__name__, exc)
        return default

    def _log_once(self, tag: str, message: str, *args: Any) -> None:
        level = logging.DEBUG if tag in self._logged else logging.WARNING
        self._logged.add(tag)
        logger.log(level, message, *args)

    def _contains(self, keys: List[bytes]) -> List[bool]:
        if not keys:
            return []
        present = self._run("exists", lambda: self._tier.contains_many(keys), [False] * len(keys))
        with self._unreadable_lock:
            if self._unreadable:
                present = [here and key not in self._unreadable for key, here in zip(keys, present)]
        return present

    def _mark_unreadable(self, keys: List[bytes]) -> None:
        with self._unreadable_lock:
            for key in keys:
                self._unreadable[key] = None
                self._unreadable.move_to_end(key)
            while len(self._unreadable) > _MAX_UNREADABLE_KEYS:
                self._unreadable.popitem(last=False)

    def _mark_readable(self, keys: List[bytes]) -> None:
        with self._unreadable_lock:
            for key in keys:
                self._unreadable.pop(key, None)

    def _load(self, pages: Sequence[_Page]) -> List[bool]:
        """Read ``pages`` into their tensors; True where the record was there, intact and of this
        binding (the tensors of the others are unspecified)."""
        if not pages:
            return []

        async def read() -> Tuple[List[bool], List[bytes]]:
            metas = await self._tier.get_many_into([(p.key, _bytes_of(p.tensor)) for p in pages])
            ok = [m is not None and (m.fingerprint, m.dtype, tuple(m.shape)) ==
                  (p.meta.fingerprint, p.meta.dtype, p.meta.shape) for m, p in zip(metas, pages)]
            failed = [p.key for p, loaded in zip(pages, ok) if not loaded]
            # Failed but still indexed: corrupt (its quarantine is on its way) or of another binding.
            still = await self._tier.contains_many(failed) if failed else []
            return ok, [key for key, here in zip(failed, still) if here]

        answer = self._run("load", read, None)
        if answer is None:  # the call failed or timed out: nothing is known of the records
            ok = [False] * len(pages)
        else:
            ok, unreadable = answer
            self._mark_unreadable(unreadable)
        self.counters["pages_loaded"] += sum(ok)
        self.counters["pages_load_missed"] += len(ok) - sum(ok)
        return ok

    def _store(self, pages: Sequence[_Page]) -> List[bool]:
        """Write the pages not stored yet, all or nothing, durable when True."""
        if not pages:
            return []

        with self._unreadable_lock:
            rewrite = {p.key for p in pages if p.key in self._unreadable}

        async def write() -> List[bool]:
            present = await self._tier.contains_many([p.key for p in pages])
            todo = [p for p, here in zip(pages, present) if not here or p.key in rewrite]
            if todo:
                await self._tier.put_many([(p.key, p.meta, _bytes_of(p.tensor)) for p in todo])
            self.counters["pages_stored"] += len(todo)
            return [True] * len(pages)

        ok = self._run("store", write, [False] * len(pages))
        if rewrite and all(ok):
            self._mark_readable(list(rewrite))
        self.counters["pages_store_failed"] += len(ok) - sum(ok)
        return ok

    # ------------------------------------------------------------------ pages of host pools

    def _host_pages(self, name: Hashable, page_hashes: Sequence[str], host_indices: Optional[torch.Tensor],
                    *, reading: bool) -> Optional[List[_Page]]:
        """One ``_Page`` per hash of pool ``name`` at its host slot; None when the pool is not
        registered or the indices do not match the keys (SGLang's own backends then fail every key)."""
        bound = self._page_keys(name)
        if bound is None:
            self.counters["unregistered_pool_calls"] += 1
            self._log_once(f"unregistered-{name}", "kvtier: pool %s is not registered: its pages miss", name)
            return None
        pool, keys, dtype = bound
        page_size = int(pool.page_size or 1)
        if host_indices is None or host_indices.numel() != len(page_hashes) * page_size:
            self.counters["index_mismatches"] += 1
            self._log_once(f"mismatch-{name}", "kvtier: pool %s: %d keys but %s host indices", name,
                           len(page_hashes), None if host_indices is None else host_indices.numel())
            return None
        starts = host_indices.reshape(-1)[::page_size].tolist()
        label = str(name)
        pages = []
        for page_hash, start in zip(page_hashes, starts):
            # A plain (unpinned) page to decode into: the pool's own dummy page may be pinned memory.
            tensor = (torch.empty(keys.binding.page_numel, dtype=dtype) if reading
                      else _private_page(pool.get_data_page(start, flat=True)))
            pages.append(_Page(keys.page_key(page_hash), self._meta(keys, label, tensor), tensor, pool, start))
        return pages

    def _transfer(self, requests: Sequence[Tuple[Hashable, Sequence[str], Optional[torch.Tensor]]],
                  *, reading: bool) -> List[List[bool]]:
        """Read (into the host pools) or write (from them) every request's pages in one hop."""
        groups: List[Optional[List[_Page]]] = [self._host_pages(n, h, i, reading=reading) for n, h, i in requests]
        # Pages without bytes (a logical anchor) carry nothing to store or load: they succeed.
        flat = [p for g in groups if g for p in g if p.tensor.numel()]
        done = dict(zip(map(id, flat), (self._load if reading else self._store)(flat)))
        results = []
        for (_, hashes, _), group in zip(requests, groups):
            if group is None:
                results.append([False] * len(hashes))
                continue
            oks = [done.get(id(p), True) for p in group]
            if reading:
                for page, ok in zip(group, oks):
                    if ok and page.tensor.numel():
                        page.pool.set_from_flat_data_page(page.host_index, page.tensor)
            results.append(oks)
        return results

    def _anchor_is_logical(self) -> bool:
        pool = self._pool(PoolName.KV)
        return pool is not None and getattr(pool, "kv_buffer", True) is None

    # ------------------------------------------------------------------ v2: the hybrid pools

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The longest KV prefix stored, each pool's verdict by its hit policy and every restorable
        prefix length (``restorable_prefix_pages``), from one index query for all pools."""
        try:
            transfers = list(pool_transfers or [])
            kv_keys = self._page_keys(PoolName.KV)
            logical = self._anchor_is_logical()
            queries: List[Tuple[PoolTransfer, List[bytes]]] = []
            asked: List[bytes] = [] if logical or kv_keys is None else kv_keys[1].page_keys(keys)
            for transfer in transfers:
                bound = self._page_keys(transfer.name)
                queries.append((transfer, [] if bound is None else bound[1].page_keys(keys)))
            present = self._contains(asked + [k for _, ks in queries for k in ks])
            if logical:
                kv_pages = len(keys)
            elif kv_keys is None:
                kv_pages = 0
            else:
                kv_pages = next((i for i, here in enumerate(present[: len(keys)]) if not here), len(keys))
            offset = len(asked)
            pools = []
            for transfer, pool_keys in queries:
                here = present[offset : offset + len(pool_keys)] or [False] * len(keys)
                offset += len(pool_keys)
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                policy = getattr(transfer.hit_policy, "value", transfer.hit_policy)
                pools.append(PoolQuery(transfer.name, str(policy), here, trailing,
                                       int(transfer.group_pages or 0)))
            final, hits, restorable = restorable_prefixes(kv_pages, pools, kv_name=PoolName.KV)
            return PoolTransferResult(final, hits, restorable)
        except Exception as exc:
            self.counters["exists_failures"] += 1
            self._log_once(f"exists-{type(exc).__name__}", "kvtier: batch_exists_v2 failed: %s: %s", type(exc).__name__, exc)
            return PoolTransferResult(0, {}, [])

    def _v2(self, transfers: List[PoolTransfer], *, reading: bool) -> Dict[Any, List[bool]]:
        try:
            requests = [(t.name, list(t.keys or []), t.host_indices) for t in transfers]
            return {t.name: r for t, r in zip(transfers, self._transfer(requests, reading=reading))}
        except Exception as exc:
            what = "load" if reading else "store"
            self.counters[f"{what}_failures"] += 1
            self._log_once(f"v2-{what}-{type(exc).__name__}", "kvtier: batch v2 %s failed: %s: %s", what,
                           type(exc).__name__, exc)
            return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[Any, List[bool]]:
        """Read each transfer's pages into its host pool; per pool, per page: loaded."""
        return self._v2(transfers, reading=True)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[Any, List[bool]]:
        """Write each transfer's pages from its host pool; per pool, per page: durably stored."""
        return self._v2(transfers, reading=False)

    # ------------------------------------------------------------------ v1: the KV host pool

    def _v1(self, keys: List[str], host_indices: torch.Tensor, *, reading: bool) -> List[bool]:
        if self._anchor_is_logical():
            return [True] * len(keys)  # a logical anchor holds no bytes (the v2 side pools do)
        return self._v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=host_indices)],
                        reading=reading)[PoolName.KV]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._v1(keys, host_indices, reading=True)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._v1(keys, host_indices, reading=False)

    # ------------------------------------------------------------------ v0: page tensors

    def _v0_pages(self, keys: Sequence[str], tensors: Sequence[torch.Tensor], *,
                  reading: bool) -> Optional[List[_Page]]:
        """The KV pool's page of each key; its tensor a private copy of ``tensors`` (writes) or a
        private page of the same size and dtype (reads)."""
        bound = self._page_keys(PoolName.KV)
        if bound is None:
            self._log_once("v0-unregistered", "kvtier: no host pool registered: v0 calls miss")
            return None
        page_keys = bound[1]
        pages = []
        for key, given in zip(keys, tensors):
            tensor = torch.empty(given.numel(), dtype=given.dtype) if reading else _private_page(given.contiguous())
            pages.append(_Page(page_keys.page_key(key), self._meta(page_keys, PoolName.KV.value, tensor), tensor))
        return pages

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Each key's page copied into its target tensor (a page of the KV pool when None), or None."""
        try:
            pool = self._pool(PoolName.KV)
            targets = [t if t is not None else pool.get_dummy_flat_data_page()
                       for t in (target_locations or [None] * len(keys))]
            pages = self._v0_pages(keys, targets, reading=True)
            if pages is None:
                return [None] * len(keys)
            out: List[Optional[torch.Tensor]] = []
            for target, page, ok in zip(targets, pages, self._load(pages)):
                if ok:
                    target.copy_(page.tensor.reshape(target.shape))
                out.append(target if ok else None)
            return out
        except Exception as exc:
            self._log_once(f"v0-get-{type(exc).__name__}", "kvtier: batch_get failed: %s: %s", type(exc).__name__, exc)
            return [None] * len(keys)

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        try:
            pages = self._v0_pages(keys, list(values or []), reading=False)
            return pages is not None and len(pages) == len(keys) and all(self._store(pages))
        except Exception as exc:
            self._log_once(f"v0-set-{type(exc).__name__}", "kvtier: batch_set failed: %s: %s", type(exc).__name__, exc)
            return False

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages of ``keys`` are stored in the KV pool."""
        if self._anchor_is_logical():
            return len(keys)
        bound = self._page_keys(PoolName.KV)
        if bound is None:
            return 0
        present = self._contains(bound[1].page_keys(keys))
        return next((i for i, here in enumerate(present) if not here), len(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ lifecycle

    def clear(self) -> bool:
        """Delete every record of the directory (SGLang's clear-storage endpoint)."""

        async def clear_all() -> bool:
            await self._tier.delete_many(await self._tier.list_keys())
            return True

        return self._run("clear", clear_all, False)

    def statistics(self) -> Dict[str, float]:
        """This backend's counters plus the tier's (records, bytes, corrupt, evictions, ...)."""
        stats = {f"sglang_{k}": float(v) for k, v in self.counters.items()}
        stats.update(tier_statistics_dict(self._tier))
        return stats

    def close(self) -> None:
        """Let queued writes land, close the tier, stop the loop. Safe twice; later calls miss."""
        if self._closed:
            return
        try:
            self._loop.run(self._disk_store.close(), self.config.open_timeout_s)
        except Exception as exc:
            logger.warning("kvtier: closing %s failed: %s: %s", self.config.cache_dir, type(exc).__name__, exc)
        finally:
            self._closed = True
            self._loop.stop(self.config.op_timeout_s)
