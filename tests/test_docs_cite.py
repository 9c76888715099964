"""Every test the docs cite as evidence exists: a renamed or deleted test leaves no claim in
docs/*.md or the README pointing at nothing (docs/reliability.md's table cites ~100)."""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CITE = re.compile(r"(test_\w+\.py)?::(test_\w+)|(test_\w+\.py)")


def cited(text: str) -> Iterator[tuple[str, str | None]]:
    """(file, test) for each citation in `text`: `test_x.py::test_y`, and a bare `::test_z` after it
    (the same file); (file, None) for a file named alone."""
    last = None
    for m in _CITE.finditer(text):
        if m.group(3):
            last = m.group(3)
            yield last, None
        elif m.group(1) or last:
            last = m.group(1) or last
            yield last, m.group(2)


def _tests() -> dict[str, set[str]]:
    return {p.name: {n.name for n in ast.walk(ast.parse(p.read_text()))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for p in (ROOT / "tests").glob("test_*.py")}


def test_citations_are_read_as_file_and_test():
    text = "`test_a.py::test_one`, `::test_two`; test_b.py; `test_c.py::test_three`"
    assert list(cited(text)) == [("test_a.py", "test_one"), ("test_a.py", "test_two"), ("test_b.py", None),
                                 ("test_c.py", "test_three")]


def test_every_test_the_docs_cite_exists():
    tests, missing, seen = _tests(), [], 0
    for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        for f, name in cited(doc.read_text()):
            seen += 1
            if f not in tests or (name is not None and name not in tests[f]):
                missing.append(f"{doc.name}: {f}{'::' + name if name else ''}")
    assert seen > 50 and not missing, missing  # seen: the docs were read
