"""The documentation a user reads: every relative link resolves inside the repository, and no
file refers to files a user of the project does not have."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKDOWN = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted(p for folder in ("kernels", "reference", "bench", "examples", "tests", ".ci")
                 for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", "")
                 and p.is_file() and "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve_inside_the_repository(path):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    for link in links:
        assert not link.startswith(("http:", "https:")), f"{path.name}: external link {link}"
        target = (path.parent / link).resolve()
        assert target.is_relative_to(ROOT) and target.exists(), f"{path.name}: {link}"


def test_docs_cover_the_design_and_a_kernel_authors_guide():
    assert {"design.md", "kernel-guide.md", "usage.md"} <= {p.name for p in MARKDOWN}
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/design.md", "docs/kernel-guide.md", "docs/usage.md"):
        assert f"]({page})" in readme


def test_nothing_refers_to_files_outside_the_repository():
    # The project's internal contract lives outside the repository; users never see it.
    outside = re.compile(r"DESIGN\.md|shared folder|\.\./shared|/work/")
    offenders = [str(p.relative_to(ROOT)) for p in [*MARKDOWN, *SOURCES]
                 if p != pathlib.Path(__file__).resolve() and outside.search(p.read_text())]
    assert not offenders
