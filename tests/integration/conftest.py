"""Fixtures shared by the integration tests: real Valkey servers on 127.0.0.1 (remote tier)."""

from kvtier.tools.valkey_fixtures import valkey_cluster, valkey_factory, valkey_node  # noqa: F401
