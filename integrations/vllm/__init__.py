"""kvtier inside vLLM 0.33: ``KvtierTier``, a secondary tier under vLLM's CPU tier.

vLLM loads it by name from its ``kv_connector_extra_config``::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
     "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                          "cache_dir": "/nvme/kvtier"}]}

Importing this module imports vLLM; ``config`` and ``keys`` do not.
"""

from .config import VllmTierConfig, VllmTierConfigError
from .keys import VllmLayout
from .layout import layout_from_spec
from .tier import CacheDirInUseError, KvtierTier

__all__ = ["KvtierTier", "CacheDirInUseError", "VllmTierConfig", "VllmTierConfigError", "VllmLayout", "layout_from_spec"]
