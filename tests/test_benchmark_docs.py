"""docs/benchmarks/: its index lists every page's every heading, and every link into the pages,
from anywhere in the repository, lands on a heading of the page it names."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = REPO / "docs" / "benchmarks"


def anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (lower case, punctuation dropped, spaces as -)."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> list[str]:
    return [anchor(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,4} ", line)]


def test_the_index_lists_every_heading_of_every_page():
    index = (PAGES / "README.md").read_text()
    pages = sorted(p for p in PAGES.glob("*.md") if p.name != "README.md")
    assert len(pages) >= 5
    missing = [f"{p.name}#{a}" for p in pages for a in anchors(p)[1:] if f"({p.name}#{a})" not in index]
    assert not missing, f"docs/benchmarks/README.md does not list: {missing}"


def test_every_link_into_the_pages_lands_on_a_heading():
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.yaml"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    have = {p.name: set(anchors(p)) for p in PAGES.glob("*.md")}
    broken = []
    for rel in files:
        if not (REPO / rel).is_file() or REPO / rel == Path(__file__):
            continue
        text = (REPO / rel).read_text()
        inside = (REPO / rel).parent == PAGES
        links = re.findall(r"benchmarks/([a-z0-9-]+\.md)(?:#([a-z0-9_-]+))?", text)
        if inside:
            links += re.findall(r"\]\(([a-z0-9-]+\.md)#([a-z0-9_-]+)\)", text)
            links += [(Path(rel).name, a) for a in re.findall(r"\]\(#([a-z0-9_-]+)\)", text)]
        for page, a in links:
            if page not in have or (a and a not in have[page]):
                broken.append(f"{rel}: {page}#{a}")
        if "docs/benchmarks.md" in text or "(benchmarks.md" in text:
            broken.append(f"{rel}: names docs/benchmarks.md, now docs/benchmarks/")
    assert not broken, broken
