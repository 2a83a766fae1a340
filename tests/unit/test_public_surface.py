"""The names outside code imports exist, are exported once, and the layers import one way."""

from __future__ import annotations

import ast
import pathlib

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


LAYER_RANK = {"policy": 0, "tiers": 1, "engine": 2, "tools": 3}


def test_imports_flow_tools_engine_tiers_policy():
    """No module imports a layer above its own (policy imports nothing of kvtier's)."""
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
