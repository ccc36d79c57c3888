"""The documentation's links and shape (one process, no GPU): every relative link in README.md,
CONTRIBUTING.md (when there is one), CHANGELOG.md and the pages of docs/ (docs/results/ too)
names a file or folder that exists; no commit hash in the prose of README.md, CHANGELOG.md and
docs/*.md, nor in the code spans and blocks of README.md and docs/*.md (the history, CHANGELOG.md,
may quote a command that names one); README.md,
CHANGELOG.md and every docs/*.md page say what they are for in a paragraph under the title,
before the first `##` heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Pages at the repository's root: these must exist; CONTRIBUTING.md is checked when it does.
ROOT_PAGES = ("README.md", "CHANGELOG.md")
OPTIONAL_ROOT_PAGES = ("CONTRIBUTING.md",)

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target), with an optional "title"; the text may not hold brackets.
LINK = re.compile(r"!?\[[^\[\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# An abbreviated or full commit hash: 7 to 40 lowercase hex digits, a word of its own.
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
# The same inside code, where numbers are common: a digit and a letter both (so 1073741824 or a
# word of hex letters is not one); 0x3B124925 and 0xffa5 are no words of their own after "0x".
CODE_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def link_pages() -> list[Path]:
    pages = [ROOT / name for name in ROOT_PAGES]
    pages += [ROOT / name for name in OPTIONAL_ROOT_PAGES if (ROOT / name).exists()]
    return pages + sorted(DOCS.glob("*.md")) + sorted((DOCS / "results").glob("*.md"))


def prose_pages() -> list[Path]:
    return [ROOT / name for name in ROOT_PAGES] + sorted(DOCS.glob("*.md"))


def fact_pages() -> list[Path]:
    """The pages that state what the code is: no commit is named on them, not even in code."""
    return [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))


def prose(text: str) -> str:
    """`text` without its code: fenced blocks, indented blocks (4 spaces or more after a blank
    line or another such line) and code spans become empty, so what is left is the prose, the
    tables and the links."""
    kept, fenced, indented, previous_blank = [], False, False, True
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            kept.append("")
            continue
        blank = not line.strip()
        indented = not blank and line.startswith("    ") and (previous_blank or indented)
        kept.append("" if fenced or indented else line)
        previous_blank = blank
    return CODE_SPAN.sub("", "\n".join(kept))


def links(text: str) -> list[str]:
    """The relative link targets of a page's prose (no URL, no fragment of this page)."""
    targets = []
    for target in LINK.findall(prose(text)):
        if SCHEME.match(target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def opening_paragraph(text: str) -> str:
    """The first paragraph under the page's `# ` title, before any `##` heading ("" if none)."""
    lines = text.split("\n")
    if not lines or not lines[0].startswith("# "):
        return ""
    paragraph = []
    for line in lines[1:]:
        if line.startswith("#"):
            break
        if not line.strip():
            if paragraph:
                break
            continue
        if not paragraph and re.match(r"(\s{4}|\s*(\||```|[-*+] |\d+\. |>))", line):
            break  # a table, code, a list or a quote first: no paragraph says what it is for
        paragraph.append(line.strip())
    return " ".join(paragraph)


def test_the_root_pages_exist():
    for name in ROOT_PAGES:
        assert (ROOT / name).is_file(), f"{name} is missing"


@pytest.mark.parametrize("page", link_pages(), ids=relative)
def test_every_relative_link_names_a_file_that_exists(page):
    broken = [
        target
        for target in links(page.read_text(encoding="utf-8"))
        if target and not (page.parent / target).exists()
    ]
    assert not broken, f"{relative(page)}: links to missing files: {broken}"


@pytest.mark.parametrize("page", prose_pages(), ids=relative)
def test_no_commit_hash_in_prose(page):
    found = []
    for number, line in enumerate(prose(page.read_text(encoding="utf-8")).split("\n"), 1):
        found += [f"line {number}: {word}" for word in HASH.findall(line)]
    assert not found, f"{relative(page)}: commit hashes outside quoted commands: {found}"


@pytest.mark.parametrize("page", fact_pages(), ids=relative)
def test_no_commit_hash_in_code_of_the_docs(page):
    found = []
    for number, line in enumerate(page.read_text(encoding="utf-8").split("\n"), 1):
        found += [f"line {number}: {word}" for word in CODE_HASH.findall(line)]
    assert not found, f"{relative(page)}: commit hashes (CHANGELOG.md keeps history): {found}"


@pytest.mark.parametrize("page", prose_pages(), ids=relative)
def test_every_page_says_what_it_is_for_before_its_first_section(page):
    paragraph = opening_paragraph(page.read_text(encoding="utf-8"))
    assert paragraph, f"{relative(page)}: no paragraph under the title before the first `##`"


def test_the_checks_see_what_they_check():
    # The link check finds a link's target and ignores URLs, fragments and code.
    text = "See [a](a.md#x), [u](https://x.org/y), [f](#top) and `[c](c.md)`.\n\n    [d](d.md)\n"
    assert links(text) == ["a.md"]
    # A hash counts in prose, not inside a code span or a code block.
    text = "Fixed in 6f889cd.\n\n`git show 6f889cd:x`\n\n    git show 657ee75:y\n"
    assert HASH.findall(prose(text)) == ["6f889cd"]
    # In the docs' code a hash counts too; numbers, hex constants and hex-letter words do not.
    text = "`git show 6f889cd:x` `0x3B124925` `0xffa5c0de` `1073741824` `deadbeef` `657ee75`"
    assert CODE_HASH.findall(text) == ["6f889cd", "657ee75"]
    # An opening paragraph must come before the first section and not be a table or a list.
    assert opening_paragraph("# T\n\nWhat it is for.\n\n## A\n") == "What it is for."
    assert opening_paragraph("# T\n\n## A\nText.\n") == ""
    assert opening_paragraph("# T\n\n| a |\n|---|\n") == ""


# The library's and the tests' source names pages of docs/ in docstrings and comments (bench/
# also names the pages it writes, which need not exist yet: not checked).
SOURCE_FOLDERS = ("dep_ep", "launch", "comm", "experts", "ep", "integrations", "testing", "tests")
DOC_PATH = re.compile(r"\bdocs/[A-Za-z0-9_/.-]*\.(?:md|png)\b")


def test_source_names_only_docs_that_exist():
    missing = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().split("\n"), 1):
                for name in DOC_PATH.findall(line):
                    if not (ROOT / name).exists():
                        missing.append(f"{relative(path)}:{number}: {name}")
    assert not missing, "\n".join(missing)


