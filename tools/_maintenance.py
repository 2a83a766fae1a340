"""``kvtier inspect``, ``kvtier verify`` and ``kvtier gc`` over a cache directory's LMDB tier.

Primitives: ``inspect_cache`` (records per group, bytes raw and stored, compression, age),
``verify_cache`` (read and check every record), ``gc_cache`` (evict least-recently-used records down
to a bound on their stored bytes, then compact mostly-dead payload segments; bytes on disk reported). All blocking: they open the tier synchronously, on the calling thread.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from kvtier.errors import KvtierError
from kvtier.tiers.base import RemovalCallback
from kvtier.tiers.lmdb import LmdbTier
from kvtier.tiers.lmdb.compaction import DEFAULT_COMPACTION_LIVE_FRACTION, segment_disk_bytes

__all__ = ["inspect_cache", "verify_cache", "gc_cache", "GroupReport", "InspectReport"]


@dataclass
class GroupReport:
    records: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    compressed_records: int = 0
    oldest_access_age_s: Optional[float] = None
    newest_access_age_s: Optional[float] = None

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass
class InspectReport:
    """``file_bytes``: LMDB's ``data.mdb``. Segment files (records of the segment threshold and
    more, ``tiers/lmdb/segments.py``): how many and their bytes on disk, the records they hold and
    those records' bytes; ``segment_live_fraction`` is live bytes over file bytes (what a
    compaction could give back is the rest)."""

    cache_dir: str
    tier: str
    records: int
    raw_bytes: int
    stored_bytes: int
    unreadable_headers: int
    file_bytes: int
    groups: Dict[int, GroupReport] = field(default_factory=dict)
    segment_files: int = 0
    segment_file_bytes: int = 0
    segment_records: int = 0
    segment_live_bytes: int = 0

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def segment_live_fraction(self) -> float:
        return self.segment_live_bytes / self.segment_file_bytes if self.segment_file_bytes else 1.0

    def to_dict(self) -> Dict[str, object]:
        data = asdict(self)
        data["compression_ratio"] = self.compression_ratio
        data["segment_live_fraction"] = self.segment_live_fraction
        data["groups"] = {
            str(g): dict(asdict(report), compression_ratio=report.compression_ratio)
            for g, report in sorted(self.groups.items())
        }
        return data


def _require_cache(cache_dir: str) -> None:
    if not os.path.isdir(cache_dir) or not os.path.exists(os.path.join(cache_dir, "data.mdb")):
        raise FileNotFoundError(f"no kvtier cache at {cache_dir} (expected an LMDB data.mdb there)")


def inspect_cache(cache_dir: str) -> InspectReport:
    """Summarise every record of the LMDB tier at ``cache_dir`` (read-only)."""
    _require_cache(cache_dir)
    now_ns = time.time_ns()
    with LmdbTier(cache_dir, readonly=True, map_size_bytes=1 << 20, verify_structure=True) as tier:
        report = InspectReport(cache_dir, "lmdb", 0, 0, 0, 0, os.path.getsize(os.path.join(cache_dir, "data.mdb")))
        for info in tier.iter_records():
            report.records += 1
            report.stored_bytes += info.stored_bytes
            if info.segment is not None:
                report.segment_records += 1
                report.segment_live_bytes += info.stored_bytes
            if info.header is None:
                report.unreadable_headers += 1
                continue
            group = report.groups.setdefault(info.header.meta.group_index, GroupReport())
            group.records += 1
            group.raw_bytes += info.header.raw_length
            group.stored_bytes += info.stored_bytes
            report.raw_bytes += info.header.raw_length
            if info.header.codec != "raw":
                group.compressed_records += 1
            if info.atime_ns:
                age = max(0.0, (now_ns - info.atime_ns) / 1e9)
                group.oldest_access_age_s = max(age, group.oldest_access_age_s or 0.0)
                group.newest_access_age_s = age if group.newest_access_age_s is None else min(age, group.newest_access_age_s)
    for path in Path(cache_dir).glob("seg-*.kvs"):
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue  # deleted by a writer since the listing
        report.segment_files += 1
        report.segment_file_bytes += size
    return report


def verify_cache(cache_dir: str, *, quarantine: bool = True):
    """Read and check every record; returns the tier's ``VerifyReport`` (bad ones listed)."""
    _require_cache(cache_dir)
    # verify_structure: a damaged B-tree is reported as a CorruptCacheError (LMDB could crash on it).
    with LmdbTier(cache_dir, readonly=not quarantine, map_size_bytes=1 << 20, verify_structure=True) as tier:
        return tier.verify(quarantine=quarantine)


def gc_cache(cache_dir: str, max_bytes: int, *, on_removed: Optional[RemovalCallback] = None) -> Dict[str, int]:
    """Evict least-recently-used records until their stored bytes are at most ``max_bytes``, then
    compact the payload segments left mostly dead (``LmdbTier.compact_segments_sync``).

    ``max_bytes`` bounds the records' stored bytes, not the directory: ``data.mdb`` keeps its size
    (LMDB reuses freed pages for later writes, it never returns them to the filesystem) and a
    segment file is compacted only once less than half of it is live. So the report gives both:
    stored bytes before/after, and the bytes the directory's files take on disk before/after, with
    the segment files counted before/after (eviction deletes a file with its last record, compaction
    the rest it frees). ``on_removed``: called (on the tier's writer thread) with each batch of
    records evicted, before this returns (``LmdbTier.subscribe_removals``)."""
    if max_bytes < 0:
        raise ValueError(f"--max-bytes must be >= 0, got {max_bytes}")
    _require_cache(cache_dir)
    directory = Path(cache_dir)
    disk_before, files_before = _disk_bytes(directory), len(list(directory.glob("seg-*.kvs")))
    # automatic passes off: the one explicit pass after the eviction does the work and reports it whole
    with LmdbTier(cache_dir, map_size_bytes=1 << 20, verify_structure=True, segment_compaction_live_fraction=0) as tier:
        if on_removed is not None:
            tier.subscribe_removals(on_removed)
        before = tier.statistics().bytes
        segments_before = segment_disk_bytes(tier.path)
        evicted = tier.gc(max_bytes)
        after = tier.statistics().bytes
        compacted = tier.compact_segments_sync(live_fraction=DEFAULT_COMPACTION_LIVE_FRACTION)
        segments_after = segment_disk_bytes(tier.path)
    return {"evicted_records": evicted, "bytes_before": before, "bytes_after": after,
            "compacted_records": compacted.records, "compacted_segments": compacted.files_freed,
            "segment_bytes_before": segments_before, "segment_bytes_after": segments_after,
            "segment_files_before": files_before, "segment_files_after": len(list(directory.glob("seg-*.kvs"))),
            "disk_bytes_before": disk_before, "disk_bytes_after": _disk_bytes(directory)}


def _disk_bytes(directory: Path) -> int:
    """Bytes the files directly in ``directory`` take on disk (allocated blocks: a sparse file counts
    what it holds, not its length)."""
    total = 0
    for path in directory.iterdir():
        try:
            info = path.stat()
        except FileNotFoundError:
            continue  # deleted by a writer since the listing
        if path.is_file():
            total += info.st_blocks * 512
    return total
