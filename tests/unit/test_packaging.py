"""What installs is what is checked: every source folder is a listed package, each top-level folder
ships ``py.typed``, and the type check's layout (``.ci/typecheck.py``) covers every package."""

from __future__ import annotations

import importlib.util
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def load_typecheck():
    spec = importlib.util.spec_from_file_location("kvtier_ci_typecheck", ROOT / ".ci" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_type_check_lays_out_every_package_dir_folder():
    dirs = load_typecheck().package_dirs(ROOT / "pyproject.toml")
    assert dirs == {name: ROOT / name for name in ("errors", "policy", "tiers", "engine", "integrations", "tools")}
    for package in SETUPTOOLS["packages"]:
        top, name = package.split(".")[:2]
        assert top == "kvtier" and name in dirs, package


def test_every_source_folder_is_a_listed_package():
    """A folder of modules missing from ``packages`` would be left out of the wheel."""
    listed = set(SETUPTOOLS["packages"])
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([package, *relative]))
    assert found == listed


def test_each_top_level_folder_ships_py_typed():
    assert SETUPTOOLS["package-data"]["*"] == ["py.typed"]
    for folder in SETUPTOOLS["package-dir"].values():
        assert (ROOT / folder / "py.typed").is_file(), folder
