"""Every relative link in ``README.md`` and ``docs/*.md`` resolves: the file exists and, for a
``#anchor`` into a Markdown file, a heading of that file has that anchor under GitHub's rule.

GitHub's anchor of a heading (github-slugger): the heading's rendered text, lower-cased, with every
character that is not a letter, digit, space, ``-`` or ``_`` removed and each space turned into
``-``; a repeated anchor in one file gets ``-1``, ``-2``, ... Links inside code (fenced blocks and
inline spans) are text, not links, and web addresses are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) or ![alt](target), text with at most one level of brackets, an optional "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def without_code(text: str) -> str:
    """``text`` with fenced code blocks and inline code spans blanked out (their links are text)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text (before de-duplication).

    >>> slug("What `make demo` does and shows")
    'what-make-demo-does-and-shows'
    >>> slug("8. Dilution or distance drift: which fix a head needs")
    '8-dilution-or-distance-drift-which-fix-a-head-needs'
    """
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path) -> tuple[list[str], int]:
    """The relative links of ``page`` that do not resolve (each with why), and how many were checked."""
    problems, checked = [], 0
    for target in LINK.findall(without_code(page.read_text(encoding="utf-8"))):
        if not target or SCHEME.match(target):
            continue
        checked += 1
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: {target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{page.name}: {target}: no heading with anchor #{anchor} in {dest.name}")
    return problems, checked


@pytest.mark.parametrize("heading, expected", [
    ("Long context: does it beat what production ships?", "long-context-does-it-beat-what-production-ships"),
    ("Refit from statistics: `sharpdraft fit`", "refit-from-statistics-sharpdraft-fit"),
    ("Distance fixes (positions)", "distance-fixes-positions"),
    ("`make demo`: calibrate, select, check on held-out text", "make-demo-calibrate-select-check-on-held-out-text"),
    ("Many processes: torchrun and Slurm", "many-processes-torchrun-and-slurm"),
    ("transformers models (Llama, Qwen, PARD, DFlash)", "transformers-models-llama-qwen-pard-dflash"),
    ("See [the spec](spec.md) **now**", "see-the-spec-now"),
    ("a_b  c", "a_b--c"),  # underscores stay; each space is a hyphen
])
def test_slug_follows_githubs_rule(heading, expected):
    assert slug(heading) == expected


def test_repeated_headings_are_numbered_and_code_is_not_a_heading():
    page = "# Errors\n\n## Errors\n\n```bash\n# not a heading\n```\n\n### Errors #\n"
    assert anchors(page) == {"errors", "errors-1", "errors-2"}


def test_broken_links_are_found(tmp_path):
    """This test can fail: a missing file and a missing anchor are reported, nothing else is."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    (tmp_path / "page.md").write_text(
        "# Page\n\n"
        "[good file](other.md), [good anchor](other.md#a-section), [own anchor](#page), "
        "![image](other.md), [web](https://example.com/x.md), [mail](mailto:a@b.c)\n\n"
        "[missing file](nowhere.md) and [missing anchor](other.md#no-such-section)\n\n"
        "`[in a span](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n"
    )
    problems, checked = broken_links(tmp_path / "page.md")
    assert checked == 6
    assert len(problems) == 2
    assert "nowhere.md: no file" in problems[0]
    assert "#no-such-section" in problems[1]


def test_every_relative_link_resolves():
    problems, checked = [], 0
    for page in PAGES:
        page_problems, page_checked = broken_links(page)
        problems += page_problems
        checked += page_checked
    assert checked > 50, checked  # the pages do link to each other: the scan found them
    assert problems == []


def test_readme_is_a_newcomers_page():
    """The README starts with the two commands (CI runs ``make test`` through ``.ci/run``), stays short,
    and keeps a Results section that links each result table in docs/."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 250
    assert "```bash\nmake demo   #" in readme and "\nmake test   #" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    results = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    assert results.count("](docs/") >= 5
