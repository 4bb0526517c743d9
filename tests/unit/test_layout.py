"""The shape of the tree, checked: subsystem `__init__` files export nothing (every import names its module;
`kvpool/__init__.py` alone holds the public names), and every file path the README, the code or the tests
mention exists (no comment points at a file a move left behind)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("kvpool", "workers")
# a path of the tree's own: a top-level folder, then folders, then a file with one of these suffixes
MENTIONED_PATH = re.compile(r"(?<![\w/.-])((?:kvpool|workers|tests|scripts)/[\w/.-]*\.(?:py|c|sh|toml|md))\b")


def _sources() -> list[pathlib.Path]:
    return sorted(path for folder in (*PACKAGES, "tests", "scripts") for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts)


def test_subsystem_init_files_hold_a_docstring_only():
    offenders = []
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            if init == ROOT / "kvpool" / "__init__.py":
                continue
            body = ast.parse(init.read_text(encoding="utf-8")).body
            if any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body):
                offenders.append(str(init.relative_to(ROOT)))
    assert not offenders, f"__init__ files that import or define something (import the module itself instead): {offenders}"


@pytest.mark.parametrize("document", ["README.md", "pyproject.toml", ".ci/run", "scripts/test.sh", "scripts/demo.sh", "scripts/install.sh"])
def test_every_path_a_document_names_exists(document):
    text = (ROOT / document).read_text(encoding="utf-8")
    missing = sorted({path for path in MENTIONED_PATH.findall(text) if not (ROOT / path).exists() and "*" not in path})
    assert not missing, f"{document} names files that do not exist: {missing}"


def test_every_path_a_source_file_names_exists():
    missing = {}
    for source in _sources():
        names = {path for path in MENTIONED_PATH.findall(source.read_text(encoding="utf-8")) if not (ROOT / path).exists()}
        if names:
            missing[str(source.relative_to(ROOT))] = sorted(names)
    assert not missing, f"source files that name files that do not exist: {missing}"
