"""The README stays a front page: short, and every docs link it holds leads to a page."""

from __future__ import annotations

import re

from tests.unit.docs.conftest import ROOT

README = ROOT / "README.md"
MAX_LINES = 200


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_every_docs_link_of_the_readme_leads_to_a_page() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text())
    assert links, "the README links into the docs"
    missing = sorted(link for link in links if not (ROOT / link).is_file())
    assert missing == []
