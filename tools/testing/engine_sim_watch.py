"""What the engine simulation (``engine_sim``) hears and checks inside the engine under test: the
hooks it sets into the tier, the engine's host book, its durable watch and the device view's copies,
and the checks of host slots after every step.

Primitives: ``record_tier`` (the tier's puts and removal reports into the ``History``),
``record_evictions`` (the engine's host evictions), ``check_promises`` (each chunk the engine
settles durable, checked against the history in the engine's own call), ``track_reads`` (the host
slots a tier read may still write), ``CopyFaults`` (faults a device batch copy raises, scripted by
the simulation), ``check_reads_in_flight`` and ``check_host_copies`` (the per-step slot checks).
Everything runs on the simulation's event loop, except ``CopyFaults``' wrapped copies, which run on
the engine's copy threads (the simulation scripts faults only between its steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import numpy as np
import torch

from kvtier.engine.lifecycle import HostState

from .engine_sim_model import History, SimDevice, SimViolation
from .tier_seam import SeamTier

if TYPE_CHECKING:
    from kvtier.engine.durable import DurableWatch
    from kvtier.engine.host_book import HostBook
    from kvtier.tiers.device import DeviceKVView

__all__ = ["record_tier", "record_evictions", "check_promises", "track_reads", "CopyFaults",
           "check_reads_in_flight", "check_host_copies", "Reads"]

# Host states whose slot holds the chunk's bytes.
VALID_BYTES = (HostState.QUEUED, HostState.SPILLING, HostState.READY)

# The tier reads in flight: per read, each buffer's (group, slot) (None: not a host slot) and key.
Reads = List[List[Tuple[Optional[Tuple[int, int]], bytes]]]


def record_tier(inner: Any, history: History) -> None:
    """Record the tier's puts (as the tier answers, before any seam fault) and removal reports.
    Call after the engine subscribed: the tier's feed calls both on the loop in that order, so a
    removal is recorded in the loop turn the engine's index hears of it."""
    inner.subscribe_removals(history.removed)
    put_many = inner.put_many

    async def recorded_put(items):
        keys = [key for key, _, _ in items]
        try:
            sequence = await put_many(items)
        except BaseException:
            history.unknown(keys)
            raise
        history.landed(keys, sequence)
        return sequence

    inner.put_many = recorded_put


def record_evictions(host: "HostBook", history: History) -> None:
    """Record the engine's host evictions."""
    evicted = host.evicted

    def recorded_eviction(group_index, victims):
        history.host_evicted([entry.key for _, entry in victims if entry is not None])
        return evicted(group_index, victims)

    host.evicted = recorded_eviction  # type: ignore[method-assign]  # records the engine's own calls


def check_promises(watch: "DurableWatch", history: History, report: Any, broken: List[str], seed: int) -> None:
    """Check each promise as the engine settles it: a promise made while the tier had already
    reported the key removed (after its last put) is broken from the start (kept in ``broken``)."""
    resolve = watch.resolve

    def recorded_resolve(key, ok):
        report.promises_checked += bool(ok)
        if ok and history.gone(key):
            broken.append(
                f"seed {seed}: the engine settled chunk {key.hex()[:12]} as durable after the tier had "
                f"reported its removal ({history.describe(key, history.now([key]))})"
            )
        history.resolved(key)
        return resolve(key, ok)

    watch.resolve = recorded_resolve  # type: ignore[method-assign]  # checks each promise as it is settled


def track_reads(seam: SeamTier, host: "HostBook") -> Reads:
    """The reads in flight through ``seam``, kept up to date: from the engine's call to the tier's
    answer, the tier may write these buffers."""
    slots = {pool._views[slot].data_ptr(): (g, slot)
             for g, pool in enumerate(host.pools) for slot in range(pool.num_slots)}
    get_many_into = seam.get_many_into
    reads: Reads = []

    async def watched_read(items):
        reading = [(slots.get(np.asarray(buffer).ctypes.data), key) for key, buffer in items]
        reads.append(reading)
        try:
            return await get_many_into(items)
        finally:
            reads.remove(reading)

    seam.get_many_into = watched_read  # type: ignore[method-assign]  # tracks reads in flight
    return reads


class CopyFaults:
    """Faults the device view's two batch copies raise: ``pending`` (popped, one per copy) and
    ``fired`` (how many were raised, counted on the copy threads)."""

    def __init__(self, device: "DeviceKVView") -> None:
        self.pending: List[BaseException] = []
        self.fired = 0
        for name in ("gather_many_groups", "scatter_many_groups"):
            real = getattr(device, name)

            def copy(*args, _real=real, **kwargs):
                if self.pending:
                    self.fired += 1
                    raise self.pending.pop()
                return _real(*args, **kwargs)

            setattr(device, name, copy)


def check_reads_in_flight(host: "HostBook", reads: Reads, seed: int) -> None:
    """A host slot a tier read may still write stays held for that read: allocated, pinned, and
    owned by the chunk the read was started for (even once abandoned), never given to another."""
    for reading in reads:
        for where, key in reading:
            if where is None:
                continue  # not a host slot of the engine's
            g, slot = where
            pool = host.pools[g]
            owner = pool._owners[slot]
            if not pool._allocated[slot] or not pool._pins[slot] or getattr(owner, "key", None) != key:
                raise SimViolation(
                    f"seed {seed}: host slot {slot} of group {g} was given up while a tier read of chunk "
                    f"{key.hex()[:12]} may still write it (allocated {pool._allocated[slot]}, pins "
                    f"{pool._pins[slot]}, owner {getattr(owner, 'key', b'').hex()[:12] or None})"
                )


def check_host_copies(host: "HostBook", device: SimDevice, seed: int) -> int:
    """Every host slot whose bytes the engine calls valid holds its chunk's bytes (a late read or
    copy into a slot given to another chunk is caught here). Returns how many were compared."""
    checked = 0
    for key, entry in list(host.entries.items()):
        if entry.dead or entry.state not in VALID_BYTES:
            continue
        got = host.pools[entry.group_index].view(entry.slot)
        if not torch.equal(got, device.chunk_bytes(key, entry.group_index)):
            raise SimViolation(
                f"seed {seed}: the host copy of chunk {key.hex()[:12]} (group {entry.group_index}, "
                f"slot {entry.slot}, {entry.state.name}) holds bytes that are not its chunk's"
            )
        checked += 1
    return checked
