"""The host tier: one preallocated, pre-faulted slab of fixed-size slots (one slot = one chunk).

Primitives: ``HostSlabPool`` (slots, pins, owner tags, eviction), ``Allocation`` (what ``allocate``
returns), ``SlotStateError`` (a slot used against its state). The engine makes one pool per KV-cache
group, since chunk sizes differ per group, and splits its host budget across them by the bytes each
group stores per token (``host_split_weights`` -> ``host_slot_counts`` -> ``pools_for_budget``).

Why a slab: allocating host memory per chunk is 5-20x slower than reusing a slot (first touch runs
at ~1 GB/s, pinning costs a driver call), so the whole capacity is allocated, page-locked on CUDA
(``DeviceBackend.host_buffer``) and written once at construction; the hot path only moves integers.

Threads: not thread-safe, by design. Every method runs on the engine's event-loop thread, where
all chunk-state transitions happen; worker threads receive ``view(slot)`` tensors and copy into or
out of them, while the slot is pinned, and report back through the loop. ``close`` runs on the
loop too.

"Cannot allocate" is a value (``None``), never an exception: it is the normal answer under pressure.
Eviction is atomic: either ``allocate(n)`` gets all ``n`` slots (evicting what it must) or nothing
changes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch

from kvtier.errors import ClosedError, SlotStateError
from kvtier.policy import ModelLayout
from kvtier.policy.retention import retention_store_chunk_indices

from .device_backend import PAGE_BYTES as _PAGE_BYTES, DeviceBackend
from .eviction import EvictionPolicy, make_eviction_policy

__all__ = ["HostSlabPool", "Allocation", "SlotStateError", "pools_for_budget", "host_slot_counts", "host_split_weights",
           "HOST_SPLIT_PROMPT_TOKENS", "slot_stride", "PAGE_ALIGNED_SLOT_MIN_BYTES"]



@dataclass(frozen=True)
class Allocation:
    """Slots handed out by ``HostSlabPool.allocate``.

    ``slots``: the new slots, each unpinned, not evictable, owner ``None``. ``evicted``: ``(slot,
    owner tag)`` for every slot whose content was dropped to make room, in eviction order, so the
    caller can mark those chunks as no longer on the host. An evicted slot may be among ``slots``.
    """

    slots: List[int]
    evicted: List[Tuple[int, object]] = field(default_factory=list)


def _release_slab(backend: DeviceBackend, slab: torch.Tensor) -> None:
    # Runs from close() or from a GC finalizer; at interpreter exit CUDA may already be torn down,
    # and a failing unregister must not turn into an exception in a finalizer.
    try:
        backend.release_host_buffer(slab)
    except Exception:  # noqa: BLE001 - best effort during teardown
        pass


PAGE_ALIGNED_SLOT_MIN_BYTES = 64 << 10


def slot_stride(slot_bytes: int) -> int:
    """Bytes between slot starts: a slot of at least ``PAGE_ALIGNED_SLOT_MIN_BYTES`` (a chunk the
    disk tier writes to a segment) starts on a page boundary, so its bytes go to and from the disk
    by direct I/O straight from the slot (no staging copy) and DMA takes it as it is; the padding
    is under 1/16 of the slot. Smaller slots are packed."""
    if slot_bytes < PAGE_ALIGNED_SLOT_MIN_BYTES:
        return slot_bytes
    return -(-slot_bytes // _PAGE_BYTES) * _PAGE_BYTES


# The prompt a host split is sized for when only a request's final boundary is stored (retention
# interval 0): a sliding group then stores a window per request, a full-attention group a chunk per
# block of tokens, so their shares depend on the prompt's length.
HOST_SPLIT_PROMPT_TOKENS = 8192


def host_split_weights(layout: ModelLayout, chunk_bytes: Sequence[int], retention_interval: Optional[int], *,
                       prompt_tokens: int = HOST_SPLIT_PROMPT_TOKENS) -> List[float]:
    """Per group, the bytes a producer stores per token under the coverage contract and the
    retention interval (``retention_store_chunk_indices``): what the group's pool should get of a
    shared host budget, so that each pool keeps its group's chunks about as long as one byte LRU
    over every group would. Counted on one prompt of ``prompt_tokens`` (rounded up to whole
    retention intervals): a full-attention group stores every chunk, a dense sliding group of a
    narrow window the few chunks of its window at each alignment boundary, and with interval 0
    one window per prompt. Pure; any thread."""
    unit = retention_interval or layout.alignment_tokens
    tokens = max(unit, -(-prompt_tokens // unit) * unit)
    weights = []
    for g, nbytes in enumerate(chunk_bytes):
        stored = len(retention_store_chunk_indices(layout, g, tokens, retention_interval))
        # A group with chunks longer than the sample still needs slots for one request's chunks.
        weights.append(max(stored, 1) * nbytes / tokens)
    return weights


def host_slot_counts(capacity_bytes: int, chunk_bytes: Sequence[int],
                     weights: Optional[Sequence[float]] = None) -> List[int]:
    """Per group, the slots of ``capacity_bytes`` split in proportion to ``weights`` (default:
    ``chunk_bytes``, which gives every group the same number of slots), with a floor of 4 slots so
    a tiny group can still hold the chunks of one request. Page-aligned slots count their padding
    (``slot_stride``), so the slabs stay within ``capacity_bytes``."""
    shares = list(chunk_bytes if weights is None else weights)
    if len(shares) != len(chunk_bytes) or any(not w >= 0 for w in shares) or not sum(shares) > 0:
        raise ValueError(f"weights must be one share >= 0 per group, not all 0; got {list(shares)!r}")
    if weights is None:  # integers throughout: the split by chunk bytes, exactly
        whole = sum(chunk_bytes)
        return [max(4, capacity_bytes * nbytes // whole // slot_stride(nbytes)) for nbytes in chunk_bytes]
    total = sum(shares)
    return [max(4, int(capacity_bytes * share / total) // slot_stride(nbytes))
            for share, nbytes in zip(shares, chunk_bytes)]


def pools_for_budget(capacity_bytes: int, chunk_bytes: Sequence[int], *, weights: Optional[Sequence[float]] = None,
                     device_kind: str = "cpu", eviction: str = "lru") -> List["HostSlabPool"]:
    """One pool per group of ``host_slot_counts(capacity_bytes, chunk_bytes, weights)`` slots; the
    engine passes ``host_split_weights`` of its layout and retention interval."""
    return [HostSlabPool(nbytes, count, device_kind=device_kind, eviction=eviction)
            for nbytes, count in zip(chunk_bytes, host_slot_counts(capacity_bytes, chunk_bytes, weights))]


class HostSlabPool:
    """Fixed-size slots in one host slab, with pins, owner tags and LRU/ARC eviction.

    ``HostSlabPool(slot_bytes, num_slots, device_kind="cpu"|"cuda"|"cuda:N", eviction="lru"|"arc")``.
    A slot is *free* (on the free list) or *allocated*. An allocated slot can be evicted by a later
    ``allocate`` only when its owner marked it evictable (``mark_evictable(slot, True)``: its chunk
    is READY and may be dropped) and no pin holds it. Pins are reference counts taken while a copy
    reads or writes the slot. ``touch`` reports an access to the eviction policy.

    Not thread-safe (see the module docstring): call every method from the event-loop thread.
    """

    def __init__(
        self,
        slot_bytes: int,
        num_slots: int,
        *,
        device_kind: str = "cpu",
        eviction: str = "lru",
    ) -> None:
        for name, value in (("slot_bytes", slot_bytes), ("num_slots", num_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        # Policy first: a bad name must fail before gigabytes are allocated and faulted in.
        self._policy: EvictionPolicy = make_eviction_policy(eviction, num_slots)
        self._backend = DeviceBackend(device_kind)
        self._slot_bytes = slot_bytes
        self._num_slots = num_slots
        stride = slot_stride(slot_bytes)
        slab = self._backend.host_buffer(stride * num_slots)
        self._slab: Optional[torch.Tensor] = slab
        # One view per slot, made once: slicing a tensor costs ~2 us, and the engine asks for a
        # slot's view on every store, spill and load of a chunk.
        self._views: List[torch.Tensor] = [slab[i * stride : i * stride + slot_bytes] for i in range(num_slots)]
        # Unpin even if close() is never called; holds the slab until then, which is the point.
        self._finalizer = weakref.finalize(self, _release_slab, self._backend, slab)

        # Stack of free slots: O(1) pop/push, and LIFO reuses the most recently freed (cache-warm)
        # slot. Reversed so the first allocations get slots 0, 1, 2... (readable tests and dumps).
        self._free: List[int] = list(range(num_slots - 1, -1, -1))
        self._allocated: List[bool] = [False] * num_slots
        self._pins: List[int] = [0] * num_slots
        self._evictable_flag: List[bool] = [False] * num_slots
        self._owners: List[object] = [None] * num_slots
        self._keys: List[Optional[Hashable]] = [None] * num_slots  # content keys for the policy
        # Slots that could be evicted right now; lets allocate() fail in O(1) when nothing can go.
        self._num_evictable = 0
        self._num_pinned = 0  # slots with at least one pin; keeps statistics() O(1)
        self._counters: Dict[str, int] = {
            "allocations": 0,
            "allocated_slots": 0,
            "allocation_failures": 0,
            "evictions": 0,
            "releases": 0,
        }

    # -- properties ----------------------------------------------------------------------------

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Allocated slots that an ``allocate`` could evict right now."""
        return self._num_evictable

    @property
    def eviction_policy(self) -> str:
        return self._policy.name

    @property
    def policy(self) -> EvictionPolicy:
        """The policy object, for introspection (its methods are the pool's to call)."""
        return self._policy

    @property
    def device_kind(self) -> str:
        return self._backend.kind

    @property
    def closed(self) -> bool:
        return self._slab is None

    @property
    def pinned(self) -> bool:
        """Whether the slab is page-locked (``cudaHostRegister``): always false on CPU."""
        return self._slab is not None and self._backend.is_pinned(self._slab)

    # -- internal helpers ----------------------------------------------------------------------

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self._num_slots:
            raise ValueError(f"slot must be an int in [0, {self._num_slots}), got {slot!r}")

    def _check_allocated(self, slot: int, action: str) -> None:
        # The engine asks this about a dozen times per chunk it stores and loads, always with a slot
        # the pool handed out: one exact type test, one range test and one list read say yes; only a
        # refused slot pays for the full checks and their messages.
        if type(slot) is int and 0 <= slot < self._num_slots and self._allocated[slot]:
            return
        self._check_slot(slot)
        if not self._allocated[slot]:
            raise SlotStateError(f"cannot {action} slot {slot}: it is free (not allocated)")

    def _can_evict(self, slot: int) -> bool:
        return self._allocated[slot] and self._evictable_flag[slot] and self._pins[slot] == 0

    def _reset(self, slot: int) -> None:
        self._allocated[slot] = False
        self._pins[slot] = 0
        self._evictable_flag[slot] = False
        self._owners[slot] = None
        self._keys[slot] = None

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self, n: int = 1) -> Optional[Allocation]:
        """``n`` slots, or ``None`` when even evicting every evictable slot would not free enough
        (then nothing changed). Free slots are used first; the rest come from victims the eviction
        policy picks among evictable slots, reported in ``Allocation.evicted``."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if self._slab is None:
            raise ClosedError("host slab pool is closed")
        shortfall = n - len(self._free)
        evicted: List[Tuple[int, object]] = []
        if shortfall > 0:
            victims = None
            if shortfall <= self._num_evictable:
                victims = self._policy.evictable_victims(shortfall, self._can_evict)
            if victims is None:
                self._counters["allocation_failures"] += 1
                return None
            for slot in victims:
                evicted.append((slot, self._owners[slot]))
                self._num_evictable -= 1
                self._reset(slot)
                self._free.append(slot)
            self._counters["evictions"] += len(victims)
        slots = [self._free.pop() for _ in range(n)]
        for slot in slots:
            self._allocated[slot] = True
            self._policy.insert(slot)
        self._counters["allocations"] += 1
        self._counters["allocated_slots"] += n
        return Allocation(slots=slots, evicted=evicted)

    def release(self, slot: int) -> None:
        """Give ``slot`` back to the free list (its content is dropped, without an eviction report).
        Releasing a free or pinned slot raises ``SlotStateError``."""
        self._check_allocated(slot, "release")
        if self._pins[slot]:
            raise SlotStateError(
                f"cannot release slot {slot}: pinned {self._pins[slot]} time(s); a copy may still "
                "read or write it (unpin first)"
            )
        if self._can_evict(slot):
            self._num_evictable -= 1
        self._policy.remove(slot)
        self._reset(slot)
        self._free.append(slot)
        self._counters["releases"] += 1

    # -- per-slot state ------------------------------------------------------------------------

    @property
    def uses_speculative(self) -> bool:
        """Whether the policy treats a speculative ``set_owner`` differently."""
        return self._policy.uses_speculative

    def set_owner(self, slot: int, tag: object, *, key: Optional[Hashable] = None, speculative: bool = False) -> None:
        """Record who holds ``slot`` (the engine's chunk entry); reported back if it is evicted.

        A new owner means new content: the policy sees a fresh insertion (most recently used).
        ``key`` names the content for the policy's history (ARC's ghost lists recognise a chunk
        that comes back soon after eviction): pass the chunk key. Without it the tag serves when
        hashable; an object hashed by identity never matches a later one, so ARC then adapts only
        through touches. ``speculative``: passed to the policy's ``insert`` (content stored for a
        hit that may never come).
        """
        self._check_allocated(slot, "set the owner of")
        if key is None:
            try:
                hash(tag)
                key = tag
            except TypeError:
                key = None
        if self._owners[slot] is tag and self._keys[slot] == key:
            return
        self._owners[slot] = tag
        self._keys[slot] = key
        self._policy.remove(slot)
        self._policy.insert(slot, key=key, speculative=speculative)

    def owner(self, slot: int) -> object:
        self._check_allocated(slot, "read the owner of")
        return self._owners[slot]

    def mark_evictable(self, slot: int, evictable: bool = True) -> None:
        """Whether the owner allows dropping ``slot``'s content (its chunk is READY and either
        safely elsewhere or worth losing). Pins still protect it while held."""
        self._check_allocated(slot, "mark")
        flag = bool(evictable)
        if flag is not self._evictable_flag[slot]:
            self._evictable_flag[slot] = flag
            if self._pins[slot] == 0:  # allocated (checked above) and unpinned: the count moves
                self._num_evictable += 1 if flag else -1

    def pin(self, slot: int) -> None:
        """Take a reference: the slot cannot be evicted or released until a matching ``unpin``."""
        self._check_allocated(slot, "pin")
        pins = self._pins[slot]
        if pins == 0:
            self._num_pinned += 1
            if self._evictable_flag[slot]:  # it was evictable (allocated, unpinned): no longer
                self._num_evictable -= 1
        self._pins[slot] = pins + 1

    def unpin(self, slot: int) -> int:
        """Drop a reference taken by ``pin``; returns the pins left (0: the slot may be released)."""
        self._check_allocated(slot, "unpin")
        pins = self._pins[slot]
        if pins == 0:
            raise SlotStateError(f"cannot unpin slot {slot}: it is not pinned (unpin without pin)")
        pins -= 1
        self._pins[slot] = pins
        if pins == 0:
            self._num_pinned -= 1
            if self._evictable_flag[slot]:  # allocated (checked above) and now unpinned
                self._num_evictable += 1
        return pins

    def claim_many(self, items: Iterable[Tuple[int, object, Hashable, bool]]) -> None:
        """``set_owner(slot, tag, key=key, speculative=speculative)`` then ``pin(slot)`` for each
        ``(slot, tag, key, speculative)`` of ``items``, in order: a store takes its batch of fresh
        slots for the copy that is about to fill them. A slot either call would refuse raises its
        error, the items before it already claimed."""
        # set_owner's and pin's bookkeeping inline: a store claims hundreds of slots on the event
        # loop in one call, where two checked calls a slot kept the copy thread off the GIL longer.
        owners, keys, pins, flags = self._owners, self._keys, self._pins, self._evictable_flag
        allocated, num_slots, policy = self._allocated, self._num_slots, self._policy
        for slot, tag, key, speculative in items:
            if not (type(slot) is int and 0 <= slot < num_slots and allocated[slot]) or key is None:
                self.set_owner(slot, tag, key=key, speculative=speculative)  # its checks and errors
                self.pin(slot)
                continue
            if owners[slot] is not tag or keys[slot] != key:
                owners[slot] = tag
                keys[slot] = key
                policy.remove(slot)
                policy.insert(slot, key=key, speculative=speculative)
            count = pins[slot]
            if count == 0:
                self._num_pinned += 1
                if flags[slot]:
                    self._num_evictable -= 1
            pins[slot] = count + 1

    def unpin_many(self, slots: Iterable[int]) -> None:
        """``unpin`` each of ``slots`` in order (a slot listed twice loses two pins): a store's
        completion unpins a batch of slots at once. A slot ``unpin`` would refuse raises its error,
        the slots before it already unpinned."""
        pins, flags, allocated, num_slots = self._pins, self._evictable_flag, self._allocated, self._num_slots
        for slot in slots:
            if not (type(slot) is int and 0 <= slot < num_slots and allocated[slot] and pins[slot]):
                self.unpin(slot)  # the checks and errors of one unpin
                continue
            left = pins[slot] - 1
            pins[slot] = left
            if left == 0:
                self._num_pinned -= 1
                if flags[slot]:
                    self._num_evictable += 1

    def mark_evictable_many(self, slots: Iterable[int]) -> None:
        """``mark_evictable(slot, True)`` for each of ``slots`` (a store's chunks settling READY)."""
        pins, flags, allocated, num_slots = self._pins, self._evictable_flag, self._allocated, self._num_slots
        for slot in slots:
            if not (type(slot) is int and 0 <= slot < num_slots and allocated[slot]):
                self.mark_evictable(slot, True)
                continue
            if not flags[slot]:
                flags[slot] = True
                if pins[slot] == 0:
                    self._num_evictable += 1

    def pin_count(self, slot: int) -> int:
        self._check_slot(slot)
        return self._pins[slot]

    def touch(self, slot: int) -> None:
        """Report an access (a hit or a load) to the eviction policy."""
        self._check_allocated(slot, "touch")
        self._policy.touch(slot)

    # -- bytes ---------------------------------------------------------------------------------

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes: a ``uint8`` slice of the slab (no copy). Valid while the slot stays
        allocated to the caller; hand it to a worker only while the slot is pinned."""
        if self._slab is None:
            raise ClosedError("host slab pool is closed")
        self._check_allocated(slot, "view")
        return self._views[slot]

    def buffer(self, slot: int) -> memoryview:
        """The slot's bytes as a writable ``memoryview`` (no copy), for tiers that take buffers."""
        return self.view(slot).numpy().data

    # -- lifecycle and introspection -----------------------------------------------------------

    def close(self) -> None:
        """Unpin and drop the slab. Safe to call twice. Views handed out stay readable (plain
        memory) but are no longer page-locked. Call it only once no copy uses a slot (no pins):
        on CUDA, unregistering memory that a DMA still targets is undefined behaviour."""
        if self._slab is None:
            return
        self._slab = None
        self._views = []
        self._finalizer()

    def __enter__(self) -> "HostSlabPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def statistics(self) -> Dict[str, float]:
        """Counters and gauges: slots, free, used, pinned, evictable, allocations, failures,
        evictions, releases, bytes."""
        used = self._num_slots - len(self._free)
        stats: Dict[str, float] = {
            "slots": self._num_slots,
            "slot_bytes": self._slot_bytes,
            "capacity_bytes": self._num_slots * self._slot_bytes,
            "free_slots": len(self._free),
            "used_slots": used,
            "pinned_slots": self._num_pinned,
            "evictable_slots": self._num_evictable,
            "page_locked": 1 if self._backend.is_cuda else 0,
        }
        stats.update(self._counters)
        return stats

    def check(self) -> None:
        """Reconcile the free list, slot flags, evictable count and policy; raise ``SlotStateError``
        on any disagreement. O(num_slots): for test teardown and stress self-checks."""
        problems: List[str] = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("free list holds a slot twice")
        evictable = 0
        for slot in range(self._num_slots):
            if self._allocated[slot] == (slot in free):
                problems.append(f"slot {slot}: allocated={self._allocated[slot]} but on free list="
                                f"{slot in free}")
            if self._allocated[slot] != (slot in self._policy):
                problems.append(f"slot {slot}: allocated={self._allocated[slot]} but tracked by "
                                f"policy={slot in self._policy}")
            if not self._allocated[slot] and (self._pins[slot] or self._owners[slot] is not None):
                problems.append(f"slot {slot}: free but pinned or owned")
            evictable += self._can_evict(slot)
        if evictable != self._num_evictable:
            problems.append(f"evictable count {self._num_evictable} != actual {evictable}")
        pinned = sum(1 for pins in self._pins if pins)
        if pinned != self._num_pinned:
            problems.append(f"pinned count {self._num_pinned} != actual {pinned}")
        if problems:
            raise SlotStateError("host pool self-check failed: " + "; ".join(problems))

    def __repr__(self) -> str:
        return (
            f"HostSlabPool(slot_bytes={self._slot_bytes}, num_slots={self._num_slots}, "
            f"device_kind={self.device_kind!r}, eviction={self.eviction_policy!r}, "
            f"free={len(self._free)})"
        )
