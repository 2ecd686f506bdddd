"""Print the config-key table made from the dataclasses, or with --write put it into docs/formats.md
in place of the table under "## Config keys".

    PYTHONPATH=src python scripts/config_table.py [--write]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vltrain.config.reference import HEADER, config_table  # noqa: E402

DOC = REPO / "docs" / "formats.md"


def replace_table(text: str, table: str) -> str:
    """``text`` with the table that starts at HEADER under "## Config keys" replaced by ``table``."""
    start = text.index(HEADER, text.index("## Config keys"))
    end = text.find("\n\n", start)
    end = len(text) if end == -1 else end + 1
    return text[:start] + table + text[end:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.relative_to(REPO)}")
    table = config_table()
    if p.parse_args().write:
        DOC.write_text(replace_table(DOC.read_text(), table))
        print(f"wrote {table.count(chr(10)) - 2} keys to {DOC.relative_to(REPO)}")
    else:
        print(table, end="")


if __name__ == "__main__":
    main()
