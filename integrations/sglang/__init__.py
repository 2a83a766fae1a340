"""kvtier inside SGLang: ``KvtierHiCacheStorage``, a HiCache L3 storage backend on kvtier's LMDB tier.

SGLang loads it through its dynamic backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "cache_dir": "/nvme/kvtier"}'

``KvtierHiCacheStorage`` (``storage``) imports SGLang's storage interface on first access;
``config``, ``keys``, ``hits`` and ``testing`` do not import SGLang.
"""

from typing import Any

from .config import SglangStorageConfig, SglangStorageConfigError

__all__ = ["KvtierHiCacheStorage", "SglangStorageConfig", "SglangStorageConfigError", "open_page_store"]


def __getattr__(name: str) -> Any:
    # SGLang's factory does getattr(module, class_name): the storage module (and SGLang) load then.
    if name in ("KvtierHiCacheStorage", "open_page_store"):
        from . import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
