"""The design the code cites is in the repository (docs/design.md), and so is every page the README links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("micscompile", "benchmarks", "examples", "tests")
           for p in sorted((ROOT / d).rglob("*.py")) if p != Path(__file__).resolve()]
CITE = re.compile(r'([\w./-]*)design\.md(?:\s*"([^"]+)")?')


def test_every_design_citation_names_docs_design_md_and_a_section_it_has():
    design = (ROOT / "docs" / "design.md").read_text()
    cited = 0
    for path in SOURCES:
        for m in CITE.finditer(path.read_text()):
            where = f"{path.relative_to(ROOT)}: {m.group(0)!r}"
            assert m.group(1) == "docs/", f"{where} cites a design outside the repository"
            assert m.group(2) is None or m.group(2) in design, f"{where}: no such section in docs/design.md"
            cited += 1
    assert cited >= 10  # the glossary's formulas are cited across the code


def test_readme_links_name_files_that_exist():
    links = re.findall(r"\]\(((?:docs|benchmarks|examples|tests)/[^)#\s]+)\)", (ROOT / "README.md").read_text())
    assert "docs/design.md" in links and "docs/gpu.md" in links
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_docs_pages_link_files_that_exist():
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not link.startswith(("http://", "https://")) and not (page.parent / link).exists():
                missing.append(f"{page.name}: {link}")
    assert missing == []
