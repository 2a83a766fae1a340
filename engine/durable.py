"""Which store handles wait for which chunks to reach the disk.

Primitive: ``DurableWatch`` (handle <-> key bookkeeping behind ``StoreHandle.wait_durable``).
Event-loop thread only. The store path registers handles, the spill pipeline resolves keys as
their puts land or fail, the host bookkeeping resolves a key ``False`` when it drops a chunk whose
spill was still to come; the engine fails every handle left when it closes or fails.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Set

from .records import StoreHandle, mark_durable

__all__ = ["DurableWatch"]


class DurableWatch:
    """Which handles wait for which keys. A handle resolves ``True`` when its last key resolved
    ``True``, ``False`` as soon as one key resolves ``False``."""

    def __init__(self) -> None:
        self._by_key: Dict[bytes, List[StoreHandle]] = {}
        self._waiting: Dict[StoreHandle, Set[bytes]] = {}

    def watch(self, handle: StoreHandle, keys: Iterable[bytes]) -> None:
        waiting = self._waiting.setdefault(handle, set())
        for key in keys:
            if key not in waiting:
                waiting.add(key)
                self._by_key.setdefault(key, []).append(handle)
        if not waiting:
            self.finish(handle, True)

    def resolve(self, key: bytes, ok: bool) -> None:
        """``key``'s chunk reached the disk (``ok``) or will not (for now)."""
        for handle in self._by_key.pop(key, ()):
            waiting = self._waiting.get(handle)
            if waiting is None:
                continue
            waiting.discard(key)
            if not ok:
                self.finish(handle, False)
            elif not waiting:
                self.finish(handle, True)

    def finish(self, handle: StoreHandle, ok: bool) -> None:
        for key in self._waiting.pop(handle, ()):
            watchers = self._by_key.get(key)
            if watchers and handle in watchers:
                watchers.remove(handle)
                if not watchers:
                    del self._by_key[key]
        mark_durable(handle, ok)

    def fail_all(self) -> None:
        for handle in list(self._waiting):
            self.finish(handle, False)

    def watched_keys(self) -> Set[bytes]:
        return set(self._by_key)

    def __len__(self) -> int:
        return len(self._waiting)
