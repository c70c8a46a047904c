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


# What the product's pages, comments and test names never carry: the project's history (it lives in git log
# and CHANGELOG.md). A tracker's issue number, a working session, a "stop" (a submission), the date of a run.
HISTORY = re.compile("|".join([
    r"\bissues?\s+#?\d+",
    r"\bissue\s+\d+'s\b",
    r"\bsessions?\b",
    r"\bstops?\s+(?:of\b|\d)",
    r"\b(?:this|that|the\s+previous|the\s+last|the\s+next|an\s+earlier|a\s+later|the\s+same|same|one|"
    r"each|every|its|whose|\w+'s)\s+stops?\b(?!\s+(?:at|when|if|after|before|short|early|growing|"
    r"shrinking|falling|rising|changing|here|there|gradients?))",
    r"\b20\d\d-[01]\d-[0-3]\d\b",
]), re.IGNORECASE)
PRODUCT = ["README.md", "docs", "micscompile", "tests", "benchmarks", "examples"]


def _product_files() -> list[Path]:
    files = []
    for name in PRODUCT:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*")
                                                      if p.suffix in (".md", ".py", ".sh", ".txt"))
    return files


def history_mentions(files: list[Path], commits: set[str] = frozenset()) -> list[str]:
    """Each line of `files` that speaks of the project's history: a HISTORY pattern, or a word that is the
    abbreviation of one of `commits` (this repository's own commit hashes; upstream pins are citations)."""
    found = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", line) if w in commits]
            m = HISTORY.search(line)
            if m or hashes:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{n}: {m.group(0) if m else hashes[0]!r}")
    return found


def _own_commits() -> set[str]:
    """Every abbreviation (7 to 40 hex digits) of this repository's commits; empty outside a git clone."""
    import subprocess
    try:
        full = subprocess.run(["git", "-C", str(ROOT), "log", "--all", "--format=%H"], capture_output=True,
                              text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {h[:n] for h in full for n in range(7, 41)}


def test_the_product_speaks_of_itself_not_of_its_history():
    files = [p for p in _product_files() if p != Path(__file__).resolve()]
    found = history_mentions(files, _own_commits())
    assert found == [], "history belongs in git log and CHANGELOG.md:\n" + "\n".join(found)


@pytest.mark.parametrize("line", ["Measured in issue 26 on two ranks.", "as issue 55's table shows",
                                  "(the stop of 2026-11-27)", "since this stop the rate is 0.6",
                                  "a third session with a GPU", "run on 2026-11-26"])
def test_a_line_of_history_is_caught(line, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\nA fine line; the loop stops when the step stops shrinking.\n{line}\n")
    assert [f.split(":")[1] for f in history_mentions([page])] == ["4"]


def test_a_commit_of_this_repository_is_caught_and_an_upstream_pin_is_not(tmp_path):
    ours = sorted(_own_commits(), key=len)[0] if _own_commits() else "f9c12d2"
    page = tmp_path / "page.md"
    page.write_text(f"DeepSpeed read at `edaa7221`.\nThe table before {ours} changed.\n")
    assert [f.split(":")[1] for f in history_mentions([page], {ours})] == ["2"]
