"""Knobs of the opt-in stress runs: ``python3 -m pytest tests/stress --iterations 200``."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvtier stress")
    group.addoption("--iterations", type=int, default=100, help="kill -9 iterations of the LMDB tier child (default 100)")
    group.addoption(
        "--engine-iterations", type=int, default=10, help="kill -9 iterations of the engine child (default 10)"
    )
    group.addoption("--fault-seed", type=int, default=None, help="base seed (default: from the clock, printed)")


@pytest.fixture
def iterations(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--iterations"))


@pytest.fixture
def engine_iterations(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--engine-iterations"))


@pytest.fixture
def fault_seed(request: pytest.FixtureRequest) -> int:
    import time

    seed = request.config.getoption("--fault-seed")
    return int(seed) if seed is not None else int(time.time()) % 1_000_000
from kvtier.tools.valkey_fixtures import valkey_cluster, valkey_factory, valkey_node  # noqa: F401,E402
