"""Every relative link in the repository's Markdown resolves: the file (or folder) exists, and a `#anchor`
names a heading of the target as GitHub slugs it. External links are not fetched."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".hypothesis"}
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
ATX_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def markdown_files() -> list[Path]:
    return sorted(
        path for path in ROOT.rglob("*.md") if not SKIPPED_DIRS & set(path.relative_to(ROOT).parts)
    )


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their line numbers."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)[0] * len(opening.group(1))
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """The id GitHub gives a heading: its rendered text lower-cased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML shows nothing of its tags
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_ (snake_case keeps its underscores)
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors a Markdown file defines: heading slugs (repeats numbered as GitHub does) and HTML ids."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        heading = ATX_HEADING.match(line)
        if not heading:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


@dataclass(frozen=True)
class Link:
    source: Path
    line: int
    target: str


def relative_links(path: Path) -> list[Link]:
    links = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
        definition = REFERENCE_DEF.match(line)
        if definition:
            targets.append(definition.group(1))
        for target in targets:
            target = target.strip("<>")
            if not EXTERNAL.match(target):
                links.append(Link(path, number, target))
    return links


def link_problem(link: Link) -> str | None:
    """Why the link does not resolve, or None when it does."""
    address, _, anchor = link.target.partition("#")
    address = unquote(address)
    if not address:
        target = link.source
    elif address.startswith("/"):
        target = ROOT / address.lstrip("/")
    else:
        target = link.source.parent / address
    if not target.exists():
        return f"no such file: {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}"
    if anchor and target.suffix == ".md":
        if unquote(anchor).lower() not in anchors(target.resolve()):
            return f"no heading with the anchor #{anchor} in {target.resolve().relative_to(ROOT)}"
    return None


def test_slugs_follow_github():
    assert github_slug("The bookkeeping gate") == "the-bookkeeping-gate"
    assert github_slug("`mlxq bench` — what it measures") == "mlxq-bench--what-it-measures"
    assert github_slug("Files, Batches & uploads (v1/files)") == "files-batches--uploads-v1files"
    assert github_slug("max_tokens and *stop*") == "max_tokens-and-stop"
    assert github_slug("[Link](x.md) text") == "link-text"


def test_the_checker_sees_a_broken_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n\n[ok](#two-words) [bad](b.md#nothing) [gone](c.md)\n")
    (tmp_path / "b.md").write_text("# Something\n\n```\n# not a heading\n[not a link](nowhere.md)\n```\n")
    problems = [link_problem(link) for link in relative_links(tmp_path / "a.md")]
    assert problems == [None, "no heading with the anchor #nothing in b.md", "no such file: c.md"]
    assert relative_links(tmp_path / "b.md") == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = [
        f"{link.source.relative_to(ROOT)}:{link.line}: ({link.target}) {problem}"
        for link in relative_links(path)
        if (problem := link_problem(link))
    ]
    assert not problems, "\n".join(problems)
