"""The settings: frozen, typed, validated records, with units in every field name.

Primitives: ``StoreConfig`` (the disk and remote tiers' settings, the record ``DiskStore`` opens
with), ``EngineConfig`` (a ``StoreConfig`` plus the engine's own settings; its defaults and their
reasons, validation) and their loaders ``from_dict`` / ``from_toml`` / ``from_env`` / ``load``
(defaults < TOML < environment < overrides); how a value is read (``"256MiB"``, ``"true"``, a
variable) is ``config_values.py``'s. Pure and synchronous; safe on any thread.

Every error is a ``ValueError`` that names the field (or the environment variable / TOML file it came
from) and the offending value, like ``kvtier.policy``'s constructors: a bad setting is a bad argument.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple, Type, TypeVar, Union

from kvtier.tiers.admission import ADMISSION_NAMES
from kvtier.tiers.eviction import eviction_policy_names
from kvtier.tiers.lru import BYTE_INDEX_NAMES
from kvtier.tiers.lmdb.segments import DEFAULT_SEGMENT_THRESHOLD_BYTES, check_segment_threshold
from kvtier.tiers.lmdb.tier import DEFAULT_READ_WORKERS

from .config_values import (ENV, FieldKinds, coerce, env_settings, naming_variables, read_toml, require_bool,
                            require_choice, require_float, require_fraction, require_int, require_seconds)

logger = logging.getLogger("kvtier.engine")

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.tiers.record_format import CodecConfig

__all__ = ["EngineConfig", "StoreConfig", "codec_settings", "store_config_of"]

_KiB = 1 << 10
_MiB = 1 << 20
_GiB = 1 << 30

HOST_EVICTION_POLICIES: Tuple[str, ...] = eviction_policy_names()
EVICTION_POLICIES: Tuple[str, ...] = BYTE_INDEX_NAMES
DEVICE_KINDS: Tuple[str, ...] = ("cpu", "cuda")
REMOTE_WRITE_POLICIES: Tuple[str, ...] = ("write_through", "write_back_on_evict")

# LMDB tier's smallest map (tiers/lmdb: smaller maps grow on the first batch anyway).
_LMDB_MIN_MAP_SIZE_BYTES = _MiB
# ...and the most its map grows to (LmdbTier's max_map_size_bytes, which the engine leaves at its
# default): an initial map above it could never open.
_LMDB_MAX_MAP_SIZE_BYTES = 1 << 40
# No machine has 2**62 bytes of memory or disk; sizes above it are typos (2**80 = "1 YiB").
_MAX_SIZE_BYTES = 1 << 62

# zstd's regular levels. Negative ("fast") levels are left out: the byte-plane codec tunes its own
# level-1 parameters and a faster level buys nothing against a disk at ~0.5 GB/s.
_COMPRESSION_LEVEL_RANGE = (1, 22)


_C = TypeVar("_C", bound="StoreConfig")


@dataclass(frozen=True)
class StoreConfig:
    """Settings of the store below a front end's host memory (``kvtier.engine.store.DiskStore``):
    the LMDB disk tier at ``cache_dir`` and the remote tier chained behind it. The one record of
    them: ``EngineConfig`` extends it (its flat field names are the TOML/env keys) and opens its
    store with ``config.store``; the vLLM tier builds one from its own keys. Construct directly,
    or through a loader (``from_dict`` / ``from_toml`` / ``from_env`` / ``load``, as
    ``EngineConfig``'s).

    Sizes are bytes (``*_bytes``), durations seconds (``*_s``), ratios fractions in [0, 1]
    (``*_fraction``). The defaults below are the single place defaults live; each says why.
    """

    # No disk tier unless asked: a cache directory is a deployment decision (NVMe, not NFS; 0700).
    cache_dir: Optional[str] = None
    # The LMDB tier's eviction, and the host pools' unless host_eviction_policy says otherwise.
    # `lru`: with the host on ARC it never fell more than 0.2 point below LRU on both tiers in any
    # measurement (`lfuda` on disk did, at 20% of the conversation trace; README, "Eviction policies").
    eviction_policy: str = "lru"
    # None = bounded only by the LMDB map (which grows); set it to share the disk with others.
    disk_capacity_bytes: Optional[int] = None
    # A closed LMDB payload segment whose live bytes fall below this fraction of its size has its
    # live records moved and is deleted (tiers/lmdb/compaction.py): the copy costs at most what it
    # frees, and segment files stay under twice the live bytes. 0 turns compaction off.
    lmdb_segment_compaction_live_fraction: float = 0.5
    # Initial LMDB map: 1 GiB of address space costs nothing until written, and the map grows on
    # MapFullError, so this only sets how often the first growths happen.
    lmdb_map_size_bytes: int = 1 * _GiB
    # Records of at least this many encoded bytes are written to O_DIRECT segment files beside the
    # LMDB index (tiers/lmdb/segments.py). Default 128 KiB: from there segments write faster than
    # LMDB, below it one LMDB transaction is cheaper (measured in docs/ARCHITECTURE.md). None (or
    # 0; "none" in TOML/env) keeps every record inside LMDB; a cache written either way opens either way.
    lmdb_segment_threshold_bytes: Optional[int] = DEFAULT_SEGMENT_THRESHOLD_BYTES
    # Level 1: ~650 MB/s, faster than the disk, so compression raises logical spill bandwidth;
    # higher levels cost CPU and gain little on KV bytes.
    compression_level: int = 1
    # Keep a compressed payload only if it saves 10%: below that, decompression costs more read time
    # than the bytes save.
    compression_min_savings_fraction: float = 0.10
    compression_enabled: bool = True
    # LMDB's reader_check() clears slots of dead processes; 30 s bounds how long a crashed reader
    # can pin old pages (and so grow the file).
    reader_check_interval_s: float = 30.0
    # Off by default: the disk index is read once at start, which is right when warmup runs before
    # serving. Set it (e.g. 10 s) when another process writes the same cache directory while this
    # one serves, so its chunks become hits without a restart (one keys-only scan per interval).
    disk_index_refresh_interval_s: Optional[float] = None
    # How long start waits for the listing of the disk's keys before it returns and serves: the
    # listing runs on (about 1.5 us a key, 1.5 s for a million), its keys turning into hits page by
    # page, misses until then. 0.5 s lists a cache of ~10^5 chunks whole before the first request
    # and keeps start under a second at any size; 0 never waits, None waits for all of it.
    disk_index_wait_s: Optional[float] = 0.5
    # On: before LMDB maps the cache_dir's file, py-lmdb's offline verifier checks its B-tree (when
    # no other process has it open). LMDB trusts its pages and can crash the whole serving process
    # on a damaged one. It walks the file only when it changed since a verified clean close (~25 us
    # a record: a writer killed -9 leaves it so); with quarantine_corrupt_cache_dir on, that walk
    # runs behind the first requests (the disk a miss until it passed), so start stays under 1 s.
    lmdb_verify_on_open: bool = True
    # On: a cache_dir whose LMDB environment is damaged (not an LMDB file, truncated, tables that do
    # not parse) has its data.mdb and lock.mdb moved aside to `<dir>.corrupt-<time>-<pid>` (inside
    # the directory when it is a mount point) and recreated empty, so the serving process starts
    # with a cold cache instead of failing. Off: start() raises CorruptCacheError and leaves the
    # directory alone.
    quarantine_corrupt_cache_dir: bool = True
    # -- remote tier (Valkey/Redis shared by a fleet), chained behind the LMDB tier ---------------
    # None = no remote tier. "redis://host:port" (one node) or "redis+cluster://h1:p1,h2:p2" (seeds).
    remote_url: Optional[str] = None
    # Caches sharing one server are separated by namespace (and by the model fingerprint).
    remote_namespace: str = "default"
    # 2 s per node call: a 8 MiB pipeline takes ~10-20 ms on loopback and ~100 ms on a 1 Gb/s link;
    # a node silent for 100x that is stalled, and the breaker should open rather than wait more.
    remote_timeout_s: float = 2.0
    # 1 s to connect: a reachable node on a LAN answers in well under a millisecond.
    remote_connect_timeout_s: float = 1.0
    # 8 pipelines in flight per node (= its connection pool): enough to fill a link with 8 MiB
    # pipelines; redis-py's cluster client raised past its pool size, so the bound is explicit.
    remote_concurrency: int = 8
    # 8 MiB per pipeline: the client copies a whole pipeline into one buffer (one of 8 x 4 MiB SETs
    # ran at 639 MB/s against 0.5-2 GB/s for single values).
    remote_pipeline_max_bytes: int = 8 * _MiB
    # "write_through": copy every spill to the remote at once (others hit it soon); or
    # "write_back_on_evict": copy only what LMDB is about to evict (a victim cache, less traffic).
    remote_write_policy: str = "write_through"
    # 3 failures (or one timeout) open a node's breaker for 5 s; then one PING probes it.
    remote_breaker_failures: int = 3
    remote_breaker_reset_s: float = 5.0
    # The backstop listing for evictions whose notification was lost (pub/sub is at-most-once).
    remote_listing_interval_s: float = 30.0
    # On: a chunk loaded from the remote is also written into LMDB (in the background), so the next
    # load of it on this host is local; off keeps LMDB for this host's own spills.
    remote_promote_to_disk: bool = True
    # On: the remote also sends each host its namespace's new keys (notify-keyspace-events n), so
    # chunks other hosts write become hits at once, without a listing of the namespace (O(keys) per
    # refresh); off leaves them to disk_index_refresh_interval_s.
    remote_watch_new_keys: bool = True
    # Off: the store writes its tier. On: the LMDB tier opens read-only (a read-only mount of a warmed
    # cache); nothing is written and a damaged directory is never moved aside (it is not ours).
    read_only: bool = False
    # LMDB read (and encode) threads, the reads in flight: tiers/lmdb/tier.py says why 4.
    read_workers: int = DEFAULT_READ_WORKERS

    def __post_init__(self) -> None:
        # A path object is welcome; store its str so the record stays plain and hashable.
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            if isinstance(self.cache_dir, os.PathLike):
                object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        # Ints are fine where floats are expected (TOML `timeout = 30`); store floats.
        for name in _FLOAT_FIELDS.intersection(self.field_names()):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        self._validate()

    # -- validation ---------------------------------------------------------------------------

    def _validate(self) -> None:
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, str):
                raise ValueError(f"cache_dir must be a str path or None, got {self.cache_dir!r}")
            if not self.cache_dir:
                raise ValueError("cache_dir must be a non-empty path or None, got ''")
            if "\x00" in self.cache_dir:
                raise ValueError(f"cache_dir must not contain NUL, got {self.cache_dir!r}")

        for name in sorted(_SIZE_FIELDS.intersection(self.field_names())):
            value = getattr(self, name)
            if isinstance(value, int) and value > _MAX_SIZE_BYTES:
                # Larger than any address space: a unit typo, not a plan. Said here, not as a raw
                # allocator or LMDB error at start.
                raise ValueError(f"{name} must be at most 2**62 bytes, got {value!r}")
        require_choice("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        if self.disk_capacity_bytes is not None:
            require_int("disk_capacity_bytes", self.disk_capacity_bytes, 1)
            if self.cache_dir is None:
                # A capacity for a disk tier that does not exist is a mistake, not a no-op.
                raise ValueError(
                    f"disk_capacity_bytes={self.disk_capacity_bytes!r} needs cache_dir "
                    "(no cache_dir means no disk tier)"
                )
        require_int("lmdb_map_size_bytes", self.lmdb_map_size_bytes, _LMDB_MIN_MAP_SIZE_BYTES)
        if self.lmdb_map_size_bytes > _LMDB_MAX_MAP_SIZE_BYTES:
            raise ValueError(
                f"lmdb_map_size_bytes must be at most 1 TiB ({_LMDB_MAX_MAP_SIZE_BYTES}, the most the map grows to), "
                f"got {self.lmdb_map_size_bytes}"
            )
        lo, hi = _COMPRESSION_LEVEL_RANGE
        require_int("compression_level", self.compression_level, None)
        if not lo <= self.compression_level <= hi:
            raise ValueError(
                f"compression_level must be in [{lo}, {hi}], got {self.compression_level!r}"
            )
        require_fraction(
            "compression_min_savings_fraction", self.compression_min_savings_fraction, upper_open=True
        )
        require_bool("compression_enabled", self.compression_enabled)
        require_bool("quarantine_corrupt_cache_dir", self.quarantine_corrupt_cache_dir)
        require_bool("lmdb_verify_on_open", self.lmdb_verify_on_open)
        require_seconds("reader_check_interval_s", self.reader_check_interval_s)
        check_segment_threshold(self.lmdb_segment_threshold_bytes, "lmdb_segment_threshold_bytes")
        if self.disk_index_refresh_interval_s is not None:
            require_seconds("disk_index_refresh_interval_s", self.disk_index_refresh_interval_s)
        _require_wait("disk_index_wait_s", self.disk_index_wait_s)
        require_fraction("lmdb_segment_compaction_live_fraction", self.lmdb_segment_compaction_live_fraction,
                          upper_open=True)
        require_bool("read_only", self.read_only)
        require_int("read_workers", self.read_workers, 1)
        self._validate_remote()

    def _validate_remote(self) -> None:
        if self.remote_url is not None:
            from kvtier.tiers.remote.url import parse_remote_url

            try:
                parse_remote_url(self.remote_url)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"remote_url is invalid: {exc}") from None
        if not isinstance(self.remote_namespace, str) or not re.match(r"^[A-Za-z0-9._-]{1,64}$", self.remote_namespace):
            raise ValueError(f"remote_namespace must match [A-Za-z0-9._-]{{1,64}}, got {self.remote_namespace!r}")
        require_seconds("remote_timeout_s", self.remote_timeout_s)
        require_seconds("remote_connect_timeout_s", self.remote_connect_timeout_s)
        require_int("remote_concurrency", self.remote_concurrency, 1)
        require_int("remote_pipeline_max_bytes", self.remote_pipeline_max_bytes, 1)
        require_choice("remote_write_policy", self.remote_write_policy, REMOTE_WRITE_POLICIES)
        require_int("remote_breaker_failures", self.remote_breaker_failures, 1)
        require_seconds("remote_breaker_reset_s", self.remote_breaker_reset_s)
        require_seconds("remote_listing_interval_s", self.remote_listing_interval_s)
        require_bool("remote_promote_to_disk", self.remote_promote_to_disk)
        require_bool("remote_watch_new_keys", self.remote_watch_new_keys)

    # -- conversions and loaders ----------------------------------------------------------------

    def codec_config(self) -> "CodecConfig":
        """The record codec these settings ask for, the same for every tier the store opens."""
        from kvtier.tiers.record_format import CodecConfig

        return CodecConfig(
            level=self.compression_level,
            min_savings_fraction=self.compression_min_savings_fraction,
            compress=self.compression_enabled,
        )

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        """The valid setting names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> Dict[str, Any]:
        """Every field as a plain value (``from_dict(c.to_dict()) == c``)."""
        return {name: getattr(self, name) for name in self.field_names()}

    @classmethod
    def from_dict(cls: Type[_C], data: Mapping[str, Any]) -> _C:
        """Build from a mapping of field names to values; missing fields take their defaults.

        Strings are coerced: ints (``"4096"``, ``"4_096"``), floats, bools (``true/false``,
        ``1/0``, ``yes/no``, ``on/off``), sizes (``*_bytes``: an int or ``"256MiB"``, ``"1GiB"``,
        ``"64 MB"``). ``cache_dir`` / ``disk_capacity_bytes`` accept ``None``. An unknown key raises
        ``ValueError`` listing the valid ones.
        """
        return cls(**cls._coerce_mapping(data, source=None))

    @classmethod
    def from_toml(cls: Type[_C], path: Union[str, "os.PathLike[str]"]) -> _C:
        """Build from a TOML file whose top-level keys are field names (see ``from_dict``)."""
        return cls.from_dict(read_toml(path))

    @classmethod
    def from_env(
        cls: Type[_C], environ: Optional[Mapping[str, str]] = None, prefix: str = "KVTIER_"
    ) -> _C:
        """Build from ``{prefix}{FIELD_NAME_UPPER}`` variables (``KVTIER_HOST_CAPACITY_BYTES=1GiB``).

        ``environ`` defaults to ``os.environ``. Other variables with the prefix do not stop a
        server (the prefix is shared with tools), but each is logged once as a warning naming the
        nearest setting's variable (``KVTIER_CACHEDIR``: did you mean ``KVTIER_CACHE_DIR``?).
        An empty value or ``none`` means ``None`` for an optional setting (``KVTIER_CACHE_DIR``...).
        """
        settings = env_settings(cls.field_names(), EngineConfig.field_names(), environ, prefix)
        with naming_variables(settings, prefix):
            return cls(**cls._coerce_mapping(settings, source=ENV + prefix))

    @classmethod
    def load(
        cls: Type[_C],
        path: Union[str, "os.PathLike[str]", None] = None,
        overrides: Optional[Mapping[str, Any]] = None,
        environ: Optional[Mapping[str, str]] = None,
        prefix: str = "KVTIER_",
    ) -> _C:
        """Merge, later winning: defaults < TOML file at ``path`` < environment < ``overrides``.

        ``environ=None`` reads ``os.environ``; pass ``{}`` to ignore the environment. Each layer is
        coerced and checked for unknown keys on its own, so an error names where the value came from;
        validation of the merged result (e.g. low < high watermark) happens once at the end.
        """
        merged: Dict[str, Any] = {}
        if path is not None:
            merged.update(cls._coerce_mapping(read_toml(path), source=os.fspath(path)))
        settings = env_settings(cls.field_names(), EngineConfig.field_names(), environ, prefix)
        merged.update(cls._coerce_mapping(settings, source=ENV + prefix))
        if overrides:
            merged.update(cls._coerce_mapping(overrides, source=None))
            settings = {k: v for k, v in settings.items() if k not in overrides}
        with naming_variables(settings, prefix):
            return cls(**merged)

    @classmethod
    def _coerce_mapping(cls, data: Mapping[str, Any], source: Optional[str]) -> Dict[str, Any]:
        if not isinstance(data, Mapping):
            raise ValueError(f"settings must be a mapping, got {type(data).__name__}")
        valid = cls.field_names()
        unknown = sorted(str(k) for k in data if k not in valid)
        if unknown:
            where = f" in {source}" if source else ""
            raise ValueError(
                f"unknown setting(s){where}: {', '.join(unknown)}; valid: {', '.join(valid)}"
            )
        return {name: coerce(name, value, source, _KINDS) for name, value in data.items()}


@dataclass(frozen=True)
class EngineConfig(StoreConfig):
    """Settings of one ``OffloadEngine``: the store's (``StoreConfig``'s fields, first) and the
    engine's own host, spill, pressure and event settings. Construct directly, or through a loader.

    Sizes are bytes (``*_bytes``), durations seconds (``*_s``), ratios fractions in [0, 1]
    (``*_fraction``). The defaults below are the single place defaults live; each says why.
    """

    # 256 MiB of slab: enough for a few requests' chunks at 256 KiB - 4 MiB each, small enough to
    # preallocate and pre-fault at start (~0.25 s at the measured 1.1 GB/s first touch). Split
    # across groups by the engine.
    host_capacity_bytes: int = 256 * _MiB
    # Start waits for host pools of at most this many bytes (host_capacity_bytes): they are made on
    # a worker thread at ~1.1 GB/s first touch (on CUDA also registered), so 1 GiB is under a
    # second. A larger pool is made while the engine serves misses (lookups 0, stores dropped, as
    # "starting"). A size, not a time: whether start waited never depends on the machine's load.
    # 0 never waits.
    host_pools_wait_bytes: int = 1 * _GiB
    # The host pools alone, overriding eviction_policy (None: the same); `arc` exists only here.
    # LRU: under `seen` admission below it beat ARC from 5% of the unique bytes up (README,
    # "Eviction policies"); with every chunk written through (`all`), `arc` is the better host.
    host_eviction_policy: Optional[str] = "lru"
    # Which newly stored chunks the disk tier is written (tiers/admission.py), when it has a
    # disk_capacity_bytes: `all` (write-through), or `seen` (a chunk stored before and stored
    # again after host and disk let it go, or one a load hit on the host; the others stay on the
    # host only, their handles not durable). `seen`: the disk then keeps other chunks than the
    # host, and their union hit 2.04x / 1.38x / 1.14x LRU's at 2 / 5 / 10% of the conversation
    # trace's unique bytes, never lower at 1-100% there or on synthetic traces (README). An
    # unbounded disk, or one holding more chunks than the host, takes every chunk whatever this
    # says (there `seen` lost: a refused chunk's first reuse must come within the host's reach);
    # so does a disk with a remote tier behind it (the fleet shares only what the disk is written).
    disk_admission: str = "seen"
    # 4096 chunks of queued stores (1-16 GiB of host slots at 256 KiB - 4 MiB): past that the disk
    # is not keeping up and waiting would only move the stall into the serving process.
    store_queue_max_chunks: int = 4096
    # 64 MiB per LMDB write transaction: measured to reach disk speed (230-310 MB/s) while one
    # transaction per 256 KiB value reaches only ~130 MB/s.
    spill_batch_max_bytes: int = 64 * _MiB
    # Caps a batch of small chunks so one transaction never holds the writer for thousands of puts.
    spill_batch_max_chunks: int = 256
    # Write-behind spill on: without it a host slot is the only copy and eviction loses it.
    spill_enabled: bool = True
    # 30 s: a 64 MiB batch takes ~0.25 s on the measured disk; 100x that is a broken tier, not a slow
    # one, and the operation is rolled back as a miss.
    tier_timeout_s: float = 30.0
    # Pause at 90% used: leaves room for the allocator's own fragmentation before an OOM.
    pressure_high_watermark_fraction: float = 0.90
    # Resume at 80%: a 10-point band so a signal hovering at one watermark does not flap.
    pressure_low_watermark_fraction: float = 0.80
    # 1 s: an NVML query is ~12 us, so polling costs nothing, and memory pressure builds over
    # seconds, not microseconds.
    pressure_poll_interval_s: float = 1.0
    # vLLM's prefix_cache_retention_interval for kvtier's own store policy (policy/retention.py):
    # None (the default, unchanged behaviour) stores an SWA window at every alignment boundary; 0
    # only at the request's final boundary (fewest bytes; multi-turn continuations still hit);
    # k (a multiple of the layout's alignment_tokens) once every k tokens.
    store_retention_interval_tokens: Optional[int] = None
    # None (the default): the device of the DeviceKVView's tensors, so a CUDA view always gets a
    # page-locked host pool (a pageable one turns every async copy synchronous, 5-20x slower).
    # "cpu"/"cuda" only assert it: start() raises DeviceError when the view is elsewhere.
    device_kind: Optional[str] = None
    # Chunk events kept for take_events(): ~3 per chunk stored, so an embedder that never takes
    # them would otherwise grow the engine without bound. The oldest are dropped and counted
    # (kvtier_events_dropped_total); 65536 events are ~6 MiB.
    events_max: int = 65536

    def _validate(self) -> None:
        super()._validate()
        require_int("host_capacity_bytes", self.host_capacity_bytes, 1)
        require_int("host_pools_wait_bytes", self.host_pools_wait_bytes, 0)
        if self.host_eviction_policy is not None:
            require_choice("host_eviction_policy", self.host_eviction_policy, HOST_EVICTION_POLICIES)
        require_choice("disk_admission", self.disk_admission, ADMISSION_NAMES)
        require_int("store_queue_max_chunks", self.store_queue_max_chunks, 1)
        require_int("spill_batch_max_bytes", self.spill_batch_max_bytes, 1)
        require_int("spill_batch_max_chunks", self.spill_batch_max_chunks, 1)
        require_bool("spill_enabled", self.spill_enabled)
        if self.read_only and self.spill_enabled:
            raise ValueError("read_only=True needs spill_enabled=False (a read-only disk tier takes no spills)")
        require_seconds("tier_timeout_s", self.tier_timeout_s)
        require_fraction("pressure_high_watermark_fraction", self.pressure_high_watermark_fraction)
        require_fraction("pressure_low_watermark_fraction", self.pressure_low_watermark_fraction)
        if not self.pressure_low_watermark_fraction < self.pressure_high_watermark_fraction:
            raise ValueError(
                "pressure_low_watermark_fraction must be < pressure_high_watermark_fraction "
                "(the band between them is the hysteresis), got "
                f"low={self.pressure_low_watermark_fraction!r}, "
                f"high={self.pressure_high_watermark_fraction!r}"
            )
        require_seconds("pressure_poll_interval_s", self.pressure_poll_interval_s)
        if self.store_retention_interval_tokens is not None:
            require_int("store_retention_interval_tokens", self.store_retention_interval_tokens, 0)
        if self.device_kind is not None:
            require_choice("device_kind", self.device_kind, DEVICE_KINDS)
        require_int("events_max", self.events_max, 1)

    def host_policy(self) -> str:
        """The host pools' eviction policy: ``host_eviction_policy``, else ``eviction_policy``."""
        return self.host_eviction_policy if self.host_eviction_policy is not None else self.eviction_policy

    @property
    def store(self) -> StoreConfig:
        """The store's part of these settings: the record the engine opens its ``DiskStore`` with."""
        return store_config_of(self)


def _require_wait(name: str, value: Optional[float]) -> None:
    # A wait of start's: None (wait for all of it) or finite seconds >= 0 (0: do not wait).
    if value is not None and not 0.0 <= require_float(name, value) < float("inf"):
        raise ValueError(f"{name} must be None or a finite number of seconds >= 0, got {value!r}")


def store_config_of(settings: Any, **values: Any) -> StoreConfig:
    """The ``StoreConfig`` a front end's settings dataclass gives: each of its fields that is a store
    setting by name, then ``values``; every other store setting keeps its default (the engine's).
    ``compression`` (a front end's one codec key: 0 raw records, else the zstd level) becomes the
    store's codec settings."""
    names = set(StoreConfig.field_names())
    taken = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name in names}
    compression = values.pop("compression", None)
    if compression is not None:
        taken.update(codec_settings(compression))
    return StoreConfig(**{**taken, **values})


