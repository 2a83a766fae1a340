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


PUBLIC_PACKAGES = ("kvtier.errors", "kvtier.policy", "kvtier.tiers", "kvtier.engine", "kvtier.tools.testing")
# Names a package re-exports from another for compatibility (kvtier.engine exported
# EngineInvariantError before it moved).
COMPAT = {"kvtier.engine": "kvtier.errors"}


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_exported_name_resolves_and_is_listed_once(package):
    module = importlib.import_module(package)
    assert len(module.__all__) == len(set(module.__all__)), package
    for name in module.__all__:
        assert getattr(module, name, None) is not None, f"{package}.{name}"


def test_every_public_name_has_one_home():
    """Like trio's test_exports: a public name is exported by one package only; the exceptions are
    the compatibility re-exports in COMPAT, and those are the very same objects."""
    homes = {}
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            homes.setdefault(name, []).append(package)
    for name, packages in homes.items():
        if len(packages) == 1:
            continue
        owners = {COMPAT.get(p, p) for p in packages}
        assert len(owners) == 1, f"{name} is exported by {packages}"
        objects = {id(getattr(importlib.import_module(p), name)) for p in packages}
        assert len(objects) == 1, f"{name} differs between {packages}"


def test_readme_imports_work():
    """Every ``from kvtier... import ...`` line of README's code blocks runs as written."""
    readme = (ROOT / "README.md").read_text()
    lines = []
    in_code = False
    for line in readme.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        stripped = line.strip()
        if in_code and (stripped.startswith("from kvtier") or stripped.startswith("import kvtier")):
            lines.append(stripped)
    assert lines, "README shows no kvtier imports"
    for line in lines:
        if line.endswith("("):  # a parenthesised import: take the block up to the closing paren
            continue
        exec(compile(line, "README.md", "exec"), {})


LAYER_RANK = {"errors": -1, "policy": 0, "tiers": 1, "engine": 2, "integrations": 3, "tools": 4}


def test_imports_flow_tools_engine_tiers_policy_errors():
    """No module imports a layer above its own: tools -> integrations -> engine -> tiers -> policy
    (errors imports nothing of kvtier's, policy only errors)."""
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
    "old",
    ["kvtier.tiers.lmdb_tier", "kvtier.tiers.record", "kvtier.policy.errors", "kvtier.tools.faults",
     "kvtier.tools.scenario", "kvtier.tools.fault_child"],
)
def test_old_import_paths_are_gone(old, monkeypatch):
    """No release ever shipped the old module paths, so none is kept: each name has the one home."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.raises(ModuleNotFoundError, match=f"No module named '{old.replace('.', '[.]')}'"):
        importlib.import_module(old)


def test_policy_exports_no_error_class():
    """The error family is imported from kvtier.errors; kvtier.policy exports only its own math."""
    import kvtier.errors
    import kvtier.policy

    assert set(kvtier.policy.__all__) & set(kvtier.errors.__all__) == set()
    assert not hasattr(kvtier.policy, "KvtierError")


def test_error_family_has_one_home():
    """Every kvtier exception class is defined in kvtier.errors; the modules that raise it re-export it."""
    import kvtier.errors
    import kvtier.tiers.host
    import kvtier.tiers.record_format
    import kvtier.tools.testing.faults

    for name in kvtier.errors.__all__:
        assert getattr(kvtier.errors, name).__module__ == "kvtier.errors", name
    assert kvtier.tiers.record_format.RecordChecksumError is kvtier.errors.RecordChecksumError
    assert kvtier.tiers.host.SlotStateError is kvtier.errors.SlotStateError
    assert kvtier.tools.testing.faults.InjectedFault is kvtier.errors.InjectedFault
    assert kvtier.engine.EngineInvariantError is kvtier.errors.EngineInvariantError
    assert issubclass(kvtier.errors.TierTimeoutError, kvtier.errors.TierIOError)


def test_the_readme_embedding_example_runs_as_written(tmp_path):
    import subprocess

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Embedding kvtier in a serving process", 1)[1]
    program = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "example.py").write_text(program)
    result = subprocess.run([sys.executable, str(tmp_path / "example.py")], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "restored 96 tokens: ok=True\n"
