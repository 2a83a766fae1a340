"""The fast mode of ``kvtier replay``: the engine's cache decisions over byte costs, no bytes moved.

Primitives: ``Outcome`` (per request: hit tokens and bytes read per tier; per tier: chunks and
bytes stored, evicted, read), ``simulate_engine`` (kvtier's host slab pools and LMDB disk LRU,
decision for decision), ``simulate_lru`` (a plain reference LRU: one cache, the same chunks and
byte costs), ``simulate_belady`` (the offline bound: evict the chunk whose next use is farthest),
``POLICIES`` / ``policy_class`` / ``split_policy`` (eviction policies by name, each also as
``NAME+seen``: the same eviction with the disk writes admitted by ``tiers.admission``'s ``seen``).
Pure; any thread.

Every run uses the engine's own policy code: ``longest_hit`` over chunk states, the load plan and
the retention store plan (``Plans``). What ``simulate_engine`` models, as the engine does it with
its work flushed after every request (the way engine mode replays):

- host: one pool per group (``host_slots``); a store takes slots for the chunks that are neither on
  the host nor on disk, all or nothing (more than a pool holds, or more than
  ``store_queue_max_chunks``: the store is dropped); a load pins its host chunks, promotes the
  disk-only ones into new slots and touches them all, in windows of half a pool, holding the hit's
  host-only chunks from its start;
- a store skips the chunks the host or the disk holds; one on the host alone (the disk evicted it)
  counts as a use on the host, so it stays as long as the chunks stored with it;
- disk: every stored chunk is written behind in batches (``spill_batch_max_*``); the LMDB tier's
  byte index (``tiers.lru``: LRU, or LFU-DA under ``lfuda``) counts record bytes, keeps the batch
  being written, and sees each use as a touch: a
  disk read, and (after the window's promotions) a chunk the load served from the host that the
  disk also holds (``ChunkTier.touch_many``), so a chunk hot on the host does not age out below.
  The tier applies uses at its next write or on a timer; engine mode flushes them after each
  load, so both orders agree;
- a chunk evicted from disk stays on the host until evicted there; lookups see both;
- admission (``NAME+seen``): of a store's new chunks, the disk is written only those the
  engine's own admission object (``tiers.admission``) admits, decided as the store is scheduled;
  the others stay on the host only until a load hits them there: then, after its last window
  (and its touches), the load writes the host-only chunks its windows served to disk, as the
  engine's load path hands them to the spill; engine mode waits for that spill before the store.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Set

import numpy as np

from kvtier.policy import ChunkState, ModelLayout, longest_hit
from kvtier.tiers.admission import AdmitAll, make_admission, tier_chunks
from kvtier.tiers.eviction import eviction_policy_names, make_eviction_policy
from kvtier.tiers.lru import BYTE_INDEX_NAMES, ByteLru, make_byte_index

from .workload import Plans, Workload

__all__ = ["Outcome", "TierCounts", "simulate_engine", "simulate_lru", "simulate_belady", "POLICIES",
           "policy_class", "split_policy", "engine_default_policy", "HostOrder"]

_READY = ChunkState.READY
_MISSING = ChunkState.MISSING



def _hit_tokens(layout: ModelLayout, ids: Sequence[Any], n: int, held: Callable[[int, Any], bool]) -> int:
    """The longest hit of a request of ``n`` tokens whose chunk keys are ``ids[g]`` per group;
    ``held(g, key)`` says whether the simulated cache holds that chunk. The last token is never a
    hit (it must be computed to produce the next one)."""

    def state(g: int, c: int) -> ChunkState:
        group_ids = ids[g]
        return _READY if c < len(group_ids) and held(g, group_ids[c]) else _MISSING

    return longest_hit(layout, max(0, n - 1), state) or 0


@dataclass
class TierCounts:
    stored_chunks: int = 0
    stored_bytes: int = 0
    evicted_chunks: int = 0
    evicted_bytes: int = 0
    read_chunks: int = 0
    read_bytes: int = 0

    def as_dict(self) -> Dict[str, int]:
        return dict(vars(self))

    def evicted(self, size: int) -> None:
        """Count one chunk of ``size`` bytes evicted."""
        self.evicted_chunks += 1
        self.evicted_bytes += size


@dataclass
class Outcome:
    """What one replay did: per request (arrays in trace order) and per tier."""

    mode: str
    hit_tokens: np.ndarray
    input_tokens: np.ndarray
    read_bytes: Dict[str, np.ndarray]  # tier -> bytes read per request
    stored_bytes: np.ndarray  # bytes newly stored per request (first tier)
    tiers: Dict[str, TierCounts] = field(default_factory=dict)
    dropped_stores: Dict[str, int] = field(default_factory=dict)
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = int(self.input_tokens.sum())
        return float(self.hit_tokens.sum()) / total if total else 0.0


class HostOrder:
    """One host pool's eviction as the engine decides it: the engine's own policy object
    (``tiers.eviction``), with chunk ids for slots and for content keys; ``victims(n, exclude)``
    evicts (and forgets) ``n`` chunks not in ``exclude``, as ``HostSlabPool.allocate`` does."""

    def __init__(self, name: str, capacity: int) -> None:
        self.policy = make_eviction_policy(name, max(1, capacity))

    def __contains__(self, key: int) -> bool:
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def insert(self, key: int, speculative: bool = False) -> None:
        self.policy.insert(key, key=key, speculative=speculative)

    def touch(self, key: int) -> None:
        self.policy.touch(key)

    def victims(self, n: int, exclude: Iterable[int] = ()) -> List[int]:
        exclude = set(exclude)
        return self.policy.evictable_victims(n, lambda key: key not in exclude) or []


# Each eviction policy alone (every stored chunk written to disk) and with ``seen`` admission.
ADMITTED = "+seen"
POLICIES = eviction_policy_names() + tuple(name + ADMITTED for name in eviction_policy_names())


def split_policy(name: str) -> tuple:
    """(eviction policy, disk admission) of a ``--policy`` name: ``lru+seen`` -> (``lru``,
    ``seen``), ``lru`` -> (``lru``, ``all``). An unknown name lists the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"--policy {name!r} is unknown; valid: {', '.join(POLICIES)}")
    if name.endswith(ADMITTED):
        return name[: -len(ADMITTED)], "seen"
    return name, "all"


