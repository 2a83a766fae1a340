"""The LMDB disk tier: one LMDB environment per cache directory on local disk (NVMe).

Modules, one concern each:

- ``tier``: ``LmdbTier``, the async ``ChunkTier`` facade, opening, and the read path (read pool).
- ``writes``: the writer thread's transaction bodies and the in-memory LRU index they own.
- ``tables``: the named databases and their value formats.
- ``recovery``: checks of a directory before LMDB maps it, and moving a damaged one aside.
- ``maintenance``: blocking walks for tools: ``iter_records``, ``verify``, ``gc``.
- ``segments``: large records in append-only payload files beside ``data.mdb`` (on from
  ``DEFAULT_SEGMENT_THRESHOLD_BYTES``), LMDB keeping a pointer.
- ``timer``: the periodic housekeeping thread (stale readers, access-time flushes).
"""

from kvtier.errors import CorruptCacheError

from .maintenance import RecordInfo, VerifyReport
from .recovery import open_replacing_damaged, quarantine_cache_dir
from .segments import DEFAULT_SEGMENT_THRESHOLD_BYTES
from .tier import LmdbTier

__all__ = ["LmdbTier", "RecordInfo", "VerifyReport", "CorruptCacheError", "quarantine_cache_dir",
           "open_replacing_damaged", "DEFAULT_SEGMENT_THRESHOLD_BYTES"]
