"""kvtier inside SGLang: ``KvtierHiCacheStorage``, a HiCache L3 storage backend on kvtier's LMDB tier.

SGLang loads it through its dynamic backend factory::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "cache_dir": "/nvme/kvtier"}'

Importing this package imports SGLang's storage interface; ``config``, ``keys``, ``hits`` and
``testing`` do not.
"""

from .config import SglangStorageConfig, SglangStorageConfigError
from .storage import KvtierHiCacheStorage, open_page_store

__all__ = ["KvtierHiCacheStorage", "SglangStorageConfig", "SglangStorageConfigError", "open_page_store"]