def engine_default_policy() -> str:
    """The ``--policy`` name of ``EngineConfig``'s defaults (host eviction, disk admission), so
    that a replay without ``--policy`` measures the engine as it ships."""
    from kvtier.engine import EngineConfig

    defaults = EngineConfig()
    name = defaults.host_policy() + (ADMITTED if defaults.disk_admission == "seen" else "")
    eviction, _ = split_policy(name)
    if (eviction if eviction in BYTE_INDEX_NAMES else "lru") != defaults.eviction_policy:
        raise RuntimeError(f"EngineConfig's defaults (host {defaults.host_policy()!r}, disk {defaults.eviction_policy!r}) "
                           "have no --policy name")
    return name


def policy_class(name: str) -> Callable[[int], HostOrder]:
    """The host eviction policy of ``name`` (a pool's capacity -> its order); an unknown name lists
    the valid ones."""
    eviction, _ = split_policy(name)
    return lambda capacity: HostOrder(eviction, capacity)


def _step(hit: int, tiers: Dict[str, TierCounts]) -> tuple:
    """One request's trail for ``steps``: its hit and every tier's running counts."""
    return (int(hit),) + tuple(tuple(vars(tiers[name]).values()) for name in sorted(tiers))


def _new_counts(names: Sequence[str]) -> Dict[str, TierCounts]:
    return {name: TierCounts() for name in names}


