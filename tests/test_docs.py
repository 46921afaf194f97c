"""The README is a door and docs/ holds the rest: every relative link of README.md, CHANGELOG.md and
docs/*.md leads to a file that exists, and every `#anchor` into a markdown file to one of its headings
(GitHub's slugs); the README stays short; docs/index.md lists every page. Absolute http(s) links are
not followed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 450

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped (code ticks, emphasis, a link's target),
    lower case, every character but letters, digits, `_`, `-` and spaces removed, spaces to `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_ markers, not snake_case
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings (ATX `#` headings outside code), with GitHub's `-1`,
    `-2` suffixes for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(text):
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[str]:
    """Every link target of a markdown text's prose (not in code blocks or inline code), images
    included."""
    targets = []
    for line in _prose_lines(text):
        line = _INLINE_CODE.sub("", line)
        targets += _LINK.findall(line) + _IMAGE.findall(line)
    return targets


def broken_links(path: Path) -> list[str]:
    """The relative links of the markdown file `path` that do not resolve, each with why: the file
    is missing (relative to `path`'s folder), or the `#anchor` names no heading of the markdown file
    it points into. http(s) and mailto links are skipped."""
    text = path.read_text()
    broken = []
    for target in links(text):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{path.name}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{path.name}: {target}: no heading #{anchor} in {dest.name}")
    return broken


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def test_the_slugs_are_githubs():
    assert slug("The `slackswap` config section") == "the-slackswap-config-section"
    assert slug("Pipeline- and tensor-parallel jobs") == "pipeline--and-tensor-parallel-jobs"
    assert slug("The simulated table (`slackswap simulate`, as printed on 2026-12-02)") == \
        "the-simulated-table-slackswap-simulate-as-printed-on-2026-12-02"
    assert slug("Against the paper (96.3 / 97.6 / 99.6)") == "against-the-paper-963--976--996"
    assert slug("Using `plan_file` and **traces**") == "using-plan_file-and-traces"
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}


def test_a_broken_link_is_found(tmp_path):
    """The check itself can fail: a missing file, an anchor that names no heading, and one into a
    file that has it; links in code are not links."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Real heading\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Door\n\n"
        "[fine](docs/page.md#real-heading) [fine too](#door) [web](https://example.com/x.md#nope)\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#no-such-heading) [bad here](#nowhere)\n"
        "`[in code](docs/missing.md)`\n\n```\n[in a block](docs/missing.md)\n```\n")
    assert broken_links(readme) == [
        "README.md: docs/missing.md: no such file",
        "README.md: docs/page.md#no-such-heading: no heading #no-such-heading in page.md",
        "README.md: #nowhere: no heading #nowhere in README.md",
    ]


def test_every_relative_link_resolves():
    files = markdown_files()
    assert len(files) > 5 and all(p.exists() for p in files)
    assert sum(len(links(p.read_text())) for p in files) > 50
    broken = [b for p in files for b in broken_links(p)]
    assert broken == []


def test_the_readme_is_a_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move a topic to docs/"


def test_the_index_links_every_page_in_docs():
    index = DOCS / "index.md"
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in links(index.read_text()) if not t.startswith("http")}
    pages = {p.resolve() for p in DOCS.glob("*.md") if p.name != "index.md"}
    assert pages and sorted(p.name for p in pages - linked) == []
    readme_links = links((ROOT / "README.md").read_text())
    assert "docs/index.md" in readme_links and "CHANGELOG.md" in readme_links
