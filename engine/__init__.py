"""kvtier.engine: the asyncio offload engine a serving process embeds.

``OffloadEngine`` (store / lookup / load / prefetch / fence / flush / close), ``EngineConfig``,
``StoreConfig`` and ``DiskStore`` (the disk and remote below every front end), and the records it
hands out (``StoreHandle``, ``StoreResult``, ``LoadResult``, ``ChunkEvent``,
``RequestKeys``).
"""

from .config import EngineConfig, StoreConfig
from .engine import EngineInvariantError, OffloadEngine
from .records import ChunkEvent, LoadResult, RequestKeys, StoreHandle, StoreResult
from .store import DiskStore

__all__ = [
    "OffloadEngine",
    "EngineConfig",
    "StoreConfig",
    "DiskStore",
    "EngineInvariantError",
    "StoreHandle",
    "StoreResult",
    "LoadResult",
    "ChunkEvent",
    "RequestKeys",
]
