"""Compaction of partly-live payload segments: why, what a pass does, and its planning rules (pure).

Why: space returns by whole segment (``segments``): a file is deleted only once its last live record
goes, so one live 256 KiB record can keep a 256 MiB file, and disk usage can stay far above the
tier's capacity. Compaction moves the live records of mostly-dead *closed* segments into this
writer's active segment; each source, once empty, is deleted (``segment_files.remove_dead``) as soon as no
read transaction of any process is older than the commit that emptied it (LMDB's reader table says
which snapshots are open): a read that took the old pointer just before the move still finds its
file, so moving a live record never turns a hit into a miss.

A pass, in two phases:

1. ``Compactor.plan_pass`` (``compactor``; a read-pool or tool thread, never the writer): read the ``segments`` table
   (live bytes | live records | committed end per segment) and ``choose_segments``: a segment is a
   candidate when it is closed -- not this writer's active one, and no writer (ours or another
   process's) holds its ``flock`` -- and its live bytes are below ``live_fraction`` of its committed
   end (a page of padding per live record counted as live); when a ``disk_budget_bytes`` is given and the segment files together exceed it, more segments
   are taken, least live first, until the projected total fits. Then list the candidates' live
   records (key and pointer, from the small ``atime`` table's keys, in read transactions of a few
   thousand keys each) in file order.
2. ``Compactor.step`` (writer thread, one job per step of at most ``step_bytes``, so
   puts queued meanwhile run between steps): keep only the records whose key still holds the planned
   pointer, read each one (on the read pool, several in flight) and check its checksum (a corrupt one is quarantined like a failed read,
   never copied), append the good ones to this writer's segment (``WriterSide.append_synced``, as puts:
   ``fdatasync``'d before the commit; also when new puts go inline), then ONE write transaction
   replaces each key's value ONLY IF it is still the exact old pointer (a put, delete or eviction by
   another process since the check wins; the copy is then dead bytes), moves the live bytes in the
   ``segments`` table with a ``Ledger``, and leaves ``atime`` and the LRU alone: compaction is not
   an access. Emptied sources are retired (``Compactor.remove_retired``) until the reader table allows.

Crash safety: before the step's commit the old pointer stands and the copy is an orphan tail of our
segment (truncated by ``reclaim_orphans`` at the next writable open); after it the new pointer
stands, and the emptied source is deleted once retired or, if the process died first, at the next
open (no entry in ``segments``: an orphan file).

When it runs: after a commit (put, delete, eviction, quarantine) leaves a closed segment below
``live_fraction`` (``Compactor.segments_changed``, a cheap check of the transaction's own ledger, offers it to
an automatic pass, at most once per ``REOFFER_S``) or this writer closes its active segment below
it (``Compactor.segment_rotated``), from ``LmdbTier.compact_segments`` / ``compact_segments_sync`` and from ``kvtier gc``.

Primitives here, pure and for any thread: ``SegmentUsage`` / ``usage_row`` / ``usage_rows`` (the
``segments`` table's rows), ``closed_segments`` (which candidates no writer holds, given a probe),
``choose_segments``, ``take_for_pass`` (bounded by ``PASS_LIVE_BYTES``), ``eviction_horizon``,
``PlannedPass``, ``CompactionReport``, ``check_live_fraction``; ``oldest_reader`` and
``segment_disk_bytes`` read the environment's reader table and the directory. The passes
themselves (read transactions, writer-thread steps, the automatic scheduling) are
``compactor.Compactor``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import lmdb

from .segment_files import segment_files
from .segments import LIVE

__all__ = [
    "SegmentUsage",
    "usage_row",
    "usage_rows",
    "closed_segments",
    "choose_segments",
    "take_for_pass",
    "eviction_horizon",
    "PlannedPass",
    "CompactionReport",
    "segment_disk_bytes",
    "DEFAULT_COMPACTION_LIVE_FRACTION",
    "check_live_fraction",
    "oldest_reader",
]

# A closed segment less than half live is rewritten: the copy costs at most as many bytes as it frees,
# and the files never hold more than twice the live bytes (plus the active segments).
DEFAULT_COMPACTION_LIVE_FRACTION = 0.5
# Bytes of records moved per write transaction (a put waits at most about one step). Measured
# (bench_compaction, 256 MiB of 1 MiB records, 30 % live): moves ran at 320-360 MB/s with 8, 16 or
# 32 MiB steps alike, while a single-record put during the pass took at most 27 / 48 / 106 ms.
STEP_BYTES = 8 << 20
# Segment files may exceed the capacity by this fraction before the capacity rule takes more
# segments than the live-fraction rule does (the active segment and page padding live there).
DISK_MARGIN = 0.25
# The capacity rule leaves segments at least this live: rewriting them would free little.
_CAPACITY_RULE_MAX_LIVE = 0.9
_PAGE = 4096
# Live bytes one pass takes at most (its plan holds a key and a pointer per record, and goes stale
# as it runs); a pass that leaves candidates behind is followed by another.
PASS_LIVE_BYTES = 4 << 30
# An emptied source waits for read transactions older than its emptying commit; a pass's caller
# retries this often, this long apart, before leaving the rest to a timer (reads finish in ms).
RETIRE_TRIES = 50
RETIRE_WAIT_S = 0.02
# A segment below the fraction is offered to an automatic pass at most this often (a pass that had
# to skip it -- another process still appends to it -- retries once a later commit touches it).
REOFFER_S = 30.0
# The share of time automatic planning may take (a plan walks every key of ``atime``: seconds for
# millions of records): the next automatic plan starts no sooner than its duration / PLAN_DUTY later.
PLAN_DUTY = 0.05
# How far from the LRU's old end an automatic pass leaves records to eviction (``eviction_horizon``).
EVICTION_HORIZON_SEGMENTS = 4


def check_live_fraction(value: object, name: str = "segment_compaction_live_fraction") -> float:
    """Validate a compaction live fraction: a number in [0, 1) (0 turns compaction off);
    ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SegmentUsage:
    """One row of the ``segments`` table: live record bytes, live records, committed end.

    Each live record also takes about a page of padding in the file (its head page, its payload's
    last partial page), which a copy takes again: counted as live, so a segment of small records
    that is all live never looks worth rewriting."""

    name: str
    live_bytes: int
    live_records: int
    committed_end: int

    @property
    def live_extent(self) -> int:
        return min(self.committed_end, self.live_bytes + self.live_records * _PAGE)

    @property
    def live_fraction(self) -> float:
        return self.live_extent / self.committed_end if self.committed_end else 1.0

    @property
    def dead_bytes(self) -> int:
        """What rewriting the segment gives back."""
        return self.committed_end - self.live_extent