def simulate_engine(work: Workload, plans: Plans, *, host_slots: Sequence[int], chunk_bytes: Sequence[int],
                    disk_capacity: Optional[int], disk_record_bytes: Sequence[int], has_disk: bool = True,
                    spill_chunk_bytes: Optional[Sequence[int]] = None,
                    policy: str = "lru", disk_policy: Optional[str] = None, store_queue_max_chunks: int = 4096, spill_batch_max_chunks: int = 256,
                    spill_batch_max_bytes: int = 64 << 20, progress: Optional[Callable[[int], None]] = None,
                    steps: Optional[list] = None) -> Outcome:
    """Replay ``work`` through a model of the engine (see the module docstring). ``host_slots[g]``
    slots of ``chunk_bytes[g]`` per group; a disk tier (``has_disk``) of ``disk_capacity`` record
    bytes (``None``: unbounded) counting ``disk_record_bytes[g]`` per chunk. Bytes are reported
    at ``chunk_bytes[g]`` per chunk; spill batches are cut at ``spill_chunk_bytes`` (the engine's
    payloads, default ``chunk_bytes``). ``steps`` (a list)
    receives each request's hit and running tier counts, to find where two runs part."""
    layout = plans.layout
    num_groups = len(layout.groups)
    order_class = policy_class(policy)
    eviction, admission_name = split_policy(policy)
    host = [order_class(slots) for slots in host_slots]
    disk: ByteLru[Hashable] = make_byte_index(disk_policy if disk_policy is not None else
                           (eviction if eviction in BYTE_INDEX_NAMES else "lru"))

    disk_capacity_bytes = disk_capacity
    disk_group: Dict[Hashable, int] = {}  # chunk id -> group, for what the byte index holds
    tiers = _new_counts(("host", "disk") if has_disk else ("host",))
    # Without a disk tier nothing is written or promoted, so its counts stay zero and unreported.
    hcount, dcount = tiers["host"], tiers["disk"] if has_disk else TierCounts()
    dropped = {"host_full": 0, "queue_full": 0, "tier_full": 0}
    not_admitted = 0  # new chunks the disk admission kept on the host only
    failed_loads = 0
    caps = [max(1, s // 2) for s in host_slots]
    spill_sizes = list(chunk_bytes if spill_chunk_bytes is None else spill_chunk_bytes)
    # As the engine counts it (its payload sizes); it admits every write to an unbounded disk.
    admission = (make_admission(admission_name, *tier_chunks(host_slots, disk_capacity, spill_sizes))
                 if has_disk and disk_capacity is not None else AdmitAll())
    write_back = not isinstance(admission, AdmitAll)
    n_req = len(work)
    hits = np.zeros(n_req, dtype=np.int64)
    read_host = np.zeros(n_req, dtype=np.int64)
    read_disk = np.zeros(n_req, dtype=np.int64)
    stored = np.zeros(n_req, dtype=np.int64)

    def evict_host(g: int, count: int, exclude) -> None:
        for key in host[g].victims(count, exclude):
            hcount.evicted(chunk_bytes[g])

    def write(batch: List[tuple]) -> None:
        batch_bytes = sum(disk_record_bytes[g] for g, _ in batch)
        cap = disk_capacity_bytes
        if cap is not None and batch_bytes > cap:
            dropped["tier_full"] += len(batch)  # TierFullError: the chunks stay on the host only
            return
        if cap is not None:
            excess = disk.total_bytes + batch_bytes - cap
            # The batch fits the capacity, so every other record together frees enough.
            victims = disk.choose_victims(excess, {key for _, key in batch})
            assert victims is not None, "a batch within the capacity always finds its victims"
            for key, _ in victims:
                disk.pop(key)
                dcount.evicted(chunk_bytes[disk_group.pop(key)])
        for g, key in batch:
            disk.put(key, disk_record_bytes[g])
            disk_group[key] = g
            dcount.stored_chunks += 1
            dcount.stored_bytes += chunk_bytes[g]

    def spill(jobs: List[tuple]) -> None:
        """Write (group, key) jobs to disk in the spill pipeline's batches."""
        batch: List[tuple] = []
        batch_bytes = 0
        for g, key in jobs:
            size = spill_sizes[g]
            if batch and (len(batch) >= spill_batch_max_chunks or batch_bytes + size > spill_batch_max_bytes):
                write(batch)
                batch, batch_bytes = [], 0
            batch.append((g, key))
            batch_bytes += size
        write(batch)

    for r in range(n_req):
        ids = work.ids[r]
        n = work.tokens[r]

        hit = _hit_tokens(layout, ids, n, lambda g, key: key in host[g] or key in disk)
        hits[r] = hit
        if hit:
            jobs = [(g, key) for g in range(num_groups) for key in ids[g].take(plans.load(g, hit))]
            # The engine's windows: a new one as soon as a group has half its slots in this one.
            windows: List[List[tuple]] = []
            current: List[tuple] = []
            counts = [0] * num_groups
            for job in jobs:
                if counts[job[0]] >= caps[job[0]]:
                    windows.append(current)
                    current, counts = [], [0] * num_groups
                current.append(job)
                counts[job[0]] += 1
            windows.append(current)
            # The load holds the hit's host-only chunks from its start: no window evicts them.
            held: List[Set[int]] = [set() for _ in range(num_groups)]
            served_host_only: List[tuple] = []  # written to disk once the windows are done
            for g, key in jobs:
                if key in host[g] and key not in disk:
                    held[g].add(key)
            for window in windows:
                pinned: List[Set[int]] = [set() for _ in range(num_groups)]  # served from the host
                promote: List[List[int]] = [[] for _ in range(num_groups)]
                for g, key in window:
                    (pinned[g].add(key) if key in host[g] else promote[g].append(key))
                kept = [pinned[g] | held[g] for g in range(num_groups)]
                wanted = [len(host[g]) + len(promote[g]) - host_slots[g] for g in range(num_groups)]
                if any(wanted[g] > len(host[g]) - len(kept[g]) for g in range(num_groups) if promote[g]):
                    # Too few unpinned slots for the window's promotions: the load fails
                    # ("host_full") before this window changes anything, and the prompt is prefilled.
                    hits[r] = 0
                    failed_loads += 1
                    break
                for g in range(num_groups):
                    if promote[g]:
                        if wanted[g] > 0:
                            evict_host(g, wanted[g], kept[g])
                        for key in promote[g]:
                            host[g].insert(key)
                            disk.touch(key)
                            read_disk[r] += chunk_bytes[g]
                            dcount.read_chunks += 1
                            dcount.read_bytes += chunk_bytes[g]
                            hcount.stored_chunks += 1  # a promotion fills a host slot too
                            hcount.stored_bytes += chunk_bytes[g]
                    read_host[r] += len(pinned[g]) * chunk_bytes[g]
                    hcount.read_chunks += len(pinned[g])
                    hcount.read_bytes += len(pinned[g]) * chunk_bytes[g]
                for g, key in window:  # served from the host, still a use the disk's index hears of
                    if key in pinned[g] and key in disk:
                        disk.touch(key)
                for g, key in window:
                    host[g].touch(key)
                served_host_only.extend((g, key) for g, key in window if key in pinned[g] and key not in disk)
            if write_back and served_host_only:  # a host-only chunk a load hit has proved reuse
                spill(served_host_only)
        new = []
        for g in range(num_groups):
            for key in ids[g].take(plans.store(g, n)):
                if key not in host[g]:
                    if key not in disk:
                        new.append((g, key))
                elif has_disk and key not in disk:
                    host[g].touch(key)  # on the host alone: the store is a use there
        if new:
            need = [0] * num_groups
            for g, _ in new:
                need[g] += 1
            if len(new) > store_queue_max_chunks:
                dropped["queue_full"] += len(new)
                new = []
            elif any(need[g] > host_slots[g] for g in range(num_groups)):
                dropped["host_full"] += len(new)
                new = []
        if new:
            for g in range(num_groups):
                shortfall = len(host[g]) + need[g] - host_slots[g]
                if need[g] and shortfall > 0:
                    evict_host(g, shortfall, ())
            speculative = {key for g in range(num_groups) for key in ids[g].take(plans.speculative(g, n))}
            for g, key in new:
                host[g].insert(key, key in speculative)
                hcount.stored_chunks += 1
                hcount.stored_bytes += chunk_bytes[g]
                stored[r] += chunk_bytes[g]
            if has_disk:
                admitted = admission.decide([key for _, key in new])
                not_admitted += admitted.count(False)
                spill([job for job, admit in zip(new, admitted) if admit])
        if progress is not None:
            progress(1)
        if steps is not None:
            steps.append(_step(hits[r], tiers))
    read = {"host": read_host}
    if has_disk:
        read["disk"] = read_disk
    return Outcome("simulate", hits, np.asarray(work.tokens, dtype=np.int64), read, stored, tiers,
                   {k: v for k, v in dropped.items() if v}, {"failed_loads": failed_loads, "not_admitted": not_admitted})


def _single_tier(work: Workload, plans: Plans):
    """(layout, groups, requests, hits, bytes read, bytes stored, counts) of a one-cache run."""
    layout = plans.layout
    n_req = len(work)
    return (layout, len(layout.groups), n_req, np.zeros(n_req, dtype=np.int64), np.zeros(n_req, dtype=np.int64),
            np.zeros(n_req, dtype=np.int64), TierCounts())


def _single_tier_outcome(mode: str, work: Workload, hits: np.ndarray, read: np.ndarray, stored: np.ndarray,
                         counts: TierCounts) -> Outcome:
    """The ``Outcome`` of a one-cache run (the tier is named ``cache``), its byte totals counted."""
    counts.read_bytes = int(read.sum())
    counts.stored_bytes = int(stored.sum())
    return Outcome(mode, hits, np.asarray(work.tokens, dtype=np.int64), {"cache": read}, stored, {"cache": counts})


def simulate_lru(work: Workload, plans: Plans, *, chunk_bytes: Sequence[int], capacity: Optional[int]) -> Outcome:
    """The reference: one LRU cache of ``capacity`` payload bytes over the chunks the store plan
    stores; a hit touches the chunks it reads, then the new chunks go in and the oldest go out."""
    layout, num_groups, n_req, hits, read, stored, counts = _single_tier(work, plans)
    cache: "OrderedDict[int, int]" = OrderedDict()
    total = 0
    for r in range(n_req):
        ids = work.ids[r]
        n = work.tokens[r]

        hit = _hit_tokens(layout, ids, n, lambda g, key: key in cache)
        hits[r] = hit
        if hit:
            for g in range(num_groups):
                for key in ids[g].take(plans.load(g, hit)):
                    cache.move_to_end(key)
                    read[r] += chunk_bytes[g]
        for g in range(num_groups):
            for key in ids[g].take(plans.store(g, n)):
                if key not in cache:
                    cache[key] = chunk_bytes[g]
                    total += chunk_bytes[g]
                    stored[r] += chunk_bytes[g]
        while capacity is not None and total > capacity:
            _, size = cache.popitem(last=False)
            total -= size
            counts.evicted(size)
    return _single_tier_outcome("reference-lru", work, hits, read, stored, counts)


def _next_uses(work: Workload, plans: Plans) -> List[Dict[int, int]]:
    """Per request, the chunk ids it holds -> the index of the next request that may read them
    (``len(work) + 1``: never again). A request may read the chunks of a full-attention group that
    end before its last token (a hit never covers the last token; the chunk holding it is still
    stored) and, of a sliding group, the chunks its dense store plan holds (every alignment
    boundary's window): a hit at another boundary is not foreseen, so the bound errs low there."""
    dense = Plans(work.layout, None)
    never = len(work) + 1
    following: Dict[int, int] = {}
    out: List[Dict[int, int]] = [dict() for _ in range(len(work))]
    groups = plans.layout.groups
    for r in range(len(work) - 1, -1, -1):
        n = work.tokens[r]
        mine = out[r]
        readable: List[int] = []
        for g, group in enumerate(groups):
            ids = work.ids[r][g]
            if group.sliding_window is None:
                held = ids.take(range(len(ids)))
                readable.extend(held[: max(0, n - 1) // group.tokens_per_chunk])
            else:
                held = ids.take(sorted(set(dense.store(g, n)) | set(plans.store(g, n))))
                readable.extend(held)
            for key in held:
                mine[key] = following.get(key, never)
        for key in readable:
            following[key] = r
    return out


def simulate_belady(work: Workload, plans: Plans, *, chunk_bytes: Sequence[int], capacity: Optional[int]) -> Outcome:
    """The offline bound over the same chunks and costs: after each request, while over
    ``capacity``, evict the chunk whose next use is farthest (a new chunk not used again goes first:
    the bound may decline to keep it); at equal next use the deeper chunk goes first. A chunk is
    never used later than its parent (every request holding it holds the parent), so with that
    tie-break the cache stays closed under parents and every chunk it keeps can count in a hit."""
    layout, num_groups, n_req, hits, read, stored, counts = _single_tier(work, plans)
    nexts = _next_uses(work, plans)
    cache: Dict[int, int] = {}  # key -> next use
    size_of: Dict[int, int] = {}
    depth_of: Dict[int, int] = {}  # key -> its chunk index in the requests that hold it
    heap: List[tuple] = []
    total = 0
    for r in range(n_req):
        ids = work.ids[r]
        n = work.tokens[r]
        upcoming = nexts[r]

        hit = _hit_tokens(layout, ids, n, lambda g, key: key in cache)
        hits[r] = hit
        if hit:
            for g in range(num_groups):
                read[r] += len(plans.load(g, hit)) * chunk_bytes[g]
        for key in cache.keys() & upcoming.keys() if len(cache) < len(upcoming) else upcoming.keys() & cache.keys():
            when = upcoming[key]
            cache[key] = when
            heapq.heappush(heap, (-when, -depth_of[key], key))
        for g in range(num_groups):
            positions = plans.store(g, n)
            for depth, key in zip(positions, ids[g].take(positions)):
                if key not in cache:
                    when = upcoming[key]
                    cache[key] = when
                    size_of[key] = chunk_bytes[g]
                    depth_of[key] = int(depth)
                    total += chunk_bytes[g]
                    stored[r] += chunk_bytes[g]
                    heapq.heappush(heap, (-when, -int(depth), key))
        while capacity is not None and total > capacity:
            negative, _, key = heapq.heappop(heap)
            if cache.get(key) != -negative:
                continue  # a stale entry: the key was used again (or evicted) since
            del cache[key]
            del depth_of[key]
            size = size_of.pop(key)
            total -= size
            counts.evicted(size)
    return _single_tier_outcome("belady", work, hits, read, stored, counts)
