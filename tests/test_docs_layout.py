"""The docs stay true to the tree: docs/architecture.md's "Layout" names every Python
module under src/shardline and nothing that does not exist, and every relative link in the
README and docs/ reaches a file (and, where it names one, a heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "shardline"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LISTED = re.compile(r"^- `([^`\s]+)`", re.M)
"""A layout entry: a bullet that starts with the path it describes."""


def layout_section(text: str) -> str:
    """The text of the "## Layout" section (up to the next second-level heading)."""
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "docs/architecture.md has no '## Layout' section"
    return match.group(1)


def listed_paths() -> list[str]:
    return LISTED.findall(layout_section(ARCHITECTURE.read_text()))


def test_the_layout_names_every_module():
    """Every module but the packages' ``__init__.py`` files (listed where they hold more
    than a package marker, not required)."""
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - set(listed_paths()))
    assert not missing, f"docs/architecture.md's Layout lacks: {missing}"


def test_the_layout_names_nothing_that_does_not_exist():
    paths = listed_paths()
    assert len(paths) == len(set(paths)), "a path is listed twice"
    absent = [p for p in paths if not (PACKAGE / p).exists() and not (ROOT / p).exists()]
    assert not absent, f"docs/architecture.md's Layout names what does not exist: {absent}"


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    to hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # no links in code
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