def choose_segments(usage: Sequence[SegmentUsage], closed: Set[str], *, live_fraction: float,
                    disk_budget_bytes: Optional[int] = None) -> List[SegmentUsage]:
    """The segments to compact, least live first: every closed one below ``live_fraction``; then,
    while all segments' committed bytes minus the dead bytes of those chosen exceed
    ``disk_budget_bytes``, further closed ones below ``_CAPACITY_RULE_MAX_LIVE`` live. Pure."""
    if live_fraction <= 0:
        return []
    ordered = sorted((u for u in usage if u.name in closed), key=lambda u: (u.live_fraction, u.name))
    chosen = [u for u in ordered if u.live_fraction < live_fraction]
    if disk_budget_bytes is not None:
        projected = sum(u.committed_end for u in usage) - sum(u.dead_bytes for u in chosen)
        for u in ordered:
            if projected <= disk_budget_bytes:
                break
            if u not in chosen and u.live_fraction < _CAPACITY_RULE_MAX_LIVE:
                chosen.append(u)
                projected -= u.dead_bytes
    return chosen


def usage_row(name: str, value: "Optional[bytes | memoryview]") -> Optional[SegmentUsage]:
    """The ``segments`` table's row ``value`` of segment ``name`` (None: absent or not a row)."""
    return SegmentUsage(name, *LIVE.unpack(value)) if value is not None and len(value) == LIVE.size else None


def usage_rows(rows: Iterable[Tuple["bytes | memoryview", "bytes | memoryview"]]) -> List[SegmentUsage]:
    """Every well-formed (name, value) row of the ``segments`` table."""
    out = []
    for key, value in rows:
        usage = usage_row(bytes(key).decode(errors="replace"), value)
        if usage is not None:
            out.append(usage)
    return out


