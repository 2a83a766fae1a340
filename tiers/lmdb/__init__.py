"""The LMDB disk tier: one LMDB environment per cache directory on local disk (NVMe).

Modules, one concern each:

- ``tier``: ``LmdbTier``, the async ``ChunkTier`` facade that builds and wires the parts below.
- ``environment``: the LMDB environment, its tables, the map lock and the counters (any thread).
- ``writes``: the writer side: every write transaction, the LRU index and sequence they own, the
  segment writer (writer thread only).
- ``reads``: the reader side: the read pool, the read path, the segment reader (not the writer).
- ``compaction``: why and how segments are compacted, and the planning rules (pure functions);
  ``compactor``: the passes (plans on read threads, writer-thread steps, automatic scheduling).
- ``tables``: the named databases and their value formats.
- ``opening`` / ``recovery``: the steps around ``lmdb.open``; checks of a directory before LMDB
  maps it, and moving a damaged one aside.
- ``maintenance``: blocking walks for tools: ``iter_records``, ``verify``.
- ``segments``: large records in append-only payload files beside ``data.mdb`` (on from
  ``DEFAULT_SEGMENT_THRESHOLD_BYTES``), LMDB keeping a pointer; ``segment_files``: a segment
  file's life (who holds it, deleting dead ones, reclaiming what a crash left).
- ``timer``: the periodic housekeeping thread (stale readers, access-time flushes).
"""

from kvtier.errors import CorruptCacheError

from .maintenance import RecordInfo, VerifyReport
from .recovery import open_replacing_damaged, quarantine_cache_dir, structure_walk_due
from .segments import DEFAULT_SEGMENT_THRESHOLD_BYTES
from .tier import LmdbTier

__all__ = ["LmdbTier", "RecordInfo", "VerifyReport", "CorruptCacheError", "quarantine_cache_dir",
           "open_replacing_damaged", "structure_walk_due", "DEFAULT_SEGMENT_THRESHOLD_BYTES"]
