"""Fixtures shared by the integration tests: real Valkey servers on 127.0.0.1 (remote tier)."""

from kvtier.tools.testing.valkey import valkey_cluster, valkey_factory, valkey_node  # noqa: F401
