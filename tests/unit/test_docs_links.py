"""Every relative link in the project's Markdown documents resolves.

A link ``[text](path)`` or ``![alt](path)`` (and a reference definition ``[id]: path``)
must name a file or folder that exists, relative to the document (or to the repository
root when it starts with ``/``). A link with a ``#fragment`` into a Markdown file (or a
bare ``#fragment`` into the document itself) must name a heading of that file, slugged by
GitHub's rules (github-slugger: lower case; every character that is not a letter, a digit,
a space, ``-`` or ``_`` dropped; each space a ``-``; the n-th repeat of a slug gets ``-n``),
or an explicit ``<a id=...>`` / ``<a name=...>`` anchor. External links (``http:``,
``https:``, ``mailto:``) are not fetched. Links inside fenced code blocks and inline code
spans are not links and are ignored.

Pure Python, no network: fast enough for ``make test-fast``.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250  # the README is a front door; the rest lives in docs/

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files(root: Path = ROOT) -> list[Path]:
    """The documents whose links are checked: README, CONTRIBUTING, CHANGELOG, docs/*.md
    and benchmarks/RESULTS.md (those that exist)."""
    names = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "benchmarks/RESULTS.md"]
    files = [root / n for n in names if (root / n).is_file()]
    return files + sorted((root / "docs").glob("*.md"))


def _prose_lines(text: str) -> list[str]:
    """The document's lines with fenced code blocks blanked and inline code spans removed
    (line numbers are kept)."""
    out: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            out.append("")
        elif fence is not None:
            if m and m.group(1).startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(_CODE_SPAN.sub("", line))
    return out


def _heading_text(raw: str) -> str:
    """A heading's text content as GitHub renders it: code spans keep their content,
    links and images keep their text, HTML tags go."""
    text = _CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"<[^>]+>", "", text)


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading's text content (github-slugger, before de-duplication)."""
    kept = "".join(ch for ch in text.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every ``#fragment`` a link into ``path`` may name: its headings' slugs (repeats
    numbered as GitHub numbers them) and its explicit HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fence: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if m and m.group(1).startswith(fence):
                fence = None
            continue
        found.update(_HTML_ANCHOR.findall(line))
        h = _ATX_HEADING.match(line)
        if not h:
            continue
        slug = github_slug(_heading_text(h.group(2)))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link in ``path`` outside code."""
    out: list[tuple[int, str]] = []
    for no, line in enumerate(_prose_lines(path.read_text(encoding="utf-8")), start=1):
        out.extend((no, t) for t in _INLINE_LINK.findall(line))
        ref = _REF_DEF.match(line)
        if ref:
            out.append((no, ref.group(1)))
    return out


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """``file:line: target (why)`` for every relative link in ``files`` that does not resolve."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for doc in files:
        for no, target in links(doc):
            if _EXTERNAL.match(target):
                continue
            path_part, _, fragment = target.partition("#")
            path_part = unquote(path_part)
            if not path_part:
                dest = doc
            elif path_part.startswith("/"):
                dest = root / path_part.lstrip("/")
            else:
                dest = doc.parent / path_part
            where = f"{doc.relative_to(root)}:{no}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
                continue
            if fragment and dest.is_file() and dest.suffix == ".md":
                key = dest.resolve()
                if key not in cache:
                    cache[key] = anchors(dest)
                if unquote(fragment) not in cache[key]:
                    problems.append(f"{where} (no heading with anchor #{fragment})")
    return problems


def test_every_relative_link_in_the_docs_resolves():
    files = doc_files()
    assert ROOT / "README.md" in files
    problems = broken_links(files)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_docs_the_readme_points_to_exist():
    for name in ["architecture", "memory", "api", "operations", "testing"]:
        assert (ROOT / "docs" / f"{name}.md").is_file(), name
    for name in ["CONTRIBUTING.md", "CHANGELOG.md", "benchmarks/RESULTS.md"]:
        assert (ROOT / name).is_file(), name


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Limits and failure behaviour", "limits-and-failure-behaviour"),
        ("API (gRPC, `pagedserve.v1.Generation`)", "api-grpc-pagedservev1generation"),
        ("Paged vs contiguous: what paging buys", "paged-vs-contiguous-what-paging-buys"),
        ("`pagedserve serve` on a Ray cluster", "pagedserve-serve-on-a-ray-cluster"),
        ("Swap or recompute?", "swap-or-recompute"),
        ("Kernels — CPU", "kernels--cpu"),
        ("snake_case and 2026-12-01", "snake_case-and-2026-12-01"),
        ("Link to [the API](api.md)", "link-to-the-api"),
    ],
)
def test_github_slug(heading: str, slug: str):
    assert github_slug(_heading_text(heading)) == slug


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_good_links_pass_and_broken_ones_are_reported(tmp_path: Path):
    _write(tmp_path / "docs" / "api.md", "# API\n\n## The CLI\n\n## FAQ\n\n## FAQ\n")
    _write(tmp_path / "src" / "mod.py", "")
    readme = _write(
        tmp_path / "README.md",
        "# Title\n\n## Two commands\n\n"
        "[api](docs/api.md) [cli](docs/api.md#the-cli) [second faq](docs/api.md#faq-1)\n"
        "[module](src/mod.py) [folder](src/) [here](#two-commands) [root](/docs/api.md)\n"
        "![img](docs/api.md) [web](https://example.com/x.md#nope) [mail](mailto:a@b.c)\n"
        "`[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
        "[ref]: docs/api.md#faq\n",
    )
    assert broken_links([readme], root=tmp_path) == []

    bad = _write(
        tmp_path / "CONTRIBUTING.md",
        "# C\n\n[gone](docs/missing.md)\n[no heading](docs/api.md#nope)\n"
        "[self](#absent)\n[ref]: src/missing.py\n",
    )
    problems = broken_links([bad], root=tmp_path)
    assert problems == [
        "CONTRIBUTING.md:3: docs/missing.md (no such file)",
        "CONTRIBUTING.md:4: docs/api.md#nope (no heading with anchor #nope)",
        "CONTRIBUTING.md:5: #absent (no heading with anchor #absent)",
        "CONTRIBUTING.md:6: src/missing.py (no such file)",
    ]


def test_the_repository_check_fails_on_a_broken_link(tmp_path: Path):
    _write(tmp_path / "README.md", "# R\n\nSee [the docs](docs/architecture.md#layers).\n")
    _write(tmp_path / "docs" / "architecture.md", "# Architecture\n\n## Layer rules\n")
    files = doc_files(tmp_path)
    assert files == [tmp_path / "README.md", tmp_path / "docs" / "architecture.md"]
    assert broken_links(files, root=tmp_path) == [
        "README.md:3: docs/architecture.md#layers (no heading with anchor #layers)"
    ]
