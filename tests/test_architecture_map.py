"""docs/architecture.md's file table names every module under src/vltrain, and only those.

The table is the map a newcomer reads first; a module missing from it is a module nobody is told
about, and a row naming a moved or deleted file sends them to nothing. Each row's first cell names one
or more modules in backticks: the first as a full path (`src/vltrain/model/vision.py`), the others
either full paths too or bare file names in the same folder as the name before them
(`src/vltrain/model/vision.py`, `text.py`). A package's ``__init__.py`` is the package itself and is
not listed.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
SECTION = "## Where each concern lives in the code"


def modules_on_disk() -> set[str]:
    return {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "src" / "vltrain").rglob("*.py")
        if p.name != "__init__.py"
    }


def table_rows() -> list[tuple[str, str]]:
    """(first cell, second cell) of each row of the file table."""
    text = DOC.read_text()
    assert SECTION in text, f"docs/architecture.md has lost its heading {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0].startswith("`"):
            rows.append((cells[0], cells[1]))
    return rows


def modules_in_table() -> list[str]:
    """Every module path the table names, in order, repeats included."""
    named = []
    for cell, _ in table_rows():
        folder = None
        for name in re.findall(r"`([^`]+)`", cell):
            if name.startswith("src/vltrain/"):
                path = name
            else:
                assert "/" not in name and folder is not None, (
                    f"docs/architecture.md: {name!r} in {cell!r} is neither a full path "
                    "(src/vltrain/...) nor a bare file name after one"
                )
                path = f"{folder}/{name}"
            folder = path.rsplit("/", 1)[0]
            named.append(path)
    return named


def test_the_table_lists_every_module():
    missing = sorted(modules_on_disk() - set(modules_in_table()))
    assert not missing, (
        "docs/architecture.md, section 'Where each concern lives in the code', has no row for "
        + ", ".join(missing)
        + ". Add a row per module (or name it in the row of its neighbours), e.g.\n"
        + "\n".join(f"| `{m}` | <what it holds, in one line> |" for m in missing)
    )


def test_the_table_names_no_module_that_does_not_exist():
    gone = sorted(set(modules_in_table()) - modules_on_disk())
    assert not gone, (
        f"docs/architecture.md's file table names modules that do not exist: {gone}; "
        "fix the path or drop the row"
    )


def test_each_module_is_named_once_with_a_description():
    named = modules_in_table()
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"docs/architecture.md's file table names these in more than one row: {twice}"
    bare = [cell for cell, what in table_rows() if not what]
    assert not bare, f"docs/architecture.md's file table has rows without a description: {bare}"
