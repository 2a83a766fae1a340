"""A chunk's life in the engine, as one transition table.

Primitives: ``HostState`` (where a chunk with a host slot stands), ``TRANSITIONS`` (every move the
engine may make), ``move`` (the one place an entry changes state, checked against the table),
``LOOKUP_STATE`` (what ``lookup`` makes of each state), ``EVICTABLE`` and ``DURABLE_LATER``.
Event-loop thread only.

A chunk is in exactly one of these places; "on disk" is a separate fact kept by the disk index
(``engine/disk_index.py``), because a chunk can be on disk with or without a host copy::

    state        host slot holds          lookup   evictable  a store finding it is durable...
    -----------  -----------------------  -------  ---------  -------------------------------
    (absent)     -                        MISSING  -          - (it schedules the chunk)
    (disk only)  -                        READY    -          now (True)
    PENDING      device -> host in flight PENDING  no         when its spill lands
    QUEUED       valid bytes, spill queued READY   no         when its spill lands
    SPILLING     valid bytes, put running READY    no         when its spill lands
    READY        valid bytes, settled     READY    yes        now: True iff its key is on disk
    LOADING      disk -> host in flight   LOADING  no         now (True: it was read from disk)

Moves (``TRANSITIONS``): a store creates PENDING; its copy ends in QUEUED (spill on), READY (no
disk tier or spill off) or the entry is dropped (copy failed, engine closing). The spill pipeline
takes QUEUED to SPILLING, and SPILLING to READY whether the put succeeded (the key joins the disk
index) or failed (the host copy stays usable; the drop is counted). A queued chunk whose key is
already on disk (another process wrote it) goes straight QUEUED -> READY. A promotion creates
LOADING, which ends READY or dropped. A READY chunk that is not on disk (its store was not admitted
to the disk, ``tiers/admission.py``) goes back to QUEUED when a load hits it. Only READY entries are evictable: a chunk never leaves the
host before it reached the disk, or before the engine gave up writing it.

The previous vocabularies map onto this one: ``statistics()["chunks_by_state"]`` keeps the three
lookup names (pending / ready / loading), ``kvtier_chunks{state}`` exports the five states here.
"""

from __future__ import annotations

import enum
from typing import Dict, FrozenSet, Mapping

from kvtier.errors import EngineInvariantError
from kvtier.policy import ChunkState

__all__ = ["HostState", "TRANSITIONS", "LOOKUP_STATE", "EVICTABLE", "DURABLE_LATER", "IllegalTransition", "move"]


class HostState(enum.Enum):
    """Where a chunk that has a host slot stands (see the module table)."""

    PENDING = "pending"  # device -> host copy in flight into the slot
    QUEUED = "queued"  # bytes valid; waiting in the spill queue
    SPILLING = "spilling"  # bytes valid; a disk put is reading the slot
    READY = "ready"  # bytes valid; nothing in flight (on disk, or never going there)
    LOADING = "loading"  # disk -> host read in flight into the slot

    # Members are singletons: hashing by identity is exact, and C-fast where Enum's own hash is a
    # Python call (~0.3 us), paid in the transition table and lookup's map per chunk.
    __hash__ = object.__hash__


TRANSITIONS: Mapping[HostState, FrozenSet[HostState]] = {
    HostState.PENDING: frozenset({HostState.QUEUED, HostState.READY}),
    HostState.QUEUED: frozenset({HostState.SPILLING, HostState.READY}),
    HostState.SPILLING: frozenset({HostState.READY}),
    HostState.READY: frozenset({HostState.QUEUED}),
    HostState.LOADING: frozenset({HostState.READY}),
}

LOOKUP_STATE: Mapping[HostState, ChunkState] = {
    HostState.PENDING: ChunkState.PENDING,
    HostState.QUEUED: ChunkState.READY,
    HostState.SPILLING: ChunkState.READY,
    HostState.READY: ChunkState.READY,
    HostState.LOADING: ChunkState.LOADING,
}

# Names used by statistics()["chunks_by_state"] since the first release (lookup's vocabulary).
LEGACY_NAME: Dict[HostState, str] = {state: LOOKUP_STATE[state].name.lower() for state in HostState}

EVICTABLE: FrozenSet[HostState] = frozenset({HostState.READY})
# A store that finds its chunk in one of these waits for the chunk's spill before it is durable.
DURABLE_LATER: FrozenSet[HostState] = frozenset({HostState.PENDING, HostState.QUEUED, HostState.SPILLING})


class IllegalTransition(EngineInvariantError):
    """The engine tried a move its lifecycle table does not allow: a bug, reported loudly."""


def move(entry, to: HostState) -> None:
    """Move ``entry`` (a ``ChunkEntry``) to ``to``; raise ``IllegalTransition`` for a move the table
    does not list. Dropping an entry is not a move: its slot goes, whatever its state."""
    if to not in TRANSITIONS[entry.state]:
        raise IllegalTransition(f"chunk {entry.key.hex()[:12]}: {entry.state.value} -> {to.value} is not a transition")
    entry.state = to
