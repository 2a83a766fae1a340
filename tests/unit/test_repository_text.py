"""The repository's prose: it says reasons instead of citing tracker numbers, and its links resolve.

An issue or defect number means nothing to a reader of the code or of a released package (the
tracker is not shipped with it), so comments, docstrings and docs say the reason itself.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = ("errors", "policy", "tiers", "engine", "integrations", "tools")
# "issue 14", "defect 6", "Issue #3", "#12" (not "&#12;", an HTML entity).
CITATION = re.compile(r"\b(?:issue|defect)s?\s*#?\d+|(?:^|[^&\w])#\d+\b", re.IGNORECASE)


def repository_text_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in (*LAYERS, "tests", ".ci"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md") or p.name == "run")
    return files


def test_no_comment_or_doc_cites_an_issue_or_defect_number():
    found = []
    for path in repository_text_files():
        if path == pathlib.Path(__file__).resolve():
            continue  # its examples are the pattern's test data
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CITATION.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "say the reason instead:\n" + "\n".join(found)


def test_the_citation_pattern():
    cited = ["see issue 14", "(defect 6)", "Issue #3 asks", "fixes #12", "issues 2"]
    plain = ["issued 4 reads", "an issue's target", "&#12;", "x#1", "# 1 comment", "tissue 3"]
    assert [bool(CITATION.search(text)) for text in cited] == [True] * len(cited)
    assert [bool(CITATION.search(text)) for text in plain] == [False] * len(plain)


def test_relative_links_in_readme_and_docs_resolve():
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)  # [text](target) and ![alt](target)
        targets += re.findall(r"(?<![\w/.])(docs/[\w.-]+\.(?:md|png))", text)  # plain "docs/cli.md"
        for target in targets:
            if "://" in target:
                continue
            base = ROOT if target.startswith("docs/") else page.parent
            if not (base / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert missing == []


def test_the_configuration_reference_lists_every_setting_once_with_its_default():
    import ast
    import dataclasses

    from kvtier.engine import EngineConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.MULTILINE)
    assert [name for name, _ in rows] == list(EngineConfig.field_names())
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "s": 1}
    defaults = EngineConfig()
    for name, shown in rows:
        shown = shown.strip()
        number, _, unit = shown.partition(" ")
        if shown.startswith("`"):
            value = ast.literal_eval(shown.strip("`"))  # None, True, "lru": as Python writes it
        else:
            value = float(number) * units[unit] if unit else float(number)
        assert value == getattr(defaults, name), name
    assert len(dataclasses.fields(EngineConfig)) == len(rows)
