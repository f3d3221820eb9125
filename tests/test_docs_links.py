"""User docs stay navigable: README.md is short, every relative link in README.md, docs/*.md and
benchmarks/*.md points to an existing file (and heading, for ``#anchor`` links), and the key
reference of docs/configuration.md matches dlrmctl/config/schema.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

README_MAX_LINES = 350
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation dropped, spaces -> '-'."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not checked


def test_readme_is_at_most_350_lines():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}); move detail to docs/"


def test_docs_and_benchmarks_exist():
    assert list((REPO / "docs").glob("*.md")) and list((REPO / "benchmarks").glob("*.md"))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    bad = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, f"{page.relative_to(REPO)}: broken links: " + "; ".join(bad)


def test_link_checker_catches_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n[ok](p.md#title) [bad](missing.md) [bad anchor](p.md#nope)\n")
    assert _links(page) == ["p.md#title", "missing.md", "p.md#nope"]
    assert _anchors(page) == {"title"}


def test_configuration_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = gen.PAGE.read_text()
    assert gen.render(page) == page, "docs/configuration.md is out of date: run python scripts/gen_config_docs.py"
    # every key of the schema is in the page
    from dlrmctl.config import ExperimentConfig
    import dataclasses

    for f in dataclasses.fields(ExperimentConfig.__dataclass_fields__["data"].default_factory()):
        assert f"`data.{f.name}`" in page
