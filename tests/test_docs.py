"""The design the code cites is in the repository (docs/design.md), and so is every page the README links."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

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


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    as hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = _slug(line.lstrip("#"))
            n = 1
            while slug in out:  # (a repeated heading gets -1, -2, ...)
                slug = f"{_slug(line.lstrip('#'))}-{n}"
                n += 1
            out.add(slug)
    return out


def broken_anchors(pages: list[Path]) -> list[str]:
    """Every relative link ``page.md#anchor`` (or ``#anchor``) of ``pages`` whose anchor no heading has."""
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = page if not target else page.parent / target
            if path.suffix == ".md" and path.exists() and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    return broken


def test_every_anchor_a_page_links_is_a_heading_of_its_target():
    assert broken_anchors([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]) == []


def test_a_broken_anchor_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Glossary and formulas (from the papers)\n\n```\n# not a heading\n```\n")
    (tmp_path / "b.md").write_text("[x](a.md#glossary-and-formulas-from-the-papers) [y](a.md#glossary) "
                                   "[z](a.md#not-a-heading)\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert broken_anchors([tmp_path / "b.md"]) == ["b.md: a.md#glossary", "b.md: a.md#not-a-heading"]
    finally:
        ROOT = root


def test_the_design_lists_every_plan_field():
    import dataclasses

    import micscompile as mc

    design = (ROOT / "docs" / "design.md").read_text()
    fields = design[design.index("Plan fields:"):].split("\n\n")[0]
    assert [f.name for f in dataclasses.fields(mc.Plan) if f"`{f.name}`" not in fields] == []


def test_the_public_names_are_the_ones_the_design_lists():
    import micscompile as mc

    design = (ROOT / "docs" / "design.md").read_text()
    listed = design[design.index("What `from micscompile import *` gives"):].split("\n\n")[0]
    names = set(re.findall(r"`(\w+)`", listed.split("; and `ir`")[0])) | {"ir"}
    assert set(mc.__all__) == names, set(mc.__all__) ^ names
    namespace: dict = {}
    exec("from micscompile import *", namespace)  # (the star import a user writes)
    assert {k for k in namespace if not k.startswith("__")} == set(mc.__all__)


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_is_a_page_a_newcomer_reads_in_one_sitting():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "../" not in text  # (every link inside the repository)
    flat = " ".join(text.split())
    for work in ("MiCS: Near-linear Scaling", "Using Megatron-LM.* SC'21", "Reducing Activation Recomputation", "ZeRO:"):
        assert work in flat, work


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_the_readmes_python_runs_as_written(index, tmp_path):
    """Each Python block of the README, alone in a fresh interpreter (the quickstart trains, the planning
    block prices on meta)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _readme_blocks()[index]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), "the block printed nothing"
