"""Type-check the whole kvtier package with mypy, as it installs.

The layer folders (errors/, policy/, tiers/, ...) sit at the repository root and install under
`kvtier.` through `[tool.setuptools.package-dir]` in pyproject.toml. mypy maps files to module names
by directory, and it cannot read setuptools' editable-install finder, so checked from the root the
folders would be top-level packages named `errors`, `policy`, ... and every `from kvtier.x import y`
would be unresolved. This script builds, in a temporary directory, a `kvtier/` folder holding one
symlink per package-dir entry (read from pyproject.toml, so the mapping has one source), and runs
`mypy -p kvtier` there with the repository's `[tool.mypy]` settings. Nothing in the checkout is
created or changed. Extra arguments pass through to mypy; the exit status is mypy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """Folder under `kvtier/` -> source folder, for every `kvtier.<name>` package-dir entry."""
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    dirs: dict[str, Path] = {}
    for package, folder in table.items():
        top, _, name = package.partition(".")
        if top != "kvtier" or not name or "." in name:
            raise SystemExit(f"typecheck: unexpected package-dir entry {package!r} = {folder!r}")
        dirs[name] = ROOT / folder
    return dirs


def main(argv: list[str]) -> int:
    pyproject = ROOT / "pyproject.toml"
    with tempfile.TemporaryDirectory(prefix="kvtier-typecheck-") as tmp:
        package = Path(tmp) / "kvtier"
        package.mkdir()
        for name, source in package_dirs(pyproject).items():
            os.symlink(source, package / name, target_is_directory=True)
        command = [sys.executable, "-m", "mypy", "--config-file", str(pyproject), "-p", "kvtier", *argv]
        return subprocess.call(command, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
