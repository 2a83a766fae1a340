"""kvtier.tiers: where the bytes live -- device KV view, host slab pool, and the ``ChunkTier`` stores
below it (LMDB, file-per-chunk, remote, chained), with the contract they keep (``tiers/base.py``).

The names below are the public surface; each loads its module on first use (PEP 562), so
``import kvtier.tiers.lmdb`` in a child process does not pay for torch or redis.
"""

from importlib import import_module
from typing import Any, Dict

# public name -> the module (under kvtier.tiers) that defines it
_HOMES: Dict[str, str] = {
    "ChunkTier": "base",
    "ChunkMeta": "base",
    "Removal": "base",
    "KeySnapshot": "base",
    "TierStatistics": "base",
    "KEY_MAX_BYTES": "base",
    "check_key": "base",
    "LmdbTier": "lmdb",
    "quarantine_cache_dir": "lmdb",
    "FileTier": "files",
    "RemoteTier": "remote",
    "ChainedTier": "chain",
    "DeviceKVView": "device",
    "HostSlabPool": "host",
    "CodecConfig": "record_format",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