def closed_segments(usage: Sequence[SegmentUsage], live_fraction: float, *, active: Optional[str], budgeted: bool,
                    ours: str, held: Callable[[str], Optional[bool]]) -> Tuple[Set[str], Set[str]]:
    """(closed, locked): of the segments that could be chosen -- not ``active``, below
    ``live_fraction`` or (``budgeted``: a disk budget applies) below the capacity rule's limit --
    those no writer holds and those one does. ``held(name)`` probes a file's writer lock (None:
    the file is gone, its records are misses); names starting with ``ours`` (this process's, which
    appends to its active one only) are never probed: each probe takes the lock for an instant, and
    a remove_dead elsewhere that meets it leaves that file for the next open."""
    could = max(live_fraction, _CAPACITY_RULE_MAX_LIVE if budgeted else 0.0)
    closed: Set[str] = set()
    locked: Set[str] = set()
    for u in usage:
        if u.name == active or u.live_fraction >= could:
            continue
        state = False if u.name.startswith(ours) else held(u.name)
        if state is None:
            continue
        (locked if state else closed).add(u.name)
    return closed, locked


def take_for_pass(chosen: Sequence[SegmentUsage]) -> Tuple[List[SegmentUsage], bool]:
    """The chosen segments one pass takes -- at least one, then while their live bytes stay within
    ``PASS_LIVE_BYTES`` (bounded memory) -- and whether any are left for the next pass."""
    taken, live = 0, 0
    for u in chosen:
        if taken and live + u.live_bytes > PASS_LIVE_BYTES:
            break
        taken, live = taken + 1, live + u.live_bytes
    return list(chosen[:taken]), taken < len(chosen)


def eviction_horizon(lru_order: Iterable[bytes], total_bytes: int, size_of: Callable[[bytes], int], *,
                     capacity: Optional[int], segment_max_bytes: int) -> "frozenset[bytes]":
    """The keys the LRU evicts next -- the oldest ``EVICTION_HORIZON_SEGMENTS`` segments' worth, from
    ``lru_order`` (first victim first) -- when the tier is within a tenth of its ``capacity``; else
    none. An automatic pass does not move them: under steady eviction the segment being eaten from
    its old end falls below the fraction long before it is empty, and moving its survivors just
    ahead of their eviction wrote 228 MiB for every 384 MiB put (measured: 64 MiB capacity, 8 MiB
    segments, 1 MiB records, no reads). Records kept young by reads are outside it: they move."""
    if capacity is None or total_bytes < 0.9 * capacity:
        return frozenset()
    horizon = min(capacity // 2, EVICTION_HORIZON_SEGMENTS * segment_max_bytes)
    doomed = []
    total = 0
    for key in lru_order:
        if total >= horizon:
            break
        doomed.append(key)
        total += size_of(key)
    return frozenset(doomed)


@dataclass
class CompactionReport:
    """What one compaction pass did: ``segments`` chosen, ``records`` / ``bytes`` moved,
    ``files_freed`` / ``bytes_freed`` (source files deleted, their sizes), ``quarantined`` (corrupt
    sources), ``superseded`` (records a concurrent write changed first: left to it),
    ``skipped_locked`` (segments below the threshold that a writer still appends to),
    ``left_to_eviction`` (records an automatic pass left where they are: the LRU evicts them next)."""

    segments: int = 0
    records: int = 0
    bytes: int = 0
    files_freed: int = 0
    bytes_freed: int = 0
    quarantined: int = 0
    superseded: int = 0
    skipped_locked: int = 0
    left_to_eviction: int = 0

    def add(self, other: "CompactionReport") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class PlannedPass:
    """A planned pass: the records still to move, in file order, and its running report."""

    pending: Deque[Tuple[bytes, bytes]]  # (key, the pointer it held when planned)
    sizes: Dict[str, int]  # source segment -> file size when planned (bytes a deletion frees)
    report: CompactionReport = field(default_factory=CompactionReport)
    more: bool = False  # more segments were candidates than one pass takes
    automatic: bool = False  # spares the records the LRU evicts next (``eviction_horizon``)

    @property
    def done(self) -> bool:
        return not self.pending


def segment_disk_bytes(directory: Path) -> int:
    """Bytes the segment files in ``directory`` take (their sizes), for reports and tests."""
    total = 0
    for name in segment_files(directory):
        try:
            total += os.stat(directory / name).st_size
        except FileNotFoundError:
            pass
    return total


def oldest_reader(env: lmdb.Environment) -> Optional[int]:
    """The oldest snapshot (transaction id) an open read transaction of any process reads, from
    LMDB's reader table (``mdb_reader_list``: a header line, then ``pid thread txnid`` per slot,
    ``-`` for an idle one); ``None`` when none is open."""
    oldest: Optional[int] = None
    for line in env.readers().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[2].isdigit():
            txnid = int(parts[2])
            oldest = txnid if oldest is None else min(oldest, txnid)
    return oldest
