"""Eviction policies for the host slab pool: small objects chosen by name.

Primitives: ``EvictionPolicy`` (the five-method interface), ``LRUPolicy``, ``ARCPolicy``,
``LFUDAPolicy`` (frequency with dynamic aging, remembering evicted content's counts),
``ArcLfudaPolicy`` (ARC under the name ``arc-lfuda``: the host half of a pairing whose disk half is
LFU-DA, ``tiers.lru``), ``make_eviction_policy(name, capacity)`` (the registry; an unknown name lists the valid ones) and
``eviction_policy_names()``. Pure bookkeeping over slot numbers: no I/O, no torch. Not thread-safe:
the host pool calls its policy only from the engine's event-loop thread.

A policy tracks the *occupied* slots of one pool. It never decides on its own that a slot may go:
``evictable_victims`` asks the pool, per candidate, whether that slot is evictable right now (ready,
unpinned, flagged by its owner), so pins and states live in one place (the pool) and cannot drift.

Shape of the interface after vLLM's offloading policies (``vllm/v1/kv_offload/cpu/policies``):
insert / touch / remove / pick victims all-or-nothing.
"""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict
from typing import Callable, Dict, Hashable, Iterator, List, Mapping, Optional, Tuple, Type

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "ARCPolicy",
    "LFUDAPolicy",
    "ArcLfudaPolicy",
    "make_eviction_policy",
    "eviction_policy_names",
]

IsEvictable = Callable[[int], bool]


class EvictionPolicy(abc.ABC):
    """Which occupied slot goes first when the pool needs room.

    ``insert(slot, key)`` when a slot gets new content, ``touch(slot)`` when it is read or hit,
    ``remove(slot)`` when the owner frees it (no history is kept for a removed slot),
    ``evictable_victims(n, is_evictable)`` to choose ``n`` slots to drop, in policy order, among the
    slots for which ``is_evictable(slot)`` is true. The victims are forgotten (ARC remembers their
    keys in its ghost lists). Fewer than ``n`` candidates: ``None``, and nothing changes.

    ``key`` identifies the *content* (the owner's chunk id), not the slot: a slot is reused for
    other content right after eviction, so only a content key can tell that a chunk came back
    (ARC's ghost hits). Policies without history ignore it.

    Threads: every policy (this class and its subclasses) is called from the host pool's thread,
    the engine's event loop, only; none takes a lock.
    """

    name: str = "policy"
    # Whether ``insert``'s ``speculative`` changes anything (the owner may skip working it out).
    uses_speculative: bool = False

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity

    @abc.abstractmethod
    def insert(self, slot: int, key: Optional[Hashable] = None, speculative: bool = False) -> None:
        """Track ``slot`` as new content, most recently used. Already tracked: ValueError.
        ``speculative``: the content was stored for a hit that may never come (a sliding window's
        interior tail, kept only for partial-prefix hits); a policy may let it go first (LRU and
        ARC ignore it)."""

    @abc.abstractmethod
    def touch(self, slot: int) -> None:
        """Record an access to ``slot``. Untracked slot: KeyError."""

    @abc.abstractmethod
    def remove(self, slot: int) -> None:
        """Stop tracking ``slot`` (freed by its owner, not evicted). Untracked slot: KeyError."""

    @abc.abstractmethod
    def evictable_victims(self, n: int, is_evictable: IsEvictable) -> Optional[List[int]]:
        """Choose and forget ``n`` victims in policy order; ``None`` (no change) if fewer exist."""

    # The tracked (occupied) slots as the keys of one of the policy's own maps, set by each
    # policy's constructor, so the size and membership below have one definition.
    _tracked: Mapping[int, object]

    def __len__(self) -> int:
        """Number of tracked (occupied) slots."""
        return len(self._tracked)

    def __contains__(self, slot: object) -> bool:
        """Whether ``slot`` is tracked."""
        return slot in self._tracked


