"""The engine's self-check of its host side: entries, pins, slots and the lifecycle table.

Primitive: ``host_problems(engine)`` lists every disagreement (empty: consistent). Event-loop
thread; pure bookkeeping, no I/O. ``OffloadEngine.check`` raises them as one
``EngineInvariantError``; ``OffloadEngine.check_disk`` adds the comparison with the disk tier.
Kept apart from the engine so the rules it checks read as one list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Tuple

from kvtier.errors import KvtierError

from .lifecycle import EVICTABLE, HostState
from .records import ChunkEntry

if TYPE_CHECKING:  # pragma: no cover
    from .engine import OffloadEngine

__all__ = ["host_problems"]


def host_problems(engine: "OffloadEngine") -> List[str]:
    """Every way the host-side tables disagree; the idle-only rules apply when no engine task and
    no spill is running (stuck states, pins, fences and waiting handles are normal mid-flight)."""
    problems: List[str] = []
    owned: Dict[Tuple[int, int], ChunkEntry] = {}
    for key, entry in engine._entries.items():
        if entry.key != key:
            problems.append(f"entry under key {key.hex()[:12]} names {entry.key.hex()[:12]}")
        if entry.dead:
            problems.append(f"dead entry {key.hex()[:12]} still indexed")
        if entry.pins < 0:
            problems.append(f"entry {key.hex()[:12]} has {entry.pins} pins")
        where = (entry.group_index, entry.slot)
        if where in owned:
            problems.append(f"slot {where} owned twice")
        owned[where] = entry
    spill_idle = engine._spill is None or engine._spill.idle or engine._spill_runner is None
    idle = not engine._tasks and spill_idle
    if idle:
        for key, entry in engine._entries.items():
            if entry.state is not HostState.READY and not (
                entry.state is HostState.QUEUED and (engine._spill_runner is None or engine._closed)
            ):
                problems.append(f"entry {key.hex()[:12]} stuck in {entry.state.value}")
            if entry.pins != 0:
                problems.append(f"entry {key.hex()[:12]} still has {entry.pins} pins while idle")
        for gi, pool in enumerate(engine._pools):
            if pool.closed:
                continue
            stats = pool.statistics()
            used = sum(1 for g, _ in owned if g == gi)
            if stats["used_slots"] != used:
                problems.append(f"group {gi}: pool has {stats['used_slots']} slots in use but {used} entries")
            if stats["pinned_slots"] != 0:
                problems.append(f"group {gi}: {stats.get('pinned_slots')} slots pinned while idle")
            ready = sum(1 for e in engine._entries.values() if e.group_index == gi and e.state in EVICTABLE)
            if stats["evictable_slots"] != ready:
                problems.append(f"group {gi}: {stats['evictable_slots']} evictable slots but {ready} READY entries")
        if engine._stores.inflight != 0:
            problems.append(f"{engine._stores.inflight} stores in flight while idle")
        if engine._busy_batches:
            fenced = set().union(*engine._busy_batches.values())
            problems.append(f"{len(fenced)} device blocks still fenced while idle")
        if engine._spill is not None and len(engine._spill.watch) and engine._spill_runner is not None:
            problems.append(f"{len(engine._spill.watch)} store handles still wait for durability while idle")
    for gi, pool in enumerate(engine._pools):
        if pool.closed:
            continue
        try:
            pool.check()
        except KvtierError as exc:
            problems.append(f"group {gi} host pool: {exc}")
    return problems