def indented_commands(text: str) -> list[str]:
    """The shell commands of a page's indented blocks: continuation lines joined, comments and
    extra spaces dropped."""
    commands, current = [], ""
    for line in text.split("\n"):
        if not line.startswith("    "):
            continue
        line = line.split("  #")[0].strip()
        current = f"{current} {line}".strip()
        if current.endswith("\\"):
            current = current[:-1].strip()
            continue
        commands.append(" ".join(current.split()))
        current = ""
    return [c for c in commands if c]


def test_readme_engine_section_matches_the_integrations_page():
    """README.md's "Inside vLLM / SGLang" gives the launch commands, each as written on
    docs/integrations.md (the page whose facts they rest on), so the two cannot drift."""
    readme = (ROOT / "README.md").read_text()
    parts = readme.split("\n## Inside vLLM / SGLang\n")
    assert len(parts) == 2, "README.md has no '## Inside vLLM / SGLang' section"
    section = parts[1].split("\n## ")[0]
    commands = indented_commands(section)
    assert any("DEP_EP_VLLM=1" in c for c in commands), commands
    assert any("DEP_EP_SGLANG=1" in c for c in commands), commands
    page = set(indented_commands((DOCS / "integrations.md").read_text()))
    missing = [c for c in commands if c not in page]
    assert not missing, f"README commands not on docs/integrations.md: {missing}"