def _check_count(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")


class LRUPolicy(EvictionPolicy):
    """Least recently used first. One ordered dict: O(1) insert/touch/remove; choosing victims walks
    from the cold end past pinned or unready slots, so it costs the number of slots it skips."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Oldest first; the value is unused (OrderedDict is the O(1) move-to-end list).
        self._order: "OrderedDict[int, None]" = OrderedDict()
        self._tracked = self._order

    def insert(self, slot: int, key: Optional[Hashable] = None, speculative: bool = False) -> None:
        if slot in self._order:
            raise ValueError(f"slot {slot} is already tracked by the {self.name} policy")
        self._order[slot] = None

    def touch(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def remove(self, slot: int) -> None:
        del self._order[slot]

    def evictable_victims(self, n: int, is_evictable: IsEvictable) -> Optional[List[int]]:
        _check_count(n)
        victims: List[int] = []
        if n == 0:
            return victims
        for slot in self._order:
            if is_evictable(slot):
                victims.append(slot)
                if len(victims) == n:
                    break
        else:
            return None
        for slot in victims:
            del self._order[slot]
        return victims

    def order(self) -> List[int]:
        """Tracked slots, coldest first (for tests and self-checks)."""
        return list(self._order)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over slots.

    ``T1`` holds slots whose content was seen once (recency), ``T2`` content seen at least twice
    (frequency: touched after insertion, or re-inserted after a recent eviction). ``B1``/``B2``
    are ghost lists of the *keys* of content recently evicted from ``T1``/``T2``. A re-inserted key
    found in ``B1`` means ``T1`` was too small: the target size ``p`` of ``T1`` grows; found in
    ``B2``, it shrinks. Victims come from ``T1`` while ``|T1| > p``, else from ``T2``, so a one-pass
    scan of new chunks (stored once, never loaded) cannot flush chunks that are hit repeatedly,
    which LRU does.

    Adaptation to kvtier: a victim must be evictable (the pool decides); if the preferred list has
    no evictable slot, the other list gives one, so pins never make allocation fail while some slot
    could go. Content inserted without a key has no ghost history.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: "OrderedDict[int, None]" = OrderedDict()
        self._t2: "OrderedDict[int, None]" = OrderedDict()
        self._b1: "OrderedDict[Hashable, None]" = OrderedDict()
        self._b2: "OrderedDict[Hashable, None]" = OrderedDict()
        self._keys: Dict[int, Optional[Hashable]] = {}
        self._tracked = self._keys
        # Target size of T1, in slots; a float because the ARC step |B2|/|B1| is fractional.
        self._p = 0.0

    @property
    def target_t1_size(self) -> float:
        """ARC's adaptive ``p``: how many slots recency (T1) should get."""
        return self._p

    def insert(self, slot: int, key: Optional[Hashable] = None, speculative: bool = False) -> None:
        if slot in self._keys:
            raise ValueError(f"slot {slot} is already tracked by the {self.name} policy")
        if key is not None and key in self._b1:
            self._p = min(float(self.capacity), self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[slot] = None
        elif key is not None and key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[slot] = None
        else:
            self._t1[slot] = None
        self._keys[slot] = key

    def touch(self, slot: int) -> None:
        if slot in self._t1:
            del self._t1[slot]
            self._t2[slot] = None
        else:
            self._t2.move_to_end(slot)  # KeyError when untracked, as documented

    def remove(self, slot: int) -> None:
        del self._keys[slot]
        if slot in self._t1:
            del self._t1[slot]
        else:
            del self._t2[slot]

    def evictable_victims(self, n: int, is_evictable: IsEvictable) -> Optional[List[int]]:
        _check_count(n)
        if n == 0:
            return []
        # Plan first, mutate after: all or nothing. Candidates are generated lazily, so the common
        # case (cold ends evictable) inspects about n slots.
        t1_candidates: Iterator[int] = (s for s in self._t1 if is_evictable(s))
        t2_candidates: Iterator[int] = (s for s in self._t2 if is_evictable(s))
        next_t1 = next(t1_candidates, None)
        next_t2 = next(t2_candidates, None)
        plan: List[Tuple[int, bool]] = []  # (slot, came from T1)
        taken_t1 = 0
        while len(plan) < n:
            t1_size = len(self._t1) - taken_t1
            prefer_t1 = t1_size >= 1 and t1_size > self._p
            if next_t1 is not None and (prefer_t1 or next_t2 is None):
                plan.append((next_t1, True))
                taken_t1 += 1
                next_t1 = next(t1_candidates, None)
            elif next_t2 is not None:
                plan.append((next_t2, False))
                next_t2 = next(t2_candidates, None)
            else:
                return None
        for slot, from_t1 in plan:
            key = self._keys.pop(slot)
            if from_t1:
                del self._t1[slot]
                ghosts = self._b1
            else:
                del self._t2[slot]
                ghosts = self._b2
            if key is not None:
                ghosts.pop(key, None)
                ghosts[key] = None
        self._trim_ghosts()
        return [slot for slot, _ in plan]

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |T1| + |B1| <= c and the directory |T1|+|T2|+|B1|+|B2| <= 2c; the oldest
        # ghosts go first.
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * self.capacity:
            (self._b2 or self._b1).popitem(last=False)

    def lists(self) -> Dict[str, list]:
        """Snapshot of T1, T2 (slots) and B1, B2 (keys), coldest first (tests, self-checks)."""
        return {
            "t1": list(self._t1),
            "t2": list(self._t2),
            "b1": list(self._b1),
            "b2": list(self._b2),
        }


class LFUDAPolicy(EvictionPolicy):
    """Least frequently used with dynamic aging (LFU-DA: Arlitt et al., 2000), over content keys.

    Each access (insert or touch) of content ``key`` adds one to its count; the slot's priority is
    ``L + count``, where ``L`` is the priority of the last victim (the aging: a count earned long
    ago is worth less than ``L``'s growth since). The lowest priority goes first; equal priorities
    go least recently used first. Counts outlive eviction (a chunk stored again after eviction
    keeps its history), bounded as TinyLFU bounds its sketch: after ``40 x capacity`` accesses
    (at most 2**20) every count is halved and zeros are dropped, so at most that many keys are
    remembered (measured on the Mooncake conversation trace: 10 x capacity kept too little
    history, 1.36x LRU at 2% of the unique bytes against 1.50x).

    Why it beats LRU for a prefix cache whose capacity is scarce: most chunks are used once (a
    conversation's last turn, a one-off document), and LRU lets each of them push out a head that
    many requests share; a head's count grows with every request that hits it, so it outlives a
    burst of new chunks, while the aging lets a session that ended fall out. Content inserted
    without a key counts from one and keeps no history. A speculative insertion is no access: it
    keeps the key's count (0 for new content), so a sliding window's interior tail goes before
    anything used at the same age (measured on gpt-oss-120b-like pools, where those tails are most
    of the sliding pool: without it the policy gained nothing there).

    Victims walk a heap with lazy deletion: O(log n) per access, plus the slots skipped as not
    evictable.
    """

    name = "lfuda"
    uses_speculative = True
    # Accesses between halvings, per slot, and their cap (a bound on the remembered keys' memory).
    history_factor = 40
    history_max = 1 << 20

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._heap: List[Tuple[float, int, int]] = []  # (priority, sequence, slot); stale ones skipped
        self._entry: Dict[int, Tuple[float, int, int]] = {}  # slot -> live (priority, sequence, count)
        self._keys: Dict[int, Optional[Hashable]] = {}
        self._tracked = self._entry
        self._counts: Dict[Hashable, int] = {}
        self._age = 0.0  # L: the priority of the last victim
        self._sequence = 0
        self._samples = 0
        self._period = min(self.history_factor * capacity, self.history_max)

    @property
    def age(self) -> float:
        """LFU-DA's ``L``: the priority of the most recent victim."""
        return self._age

    def count(self, key: Hashable) -> int:
        """The remembered access count of ``key`` (0: none)."""
        return self._counts.get(key, 0)

    def _access(self, slot: int, key: Optional[Hashable], previous: int, speculative: bool = False) -> None:
        if speculative:
            count = previous if key is None else self._counts.get(key, 0)
        elif key is None:
            count = previous + 1
        else:
            count = self._counts.get(key, 0) + 1
            self._counts[key] = count
            self._samples += 1
            if self._samples >= self._period:
                self._halve()
        self._sequence += 1
        priority = self._age + count
        self._entry[slot] = (priority, self._sequence, count)
        heapq.heappush(self._heap, (priority, self._sequence, slot))
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = [(p, q, s) for s, (p, q, _) in self._entry.items()]
            heapq.heapify(self._heap)

    def _halve(self) -> None:
        self._samples = 0
        self._counts = {key: count >> 1 for key, count in self._counts.items() if count > 1}

    def insert(self, slot: int, key: Optional[Hashable] = None, speculative: bool = False) -> None:
        if slot in self._entry:
            raise ValueError(f"slot {slot} is already tracked by the {self.name} policy")
        self._keys[slot] = key
        self._access(slot, key, 0, speculative)

    def touch(self, slot: int) -> None:
        key = self._keys[slot]  # KeyError when untracked, as documented
        self._access(slot, key, self._entry[slot][2])

    def remove(self, slot: int) -> None:
        del self._entry[slot]
        del self._keys[slot]

    def evictable_victims(self, n: int, is_evictable: IsEvictable) -> Optional[List[int]]:
        _check_count(n)
        if n == 0:
            return []
        heap, entry = self._heap, self._entry
        victims: List[Tuple[float, int, int]] = []
        skipped: List[Tuple[float, int, int]] = []
        while len(victims) < n and heap:
            item = heapq.heappop(heap)
            priority, sequence, slot = item
            live = entry.get(slot)
            if live is None or live[1] != sequence:
                continue  # stale: touched, removed or evicted since
            (victims if is_evictable(slot) else skipped).append(item)
        for item in skipped:
            heapq.heappush(heap, item)
        if len(victims) < n:
            for item in victims:
                heapq.heappush(heap, item)
            return None
        for priority, _, slot in victims:
            del entry[slot]
            del self._keys[slot]
        self._age = max(self._age, victims[-1][0])
        return [slot for _, _, slot in victims]

    def order(self) -> List[int]:
        """Tracked slots, first victim first (for tests and self-checks)."""
        return [slot for slot, _ in sorted(self._entry.items(), key=lambda item: item[1][:2])]


class ArcLfudaPolicy(ARCPolicy):
    """ARC on the host pools of the ``arc-lfuda`` pairing, whose disk tier evicts in LFU-DA order
    (``tiers.lru.make_byte_index("arc-lfuda")``). Why a pairing: with every stored chunk written
    through to disk, two tiers in the same order hold nearly the same chunks, so the hits come from
    one tier's worth of capacity; in different orders (the host's recency and frequency adapting to
    the traffic, the disk's frequency with aging) they keep different chunks and their union hits
    more. Measured with ``kvtier replay --compare-policies`` (README, "Eviction policies"): the
    most hits where capacity is scarcest (1.62x LRU at 2% of the Mooncake conversation trace's
    unique bytes), but 0.31 point below LRU at 20%, so the engine's default is ``arc`` on the host
    over an LRU disk.

    One change to ARC: speculative content (a sliding window's interior tail) enters ``T1`` at its
    cold end, so it is the first victim unless a hit moves it to ``T2`` (gpt-oss-120b-like pools:
    +1.0 point at 10% of the unique bytes; ARC alone ignores the flag)."""

    name = "arc-lfuda"
    uses_speculative = True

    def insert(self, slot: int, key: Optional[Hashable] = None, speculative: bool = False) -> None:
        super().insert(slot, key, speculative)
        if speculative and slot in self._t1:
            self._t1.move_to_end(slot, last=False)


_REGISTRY: Dict[str, Type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    ARCPolicy.name: ARCPolicy,
    LFUDAPolicy.name: LFUDAPolicy,
    ArcLfudaPolicy.name: ArcLfudaPolicy,
}


def eviction_policy_names() -> Tuple[str, ...]:
    """The names ``make_eviction_policy`` accepts, sorted."""
    return tuple(sorted(_REGISTRY))


def make_eviction_policy(name: str, capacity: int) -> EvictionPolicy:
    """A new policy for a pool of ``capacity`` slots. Unknown ``name``: ValueError listing the valid
    names."""
    try:
        cls = _REGISTRY[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(n) for n in eviction_policy_names())
        raise ValueError(f"unknown eviction policy {name!r}; valid names: {valid}") from None
    return cls(capacity)
