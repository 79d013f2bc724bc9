"""The README and docs/ pages point at files that exist: every relative Markdown link, and every
repository path they quote in code spans (`bench/results/x.md`, `inference/load.py`)."""

import re

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Quoted paths under these folders; distill/ is left out: the pages also quote a run directory's distill/ files.
QUOTED = re.compile(r"`((?:bench|docs|examples|recipes|conf|eval|inference|compress|slimlm|tests)/[^`\s]+)`")


def named_files(page) -> list[str]:
    text = page.read_text()
    links = [
        target.split("#")[0]
        for target in LINK.findall(text)
        if "://" not in target and not target.startswith(("#", "mailto:"))
    ]
    quoted = [
        target.split(":")[0]
        for target in QUOTED.findall(text)
        if not any(mark in target for mark in "<*{$") and not target.startswith("bench/runs/")
    ]
    return [name for name in links + quoted if name]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_file_a_page_names_exists(page):
    names = named_files(page)
    missing = [name for name in names if not (page.parent / name).exists() and not (REPO / name).exists()]
    assert names and not missing, f"{page.name} names files that do not exist: {missing}"
