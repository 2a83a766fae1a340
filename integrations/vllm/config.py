"""The settings of ``KvtierTier``, read from the tier's dict in vLLM's ``kv_connector_extra_config``.

Pure: no vLLM import, so the validation is testable (and its errors readable) without vLLM.
Every key is validated at construction; a bad one is a ``VllmTierConfigError`` (a ``ValueError``)
naming the key and the value, raised before any directory or thread exists.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from kvtier.engine.config import StoreConfig, store_config_of
from kvtier.errors import KvtierError
from kvtier.tiers.admission import ADMISSION_NAMES
from kvtier.tiers.lmdb.compaction import check_live_fraction
from kvtier.tiers.lmdb.segments import check_segment_threshold
from kvtier.tiers.lru import BYTE_INDEX_NAMES

__all__ = ["VllmTierConfig", "VllmTierConfigError", "DISK_ADMISSIONS", "SEEN_TAIL"]


class VllmTierConfigError(KvtierError, ValueError):
    """A key of the ``KvtierTier`` config dict is unknown, missing or out of range."""


_NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# tiers/admission.py's names, and the tier's own: ``seen-tail`` writes every chunk but a store
# job's last one per group (the request's tail, by the positions vLLM's ReqContext records),
# which is written only when seen before.
SEEN_TAIL = "seen-tail"
DISK_ADMISSIONS = tuple(sorted(ADMISSION_NAMES + (SEEN_TAIL,)))
# The store's defaults, the engine's: a key left out means what it means for an OffloadEngine.
_STORE = StoreConfig()


@dataclass(frozen=True)
class VllmTierConfig:
    """Typed settings, units in the names.

    ``cache_dir``: the LMDB directory (created 0700). ``disk_capacity_bytes``: LRU bound on stored
    record bytes (``None``: unbounded). ``lmdb_segment_threshold_bytes``: records of at least this
    many encoded bytes go to O_DIRECT segment files beside LMDB's index (default 128 KiB, where
    they start to write faster; ``null`` or 0 keeps every record inside LMDB).
    ``lmdb_segment_compaction_live_fraction``: a closed segment file whose live bytes fall below this
    fraction has its live records moved and is deleted (default 0.5; 0 turns it off). ``compression``: zstd level 1..22 on the byte planes, or 0
    for raw records. ``remote_url``: ``redis://host:port`` or ``redis+cluster://h1:p1,...`` of a
    Valkey/Redis server shared by a fleet, chained write-through behind the disk (``None``: disk
    only); ``remote_namespace`` separates caches on one server. ``weights_version``: a tag bound
    into every key (bump it when the weights change under the same model name).
    ``hash_algorithm``: vLLM's ``--prefix-caching-hash-algo``; the tier reads it back from vLLM's
    seeded NONE_HASH at its first lookup, and refuses (every lookup misses, said once) a value
    that contradicts it. ``max_inflight_jobs``: stores beyond this many unfinished jobs are
    refused at once (reported failed: vLLM keeps its CPU copy) instead of queueing without bound.
    ``op_timeout_s``: the longest the tier waits for its own loop thread at start and shutdown.
    ``enable_kv_events``: emit vLLM KV events for stored chunks (when vLLM enables events).
    ``read_only``: serve hits from ``cache_dir`` and never write it (a read-only mount of a warmed
    cache; also chosen, with one warning, when ``cache_dir`` exists and cannot be written).
    ``lmdb_verify_on_open`` and ``quarantine_corrupt_cache_dir``: as ``EngineConfig``'s, on by
    default: the LMDB file's structure is checked before LMDB maps it, and a damaged cache
    directory is moved aside and replaced by an empty one (off: the tier refuses to start, with
    ``CorruptCacheError``, and leaves the directory alone). ``eviction_policy``: the LMDB tier's
    capacity eviction, as ``EngineConfig``'s (``arc-lfuda``: LFU-DA, ``lfuda`` or ``lru``).
    ``disk_admission``: which chunks vLLM cascades down are written, by ``tiers/admission.py``'s
    name (``all``: every one; ``seen``: only a chunk stored once before, so a first store is
    declined, reported done with 0 bytes written, and never indexed), or ``seen-tail`` (every
    chunk but each store job's last one per group, which ``seen`` decides, at any disk size).
    ``seen`` holds only while the disk holds at most as many rows as vLLM's CPU tier
    (``make_admission``); both need a ``disk_capacity_bytes`` (an unbounded disk takes every chunk).

    The store's keys default to ``StoreConfig``'s (the engine's) defaults, and ``store_config``
    turns them into the ``StoreConfig`` the tier opens its ``DiskStore`` with; every store setting
    this dict has no key for is the engine's default too.
    """

    cache_dir: str
    disk_capacity_bytes: Optional[int] = _STORE.disk_capacity_bytes
    compression: int = _STORE.compression_level
    remote_url: Optional[str] = _STORE.remote_url
    # Not the engine's "default": a vLLM fleet's records stay apart from embedders' on one server.
    remote_namespace: str = "vllm"
    weights_version: str = ""
    hash_algorithm: Optional[str] = None
    max_inflight_jobs: int = 1024
    read_workers: int = _STORE.read_workers
    op_timeout_s: float = 30.0
    enable_kv_events: bool = False
    locality: Optional[str] = None
    lmdb_segment_threshold_bytes: Optional[int] = _STORE.lmdb_segment_threshold_bytes
    lmdb_segment_compaction_live_fraction: float = _STORE.lmdb_segment_compaction_live_fraction
    lmdb_verify_on_open: bool = _STORE.lmdb_verify_on_open
    quarantine_corrupt_cache_dir: bool = _STORE.quarantine_corrupt_cache_dir
    eviction_policy: str = _STORE.eviction_policy
    disk_admission: str = "all"
    read_only: bool = _STORE.read_only

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> VllmTierConfigError:
            return VllmTierConfigError(f"KvtierTier {name} must be {want}, got {getattr(self, name)!r}")

        if not isinstance(self.cache_dir, str) or not self.cache_dir or "\x00" in self.cache_dir:
            raise bad("cache_dir", "a non-empty path string")
        cap = self.disk_capacity_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise bad("disk_capacity_bytes", "a positive int or null")
        try:
            check_segment_threshold(self.lmdb_segment_threshold_bytes, "KvtierTier lmdb_segment_threshold_bytes", "null")
        except ValueError as exc:
            raise VllmTierConfigError(str(exc)) from None
        try:
            check_live_fraction(self.lmdb_segment_compaction_live_fraction, "KvtierTier lmdb_segment_compaction_live_fraction")
        except ValueError as exc:
            raise VllmTierConfigError(str(exc)) from None
        if isinstance(self.compression, bool) or not isinstance(self.compression, int) or not 0 <= self.compression <= 22:
            raise bad("compression", "an int in 0..22 (0: raw records)")
        if self.remote_url is not None and (not isinstance(self.remote_url, str) or "://" not in self.remote_url):
            raise bad("remote_url", "a redis:// or redis+cluster:// URL or null")
        if not isinstance(self.remote_namespace, str) or not _NAMESPACE.match(self.remote_namespace):
            raise bad("remote_namespace", "1..64 characters of [A-Za-z0-9._-]")
        if not isinstance(self.weights_version, str):
            raise bad("weights_version", "a string")
        if self.hash_algorithm is not None and self.hash_algorithm not in HASH_ALGORITHMS:
            raise bad("hash_algorithm", f"one of {', '.join(HASH_ALGORITHMS)} or null")
        for name in ("max_inflight_jobs", "read_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "an int >= 1")
        t = self.op_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise bad("op_timeout_s", "a finite number of seconds > 0")
        for name in ("enable_kv_events", "lmdb_verify_on_open", "quarantine_corrupt_cache_dir", "read_only"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if self.eviction_policy not in BYTE_INDEX_NAMES:
            raise bad("eviction_policy", f"one of {', '.join(BYTE_INDEX_NAMES)}")
        if self.disk_admission not in DISK_ADMISSIONS:
            raise bad("disk_admission", f"one of {', '.join(DISK_ADMISSIONS)}")
        if self.locality is not None and self.locality not in ("LOCAL", "REMOTE"):
            raise bad("locality", "LOCAL, REMOTE or null")
        try:
            self.store_config()  # what the keys above do not say alone (the remote URL's form)
        except ValueError as exc:
            raise VllmTierConfigError(f"KvtierTier {exc}") from None

    def store_config(self, read_only: Optional[bool] = None) -> StoreConfig:
        """The store's settings these keys give (``read_only`` overrides the key: the tier also
        chooses it for a ``cache_dir`` it cannot write). ``compression`` 0 is raw records, else
        the zstd level; every other store setting keeps ``StoreConfig``'s default."""
        return store_config_of(self, compression=self.compression,
                               read_only=self.read_only if read_only is None else read_only)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "VllmTierConfig":
        """Build from the tier's dict; an unknown key is an error (a typo must not pass silently)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise VllmTierConfigError(
                f"KvtierTier got unknown config key(s) {unknown}; known keys: {sorted(known)}"
            )
        if "cache_dir" not in values:
            raise VllmTierConfigError("KvtierTier needs 'cache_dir' (the LMDB directory) in its config")
        return cls(**dict(values))
