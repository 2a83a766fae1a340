"""The names outside code imports exist, are exported once, and the layers import one way."""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys

import pytest

import kvtier.engine

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_engine_public_names_import():
    """The engine half of DESIGN's public surface (test_policy_errors covers kvtier.policy)."""
    from kvtier.engine import EngineConfig, OffloadEngine

    assert OffloadEngine.__aenter__ and EngineConfig().cache_dir is None


def test_every_exported_name_exists_once():
    module = kvtier.engine
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        assert hasattr(module, name), f"kvtier.engine.{name}"


LAYER_RANK = {"errors": -1, "policy": 0, "tiers": 1, "engine": 2, "tools": 3}


def test_imports_flow_tools_engine_tiers_policy_errors():
    """No module imports a layer above its own (errors imports nothing of kvtier's, policy only errors)."""
    offenders = []
    for layer, rank in LAYER_RANK.items():
        for path in (ROOT / layer).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "kvtier" and len(parts) > 1 and parts[1] in LAYER_RANK:
                        if LAYER_RANK[parts[1]] > rank:
                            offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_no_pickle_or_torch_load_in_kvtier():
    for layer in LAYER_RANK:
        for path in (ROOT / layer).rglob("*.py"):
            text = path.read_text()
            assert "import pickle" not in text and "torch.load(" not in text, path


@pytest.mark.parametrize(
    "old, new, names",
    [
        ("kvtier.tiers.lmdb_tier", "kvtier.tiers.lmdb", ["LmdbTier", "CorruptCacheError", "quarantine_cache_dir"]),
        ("kvtier.policy.errors", "kvtier.errors", ["KvtierError", "TierIOError", "TierTimeoutError"]),
    ],
)
def test_old_import_paths_warn_and_reexport(old, new, names, monkeypatch):
    """Kept for one release: the same objects, and a KvtierDeprecationWarning naming the new path."""
    from kvtier.errors import KvtierDeprecationWarning

    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(KvtierDeprecationWarning, match=f"import .*{new.replace('.', '[.]')}"):
        module = importlib.import_module(old)
    modern = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(modern, name), name


def test_error_family_has_one_home():
    """Every kvtier exception class is defined in kvtier.errors; the old homes re-export it."""
    import kvtier.errors
    import kvtier.tiers.host
    import kvtier.tiers.record
    import kvtier.tools.faults

    for name in kvtier.errors.__all__:
        assert getattr(kvtier.errors, name).__module__ == "kvtier.errors", name
    assert kvtier.tiers.record.RecordChecksumError is kvtier.errors.RecordChecksumError
    assert kvtier.tiers.host.SlotStateError is kvtier.errors.SlotStateError
    assert kvtier.tools.faults.InjectedFault is kvtier.errors.InjectedFault
    assert kvtier.engine.EngineInvariantError is kvtier.errors.EngineInvariantError
    assert issubclass(kvtier.errors.TierTimeoutError, kvtier.errors.TierIOError)
