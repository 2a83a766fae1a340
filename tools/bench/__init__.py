"""``kvtier bench``: kvtier's tiers and engine next to the limits and baselines of this machine.

Primitives: ``run_bench`` (async; returns a ``BenchReport``), ``run_bench_command`` (the CLI
entry: prints a table or one JSON object, returns the exit code), ``BenchRow``, ``BenchReport``,
``format_report``, and the measurement functions each figure comes from (``measure_*``; small enough
to call with tiny sizes from a smoke test). Runs on the caller's event loop; the tiers and the
engine use their own threads as in production.

Every figure is a ratio against a limit or a baseline measured in the same run, because these
machines are shared and noisy (absolute speeds drift by 2x within minutes). Per chunk size
(256 KiB, 1 MiB, 4 MiB; paired rounds of 256 MiB each: ``--quick`` runs 3 of them per size, the full
run 4, so both reach the same steady state and the quick run is only less precise):

- Limits: ``memcpy`` of each chunk into a preallocated, pre-faulted buffer (``torch`` ``copy_``,
  slices made before the clock starts); a raw sequential write of the same bytes with one
  ``fdatasync`` at the end (the most favourable pattern for the disk); a cold sequential read of
  that file after ``fdatasync`` + ``POSIX_FADV_DONTNEED`` + (as root) ``drop_caches``. Raw write and
  read run before and after the kvtier measurements of a size; the better run is the limit, so a
  disk that sped up meanwhile counts against kvtier.
- Baseline a user would otherwise pick: one file per chunk with ``aiofiles`` (temp file, ``fsync``,
  rename, every chunk gathered at once on the default executor), as LMCache's and vLLM's file
  tiers do, and its cold read back.
- kvtier: device -> host staging (``DeviceKVView.gather_many_groups`` into ``HostSlabPool`` slots,
  64 MiB per call); host -> LMDB spill (``LmdbTier.put_many``, durable, batches of 64 MiB / 256
  chunks as the engine's spill makes them, raw codec and zstd byte planes); LMDB -> host cold
  restore (``get_many_into`` after dropping ``data.mdb`` from the page cache); the file tier; and
  end to end through ``OffloadEngine`` (store until every chunk is durable; after a restart and a
  dropped page cache, lookup + load of every request into device blocks). Restored bytes are
  checked against the originals; a mismatch fails the run.
- Engine bookkeeping per chunk (``tools.bench.engine``); ``longest_hit`` on a 131072-token request.
  The host-only store-until-released figure also runs alone: ``python -m kvtier.tools.bench.release``.
- Coverage: SWA store bytes on a DeepSeek-V4-like layout at 100K tokens against storing every
  chunk and against a brute-force minimal set (they must be equal: exit code 1 otherwise).
- Compression: zstd byte planes on real bf16 KV of a tiny random-init Gemma3 (built from a
  config, no download): ratio against plain zstd, encode/decode speed against the disk.

The KV bytes of the tier measurements are ``randn`` in bfloat16: their high bytes (sign and
exponent) compress like real KV's, their low bytes barely do. Before measuring, the run touches
and frees as much memory as it will use, so first-touch costs of a fresh VM (lazily backed guest
memory: ~0.2 GB/s here) land on no measurement in particular.

Inner modules (this package's names are their surface): ``_settings`` (sizes, budgets, targets),
``_report`` (rows and the table), ``_machine`` (filesystem, page-cache drops, first-touch memory),
``_kv`` (the KV bytes and paged layout, copy limits), ``_subjects`` (what the disk figures time, and
the ``TIER_SUBJECTS`` registry where a new subject goes), ``_rounds`` (paired rounds), ``_figures``
(policy and compression), ``_compressed``, ``_release``, ``_remote``, ``_peers``, ``_run``.
The standalone probes, each ``python -m kvtier.tools.bench.NAME``: ``engine`` (bookkeeping per
chunk), ``keys`` (chunk keys on a long prompt), ``longest_hit`` (the policy's hot functions),
``segments`` (the disk write path), ``compaction`` (what segment compaction costs), ``metasync``
(LMDB metadata sync modes).
"""

from ._figures import (
    deepseek_v4_like_layout,
    gemma3_kv_bytes,
    measure_compression,
    measure_coverage,
    measure_longest_hit,
)
from ._kv import KVGeometry, make_kv_bytes, measure_memcpy, measure_piece_copy, measure_staging
from ._machine import drop_page_cache
from ._report import BenchReport, BenchRow, format_report
from ._rounds import PairedTimes, run_paired
from ._run import run_bench, run_bench_command
from ._settings import SIZES
from ._subjects import TIER_SUBJECTS, DiskSubject, EngineSubject, FilePerChunk, RawFile, RowContext, SubjectSpec, TierSubject

__all__ = [
    "BenchRow",
    "BenchReport",
    "run_bench",
    "run_bench_command",
    "format_report",
    "measure_memcpy",
    "measure_staging",
    "measure_piece_copy",
    "run_paired",
    "DiskSubject",
    "RawFile",
    "FilePerChunk",
    "TierSubject",
    "EngineSubject",
    "PairedTimes",
    "SubjectSpec",
    "RowContext",
    "TIER_SUBJECTS",
    "KVGeometry",
    "make_kv_bytes",
    "deepseek_v4_like_layout",
    "gemma3_kv_bytes",
    "measure_longest_hit",
    "measure_coverage",
    "measure_compression",
    "drop_page_cache",
    "SIZES",
]
