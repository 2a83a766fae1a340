"""kvtier.engine: the asyncio offload engine a serving process embeds.

``OffloadEngine`` (store / lookup / load / prefetch / fence / flush / close), ``EngineConfig``,
and the records it hands out (``StoreHandle``, ``StoreResult``, ``LoadResult``, ``ChunkEvent``,
``RequestKeys``).
"""

from .config import EngineConfig
from .engine import EngineInvariantError, OffloadEngine
from .records import ChunkEvent, LoadResult, RequestKeys, StoreHandle, StoreResult

__all__ = [
    "OffloadEngine",
    "EngineConfig",
    "EngineInvariantError",
    "StoreHandle",
    "StoreResult",
    "LoadResult",
    "ChunkEvent",
    "RequestKeys",
]