def codec_settings(compression: int) -> Dict[str, Any]:
    """The store's codec settings of a front end's ``compression`` key: 0 is raw records, else the
    zstd level."""
    return dict(compression_level=compression or StoreConfig.compression_level, compression_enabled=compression != 0)


# -- field kinds and coercion --------------------------------------------------------------------

_SIZE_FIELDS = frozenset(
    {
        "host_capacity_bytes",
        "host_pools_wait_bytes",
        "disk_capacity_bytes",
        "lmdb_map_size_bytes",
        "lmdb_segment_threshold_bytes",
        "spill_batch_max_bytes",
        "remote_pipeline_max_bytes",
    }
)
_INT_FIELDS = frozenset(
    {"store_queue_max_chunks", "spill_batch_max_chunks", "compression_level", "remote_concurrency",
     "remote_breaker_failures", "store_retention_interval_tokens", "read_workers"}
)
_FLOAT_FIELDS = frozenset(
    {
        "tier_timeout_s",
        "compression_min_savings_fraction",
        "pressure_high_watermark_fraction",
        "pressure_low_watermark_fraction",
        "pressure_poll_interval_s",
        "reader_check_interval_s",
        "disk_index_refresh_interval_s",
        "disk_index_wait_s",
        "remote_timeout_s",
        "remote_connect_timeout_s",
        "remote_breaker_reset_s",
        "remote_listing_interval_s",
        "lmdb_segment_compaction_live_fraction",
    }
)
_BOOL_FIELDS = frozenset(
    {"spill_enabled", "compression_enabled", "quarantine_corrupt_cache_dir", "lmdb_verify_on_open",
     "remote_promote_to_disk", "remote_watch_new_keys", "read_only"}
)
_OPTIONAL_FIELDS = frozenset(
    {"cache_dir", "disk_capacity_bytes", "disk_index_refresh_interval_s", "disk_index_wait_s", "remote_url",
     "lmdb_segment_threshold_bytes",
     "store_retention_interval_tokens", "host_eviction_policy"}
)

_KINDS = FieldKinds(_SIZE_FIELDS, _INT_FIELDS, _FLOAT_FIELDS, _BOOL_FIELDS, _OPTIONAL_FIELDS)
