"""Every relative link in the README and docs/ resolves to a file in the repository (and, with a #fragment into a
Markdown page, to one of its headings, by GitHub's anchor rule)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'; repeats get -1, -2."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#") and not target[1:]:
            continue  # http:, https:, mailto:
        path, _, fragment = target.partition("#")
        dest = page if not path else (page.parent / path).resolve()
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


DATA_FOLDERS = ("docs/results", "docs/long_context", "docs/similarity")


def test_every_data_file_under_docs_is_named_by_a_page():
    """Records, plots and benchmark JSON under docs/ are each named (by file name) on some page -- README, the
    changelog or docs/*.md -- so a number's source can be found from the page that states it."""
    text = "\n".join(p.read_text() for p in PAGES)
    files = [p for folder in DATA_FOLDERS for p in sorted((ROOT / folder).rglob("*"))
             if p.is_file() and p.suffix != ".md"]
    assert files, "no data files found under docs/"
    unnamed = [str(p.relative_to(ROOT)) for p in files if p.name not in text]
    assert not unnamed, f"data files no page names: {unnamed}"
