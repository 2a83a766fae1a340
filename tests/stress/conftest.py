"""Knobs of the opt-in stress runs: ``python3 -m pytest tests/stress --iterations 200``."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvtier stress")
    group.addoption("--iterations", type=int, default=100, help="kill -9 iterations of the LMDB tier child (default 100)")
    group.addoption(
        "--engine-iterations", type=int, default=10, help="kill -9 iterations of the engine child (default 10)"
    )
    group.addoption("--sim-seeds", type=int, default=20, help="seeds of the engine's stateful test (default 20)")
    group.addoption("--sim-steps", type=int, default=2000, help="steps per seed of the stateful test (default 2000)")
    group.addoption("--fault-seed", type=int, default=None, help="base seed (default: from the clock, printed)")
    group.addoption(
        "--compact-iterations", type=int, default=20, help="kill -9 iterations of the compacting child (default 20)"
    )
    group.addoption(
        "--cache-dir-trials", type=int, default=5, help="seeded multi-process trials on one cache directory (default 5)"
    )
    group.addoption("--cache-dir-rounds", type=int, default=40, help="rounds per multi-process trial (default 40)")
    group.addoption(
        "--compaction-seconds", type=float, default=20.0, help="seconds of concurrent churn and compaction (default 20)"
    )


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


@pytest.fixture
def compact_iterations(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--compact-iterations"))


@pytest.fixture
def compaction_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--compaction-seconds"))


@pytest.fixture
def cache_dir_trials(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--cache-dir-trials"))


@pytest.fixture
def cache_dir_rounds(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--cache-dir-rounds"))


@pytest.fixture
def sim_seeds(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--sim-seeds"))


@pytest.fixture
def sim_steps(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--sim-steps"))
