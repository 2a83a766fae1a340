"""The file tier: one file per chunk, for shared filesystems (NFS, Lustre) where LMDB must not go.

Modules, one concern each: ``tier`` (``FileTier``: the async facade, the read path, quarantine),
``writes`` (the write path: temp files, renames, directory fsyncs, rollback, eviction), ``scan`` (what a root holds, stale temp files, root safety), ``layout`` (where records,
temp files and the quarantine live; the small OS calls the tier relies on).
"""

from .layout import QUARANTINE_DIR, RECORD_SUFFIX, TEMP_SUFFIX
from .tier import FileTier

__all__ = ["FileTier", "RECORD_SUFFIX", "TEMP_SUFFIX", "QUARANTINE_DIR"]
