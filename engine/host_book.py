"""The engine's host-side bookkeeping, with one owner: entries, host pools, pins, fences.

Primitive: ``HostBook`` -- the chunk entries by key, one ``HostSlabPool`` per group, slot
allocation all or nothing across groups, pins, settling and dropping entries, the busy marks that
``fence`` waits on, the chunk counts per state, and ``problems()`` (its own self-check). The
engine builds one and hands it to the store, load and spill paths; they change host state only
through it. Event-loop thread only, except ``state_counts`` and ``slab_bytes`` (exporter and
pressure threads: they read copies).

A pin is counted once, by the slot's pool (``HostSlabPool.pin_count``): an entry holds its slot
from allocation until it is dropped and its last pin goes, so the slot's count is the entry's.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Collection, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from kvtier.errors import KvtierError
from kvtier.policy import ChunkState
from kvtier.tiers.base import ChunkMeta
from kvtier.tiers.host import HostSlabPool

from .disk_index import DiskIndex
from .durable import DurableWatch
from .events import EventLog
from .lifecycle import DURABLE_LATER, EVICTABLE, LOOKUP_STATE, HostState, move
from .metrics import EngineMetrics
from .records import ChunkEntry, RequestKeys

__all__ = ["HostBook"]


class HostBook:
    """Host-side bookkeeping of one engine (see the module docstring).

    ``chunk_nbytes[g]``, ``num_blocks[g]`` and ``metas[g]`` (dtype name, chunk shape) describe
    group ``g`` of the device view; ``pools`` is empty until ``open``."""

    def __init__(self, fingerprint: bytes, chunk_nbytes: Sequence[int], num_blocks: Sequence[int],
                 metas: Sequence[Tuple[str, Tuple[int, ...]]], *, index: DiskIndex, watch: DurableWatch,
                 metrics: EngineMetrics, events: EventLog) -> None:
        self.fingerprint = fingerprint
        # Per group, bytes of one chunk: asked per chunk on every store, spill and load path.
        self.chunk_nbytes: List[int] = list(chunk_nbytes)
        self.num_blocks: List[int] = list(num_blocks)
        self.metas: List[Tuple[str, Tuple[int, ...]]] = list(metas)
        self.pools: List[HostSlabPool] = []
        self.entries: Dict[bytes, ChunkEntry] = {}
        self._index = index
        self._watch = watch
        self._metrics = metrics
        self._events = events
        # In-flight copy batches: completion future -> the (group, device block) pairs it touches.
        self._busy: Dict[asyncio.Future, Dict[int, FrozenSet[int]]] = {}

    def open(self, pools: List[HostSlabPool]) -> None:
        """Take the engine's host pools, one per group."""
        self.pools = pools

    def close(self) -> None:
        for pool in self.pools:
            pool.close()

    # -- lookup ----------------------------------------------------------------------------------

    def lookup_state(self, keys: RequestKeys) -> Callable[[int, int], ChunkState]:
        """What ``longest_hit`` asks per (group, chunk): the entry's state, else on disk or missing."""
        entries = self.entries
        on_disk = self._index
        key_lists = keys.keys
        lookup_state = LOOKUP_STATE

        def state(group_index: int, chunk_index: int) -> ChunkState:
            group_keys = key_lists[group_index]
            if chunk_index >= len(group_keys):
                return ChunkState.MISSING
            key = group_keys[chunk_index]
            entry = entries.get(key)
            if entry is not None:
                return lookup_state[entry.state]
            return ChunkState.READY if key in on_disk else ChunkState.MISSING

        return state

    def chunk_meta(self, entry: ChunkEntry) -> ChunkMeta:
        dtype, shape = self.metas[entry.group_index]
        return ChunkMeta(self.fingerprint, entry.group_index, entry.chunk_index, dtype, shape)

    def is_own_meta(self, entry: ChunkEntry, meta: ChunkMeta) -> bool:
        """Whether ``meta`` (read back from a tier) describes ``entry``'s chunk of this model."""
        dtype, shape = self.metas[entry.group_index]
        return (meta.fingerprint == self.fingerprint and meta.group_index == entry.group_index
                and meta.chunk_index == entry.chunk_index and meta.dtype == dtype and tuple(meta.shape) == shape)

    # -- slots and entries -----------------------------------------------------------------------

    def allocate(self, groups: Iterable[int]) -> Optional[Dict[int, List[int]]]:
        """One host slot per item of ``groups`` (a group index per chunk), all or nothing across
        groups; evicted chunks leave the index. ``None`` when the pools cannot make room: then
        nothing was evicted in any group (every group is checked before the first eviction)."""
        needed: Dict[int, int] = {}
        for gi in groups:
            needed[gi] = needed.get(gi, 0) + 1
        for gi, count in needed.items():
            pool = self.pools[gi]
            if pool.num_free + pool.num_evictable < count:
                return None
        granted: Dict[int, List[int]] = {}
        for gi, count in needed.items():
            allocation = self.pools[gi].allocate(count)
            if allocation is None:  # cannot happen after the check above; stay all-or-nothing anyway
                for g, slots in granted.items():
                    for slot in slots:
                        self.pools[g].release(slot)
                return None
            self.evicted(gi, allocation.evicted)
            granted[gi] = list(allocation.slots)
        return granted

    def add_entries(self, wanted, state: HostState, slots: Dict[int, List[int]],
                    speculative: Collection[Tuple[int, int]] = ()) -> List[ChunkEntry]:
        """Index an entry per (group, chunk, key) in ``wanted`` in the given slots, pinned once for
        the copy that is about to fill them; a (group, chunk) in ``speculative`` is told to the
        host pool's policy as such (stored only for partial-prefix hits)."""
        iters = {g: iter(s) for g, s in slots.items()}
        index = self.entries
        any_speculative = bool(speculative)
        entries = []
        claims: Dict[int, List[Tuple[int, ChunkEntry, bytes, bool]]] = {g: [] for g in slots}
        for gi, chunk, key in wanted:
            slot = next(iters[gi])
            entry = ChunkEntry(key, gi, chunk, state, slot)
            claims[gi].append((slot, entry, key, any_speculative and (gi, chunk) in speculative))
            index[key] = entry
            entries.append(entry)
        for gi, items in claims.items():
            self.pools[gi].claim_many(items)
        return entries

    def evicted(self, group_index: int, evicted: Sequence[Tuple[int, Any]]) -> None:
        """The pool of ``group_index`` evicted these (slot, owner entry) pairs to make room."""
        for _slot, owner in evicted:
            if not isinstance(owner, ChunkEntry):
                continue
            entry = owner
            entry.dead = True
            if self.entries.get(entry.key) is entry:
                del self.entries[entry.key]
            self._events.append("removed", entry.key, group_index, "host")
            if entry.key not in self._index:
                self._metrics.dropped("evicted", 1)
        if evicted:
            self._metrics.evicted("host", len(evicted))

    def pin(self, entry: ChunkEntry) -> None:
        self.pools[entry.group_index].pin(entry.slot)

    def unpin(self, entry: ChunkEntry) -> None:
        pool = self.pools[entry.group_index]
        if pool.unpin(entry.slot) == 0 and entry.dead:
            pool.release(entry.slot)

    def unpin_all(self, entries: Sequence[ChunkEntry]) -> None:
        """``unpin`` each entry, a pool's slots in one call (a store's completion)."""
        for gi, slots in _slots_by_group(entries).items():
            self.pools[gi].unpin_many(slots)
        for e in entries:
            if e.dead and self.pins(e) == 0:
                self.pools[e.group_index].release(e.slot)

    def pins(self, entry: ChunkEntry) -> int:
        return self.pools[entry.group_index].pin_count(entry.slot)

    def view(self, entry: ChunkEntry):
        """The entry's slot as a tensor (hand it to a worker only while the entry is pinned)."""
        return self.pools[entry.group_index].view(entry.slot)

    def buffer(self, entry: ChunkEntry) -> memoryview:
        """The entry's slot as a writable memoryview, for tiers (while the entry is pinned)."""
        return self.pools[entry.group_index].buffer(entry.slot)

    def touch(self, entry: ChunkEntry) -> None:
        self.pools[entry.group_index].touch(entry.slot)

    def settle_ready(self, entry: ChunkEntry) -> None:
        """``entry``'s bytes are valid and nothing is in flight: READY, and evictable."""
        move(entry, HostState.READY)
        self.pools[entry.group_index].mark_evictable(entry.slot, True)

    def settle_ready_all(self, entries: Sequence[ChunkEntry]) -> None:
        """``settle_ready`` for each entry, a pool's slots marked evictable in one call."""
        for e in entries:
            move(e, HostState.READY)
        for gi, slots in _slots_by_group(entries).items():
            self.pools[gi].mark_evictable_many(slots)

    def drop(self, entry: ChunkEntry, reason: Optional[str]) -> None:
        """Remove an entry from the index; its slot is released when its last pin goes. Handles
        waiting for its spill learn it will not come."""
        if entry.dead:
            return
        entry.dead = True
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        if entry.state in DURABLE_LATER:
            self._watch.resolve(entry.key, False)
        if self.pins(entry) == 0:
            self.pools[entry.group_index].release(entry.slot)
        if reason is not None:
            self._metrics.dropped(reason, 1)

    @staticmethod
    def resolve(entry: ChunkEntry, reason: Optional[str]) -> None:
        """The entry's in-flight copy ended: ``None`` when it is READY, else the failure reason.
        The first call counts."""
        if entry.settled:
            return
        entry.settled, entry.reason = True, reason
        if entry.ready is not None and not entry.ready.done():
            entry.ready.set_result(reason)

    @staticmethod
    def waiter(entry: ChunkEntry) -> asyncio.Future:
        """A future of the end of ``entry``'s in-flight copy (see ``resolve``), made on first ask,
        on the running loop (the engine's)."""
        if entry.ready is None:
            entry.ready = asyncio.get_running_loop().create_future()
            if entry.settled:
                entry.ready.set_result(entry.reason)
        return entry.ready

    # -- fences ----------------------------------------------------------------------------------

    def mark_busy(self, chunks: Iterable[Tuple[int, Iterable[Optional[int]]]], done: asyncio.Future) -> None:
        """Per chunk of a copy batch, (group, its device blocks; ``None`` for none) touched until
        ``done`` resolves."""
        # One record per copy batch, not per block: marking and clearing cost a few Python steps
        # per batch instead of two dict operations per block (~6 us per chunk of 4 blocks); a fence
        # scans the few batches in flight. Block ids are kept per group: no pair made per block.
        by_group: Dict[int, set] = {}
        for gi, blocks in chunks:
            found = by_group.get(gi)
            if found is None:
                found = by_group[gi] = set()
            found.update(blocks)
        for found in by_group.values():
            found.discard(None)
        self._busy[done] = {gi: frozenset(found) for gi, found in by_group.items()}
        done.add_done_callback(self._clear_busy)

    def _clear_busy(self, done: asyncio.Future) -> None:
        self._busy.pop(done, None)

    def busy_with(self, wanted: FrozenSet[Tuple[int, int]]) -> List[asyncio.Future]:
        """The completion futures of the copy batches touching any of ``wanted``."""
        asked: Dict[int, set] = {}
        for gi, block in wanted:
            asked.setdefault(gi, set()).add(block)
        return [done for done, busy in self._busy.items()
                if any(not blocks.isdisjoint(asked.get(gi, ())) for gi, blocks in busy.items())]

    # -- observability ---------------------------------------------------------------------------

    def slab_bytes(self) -> int:
        # Read on the pressure monitor's thread: a plain sum over a list that no longer changes.
        return sum(int(pool.statistics()["capacity_bytes"]) for pool in list(self.pools) if not pool.closed)

    def state_counts(self) -> Dict[str, int]:
        """Chunks per lifecycle state, and ``disk``. May run on an exporter thread: it reads a copy
        of the values, never iterates the live dict."""
        counts = {state.value: 0 for state in HostState}
        for entry in list(self.entries.values()):
            counts[entry.state.value] += 1
        counts["disk"] = len(self._index)
        return counts

    def problems(self, *, idle: bool, queued_ok: bool) -> List[str]:
        """Every way the host-side tables disagree. The idle-only rules (stuck states, pins,
        fences) apply when ``idle``: no engine task and no spill running; ``queued_ok``: a QUEUED
        entry is not stuck (no spill loop will take it)."""
        problems: List[str] = []
        owned: Dict[Tuple[int, int], ChunkEntry] = {}
        for key, entry in self.entries.items():
            if entry.key != key:
                problems.append(f"entry under key {key.hex()[:12]} names {entry.key.hex()[:12]}")
            if entry.dead:
                problems.append(f"dead entry {key.hex()[:12]} still indexed")
            where = (entry.group_index, entry.slot)
            if where in owned:
                problems.append(f"slot {where} owned twice")
            owned[where] = entry
        if idle:
            for key, entry in self.entries.items():
                if entry.state is not HostState.READY and not (entry.state is HostState.QUEUED and queued_ok):
                    problems.append(f"entry {key.hex()[:12]} stuck in {entry.state.value}")
            for gi, pool in enumerate(self.pools):
                if pool.closed:
                    continue
                stats = pool.statistics()
                used = sum(1 for g, _ in owned if g == gi)
                if stats["used_slots"] != used:
                    problems.append(f"group {gi}: pool has {stats['used_slots']} slots in use but {used} entries")
                if stats["pinned_slots"] != 0:
                    problems.append(f"group {gi}: {stats.get('pinned_slots')} slots pinned while idle")
                ready = sum(1 for e in self.entries.values() if e.group_index == gi and e.state in EVICTABLE)
                if stats["evictable_slots"] != ready:
                    problems.append(f"group {gi}: {stats['evictable_slots']} evictable slots but {ready} READY entries")
            if self._busy:
                fenced = {(gi, block) for busy in self._busy.values() for gi, blocks in busy.items() for block in blocks}
                problems.append(f"{len(fenced)} device blocks still fenced while idle")
        for gi, pool in enumerate(self.pools):
            if pool.closed:
                continue
            try:
                pool.check()
            except KvtierError as exc:
                problems.append(f"group {gi} host pool: {exc}")
        return problems


def _slots_by_group(entries: Sequence[ChunkEntry]) -> Dict[int, List[int]]:
    """The entries' slots per group, in the entries' order (one pool call per group)."""
    by_group: Dict[int, List[int]] = {}
    for e in entries:
        slots = by_group.get(e.group_index)
        if slots is None:
            slots = by_group[e.group_index] = []
        slots.append(e.slot)
    return by_group
