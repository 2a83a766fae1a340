"""The file tier: one file per chunk, for shared filesystems (NFS, Lustre) where LMDB must not go.

Modules, one concern each: ``tier`` (``FileTier``: the async facade that wires the others, the
read path, quarantine), ``index`` (the index, sequence, keys being written and counters; event
loop only), ``writes`` (the write path: temp files, renames, directory fsyncs, rollback, eviction),
``ops`` (the I/O pool and every blocking file operation behind the fault hook), ``scan`` (what a
root holds, stale temp files, root safety), ``layout`` (where records, temp files and the
quarantine live; the small OS calls the tier relies on).
"""

from .layout import QUARANTINE_DIR, RECORD_SUFFIX, TEMP_SUFFIX
from .tier import FileTier

__all__ = ["FileTier", "RECORD_SUFFIX", "TEMP_SUFFIX", "QUARANTINE_DIR"]
