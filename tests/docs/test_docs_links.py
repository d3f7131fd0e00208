"""Every relative link of the README and docs/ points at something that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, inline code removed, with their 1-based numbers."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _INLINE_CODE.sub("", line)))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(page.read_text("utf-8")):
        match = _HEADING.match(line)
        if match:
            base = _slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def _links(page: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in _prose_lines(page.read_text("utf-8")):
        links.extend((number, m.group(1)) for m in _LINK.finditer(line))
    return links


def test_pages_exist():
    names = {p.name for p in PAGES}
    assert {"README.md", "index.md", "design.md", "resume.md", "callbacks.md", "configs.md", "multi_node.md",
            "benchmarks.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        if not dest.exists():
            broken.append(f"{page.name}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{page.name}:{number}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_link(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) `[code](nowhere.md)`\n\n```\n[x](fenced.md)\n```\n",
                    "utf-8")
    assert [t for _, t in _links(page)] == ["#title", "missing.md"]
    assert _anchors(page) == {"title"}
