"""The settings of ``KvtierHiCacheStorage``, read from SGLang's ``--hicache-storage-backend-extra-config``.

Pure: no SGLang import, so the validation is testable (and its errors readable) without SGLang.
Every key is validated at construction; a bad one is a ``SglangStorageConfigError`` (a
``ValueError``) naming the key and the value, raised before any directory or thread exists.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvtier.engine.config import StoreConfig, store_config_of
from kvtier.errors import KvtierError
from kvtier.tiers.lmdb.compaction import DEFAULT_COMPACTION_LIVE_FRACTION, check_live_fraction
from kvtier.tiers.lmdb.segments import DEFAULT_SEGMENT_THRESHOLD_BYTES, check_segment_threshold
from kvtier.tiers.lmdb.tier import DEFAULT_READ_WORKERS
from kvtier.tiers.lru import BYTE_INDEX_NAMES

__all__ = ["SglangStorageConfig", "SglangStorageConfigError", "SGLANG_KEYS"]

# Keys of the extra config that are SGLang's, not the backend's: the dynamic factory's three, the
# controller's switch to the zero-copy v1 calls, and the controller's own knobs (it pops most of
# them before a backend sees the dict; accepted here too so a config that still carries one loads).
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})


class SglangStorageConfigError(KvtierError, ValueError):
    """A key of the backend's extra config is unknown, missing or out of range (the message names it)."""


@dataclass(frozen=True)
class SglangStorageConfig:
    """Typed settings, units in the names.

    ``cache_dir``: the LMDB directory (created 0700), the one ``kvtier inspect/verify/gc`` take.
    ``disk_capacity_bytes``: bound on the stored record bytes this process accounts (``None``:
    unbounded; with several writing ranks on one directory each bounds its own view, and
    ``kvtier gc`` bounds the whole). ``compression``: zstd level 1..22 on the byte planes, 0 for
    raw records. ``op_timeout_s``: the longest one call from SGLang waits for the disk; past it the
    call answers "not stored" / "not loaded" (the work finishes in the background, into buffers of
    its own, never into SGLang's host pool). ``open_timeout_s``: the longest the constructor waits
    for the directory to open (a structure check of a large file takes a while).
    ``weights_version``: a tag bound into every key (bump it when the weights change under one model
    name). ``tenant_salt``: keys the page keys (two tenants never share a record). The ``lmdb_*``
    settings, ``read_workers``, ``eviction_policy``, ``lmdb_verify_on_open``,
    ``quarantine_corrupt_cache_dir``, ``remote_url`` (a Valkey/Redis tier behind the disk, shared by
    a fleet) and ``remote_namespace`` are ``StoreConfig``'s, with its defaults: ``store_config()``
    is the record the backend opens its store with.
    """

    cache_dir: str
    disk_capacity_bytes: Optional[int] = None
    compression: int = 1
    op_timeout_s: float = 10.0
    open_timeout_s: float = 300.0
    weights_version: str = ""
    tenant_salt: Optional[str] = None
    read_workers: int = DEFAULT_READ_WORKERS
    lmdb_segment_threshold_bytes: Optional[int] = DEFAULT_SEGMENT_THRESHOLD_BYTES
    lmdb_segment_compaction_live_fraction: float = DEFAULT_COMPACTION_LIVE_FRACTION
    lmdb_verify_on_open: bool = True
    quarantine_corrupt_cache_dir: bool = True
    eviction_policy: str = "lru"
    remote_url: Optional[str] = None
    remote_namespace: str = "sglang"

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> SglangStorageConfigError:
            return SglangStorageConfigError(
                f"kvtier SGLang backend: extra config key {name!r} must be {want}, got {getattr(self, name)!r}")

        if not isinstance(self.cache_dir, str) or not self.cache_dir or "\x00" in self.cache_dir:
            raise bad("cache_dir", "a non-empty path string")
        cap = self.disk_capacity_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise bad("disk_capacity_bytes", "a positive int or null")
        if isinstance(self.compression, bool) or not isinstance(self.compression, int) or not 0 <= self.compression <= 22:
            raise bad("compression", "an int in 0..22 (0: raw records)")
        for name in ("op_timeout_s", "open_timeout_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise bad(name, "a finite number of seconds > 0")
        if not isinstance(self.weights_version, str):
            raise bad("weights_version", "a string")
        if self.tenant_salt is not None and (not isinstance(self.tenant_salt, str) or not self.tenant_salt):
            raise bad("tenant_salt", "a non-empty string or null")
        if isinstance(self.read_workers, bool) or not isinstance(self.read_workers, int) or self.read_workers < 1:
            raise bad("read_workers", "an int >= 1")
        for name, check in (("lmdb_segment_threshold_bytes", lambda v, n: check_segment_threshold(v, n, "null")),
                            ("lmdb_segment_compaction_live_fraction", check_live_fraction)):
            try:
                check(getattr(self, name), f"kvtier SGLang backend: extra config key {name!r}")
            except ValueError as exc:
                raise SglangStorageConfigError(str(exc)) from None
        for name in ("lmdb_verify_on_open", "quarantine_corrupt_cache_dir"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if self.eviction_policy not in BYTE_INDEX_NAMES:
            raise bad("eviction_policy", f"one of {', '.join(BYTE_INDEX_NAMES)}")
        try:
            self.store_config()
        except ValueError as exc:  # the store's own rules (a remote URL, a namespace): named by it
            name = str(exc).split(" ", 1)[0]
            raise SglangStorageConfigError(f"kvtier SGLang backend: extra config key {name!r}: {exc}") from None

    def store_config(self) -> StoreConfig:
        """The store these settings open: the same record, rules and defaults the engine and the
        vLLM tier open theirs with (what is not set here keeps ``StoreConfig``'s default)."""
        return store_config_of(self, compression=self.compression)

    @classmethod
    def from_extra_config(cls, values: Optional[Mapping[str, Any]]) -> "SglangStorageConfig":
        """Build from SGLang's extra config dict. SGLang's own keys (``SGLANG_KEYS``) are skipped;
        any other unknown key is an error (a typo must not pass silently)."""
        values = dict(values or {})
        ours = {k: v for k, v in values.items() if k not in SGLANG_KEYS}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise SglangStorageConfigError(
                f"kvtier SGLang backend: unknown extra config key {unknown[0]!r}; its keys: {sorted(known)} "
                f"(and SGLang's: {sorted(SGLANG_KEYS)})")
        if "cache_dir" not in ours:
            raise SglangStorageConfigError(
                "kvtier SGLang backend: extra config key 'cache_dir' (the LMDB directory) is missing")
        return cls(**ours)
