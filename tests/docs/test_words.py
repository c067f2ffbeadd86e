"""The words of the docs: the glossary defines what the issues asked for and every link into it lands on
a heading; the README's module table is the layout of ``src/minicb``; the figures quoted on the home
page and on top of the benchmarks page are the ones ``bench/RESULTS.md`` records; nothing repeats the
static-batching note's overstated tensor-parallel sentence."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "minicb"
RESULTS = (ROOT / "bench" / "RESULTS.md").read_text()
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?")


def _slug(heading: str) -> str:
    from markdown.extensions.toc import slugify

    return slugify(heading.replace("`", ""), "-")


def _glossary_anchors() -> set[str]:
    text = (DOCS / "glossary.md").read_text()
    return {_slug(m) for m in re.findall(r"^## (.+)$", text, flags=re.M)}


def test_glossary_defines_the_words_the_issues_ask_for():
    anchors = _glossary_anchors()
    for anchor in ("batch-slot", "kv-slot-slot_mapping", "block", "block-table", "chunk", "step",
                   "token-budget", "ttft-itl-queueing-delay", "padding-padding-bubble-padding-waste",
                   "cu_seqlens", "preemption", "prefix-cache", "runner", "step-event-snapshot"):
        assert anchor in anchors, anchor


def test_every_concept_page_links_the_glossary_and_every_glossary_link_resolves():
    anchors = _glossary_anchors()
    for page in sorted((DOCS / "concepts").glob("*.md")):
        assert "glossary.md" in page.read_text(), f"{page.name} does not link the glossary"
    links = [(p, a) for p in DOCS.rglob("*.md") for a in re.findall(r"glossary\.md#([\w-]+)", p.read_text())]
    assert len(links) > 20
    bad = [f"{p.relative_to(DOCS)}: #{a}" for p, a in links if a not in anchors]
    assert not bad, bad


def _readme_modules() -> set[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| module | what it owns"):].split("\n\n")[0]
    names = set()
    for row in table.splitlines()[2:]:
        names |= set(re.findall(r"`([\w/]+(?:\.py)?)`", row.split("|")[1]))
    return names


def test_readme_module_table_is_the_layout_of_src():
    named = _readme_modules()
    for name in named:                                # nothing stale: every row names what exists
        assert (SRC / name.rstrip("/")).exists(), f"README names {name}, which is not in src/minicb"
    present = {p.name for p in SRC.glob("*.py") if p.name != "__init__.py"}
    present |= {p.name + "/" for p in SRC.iterdir() if (p / "__init__.py").exists()}
    left_out = sorted(present - named)
    assert not left_out, f"src/minicb has modules the README's table leaves out: {left_out}"


def test_no_page_repeats_that_mismatched_plans_simply_deadlock():
    files = [ROOT / "README.md", *DOCS.glob("*.md"), *(DOCS / "concepts").glob("*.md"), *SRC.rglob("*.py")]
    for f in files:
        assert not re.search(r"collectives (simply )?deadlock", f.read_text()), f
    home = (DOCS / "index.md").read_text()
    assert "hang" in home and "silently" in home and "error" in home


@pytest.mark.parametrize("page, start, end", [
    ("index.md", "Read it with two caveats", "## Where to go from here"),
    ("benchmarks.md", "## On one screen", "\n---\n"),
])
def test_quoted_figures_are_the_recorded_ones(page, start, end):
    """Every figure in the summary is in bench/RESULTS.md, where its command is."""
    text = (DOCS / page).read_text()
    part = text[text.index(start):text.index(end, text.index(start))]
    figures = ["".join(m) for m in NUMBER.findall(part)]
    assert len(figures) > 10
    missing = [f for f in figures if not re.search(r"(?<![\d.,])" + re.escape(f) + r"(?![\d])", RESULTS)]
    assert not missing, missing


def test_home_page_states_the_benchmark_table_with_its_caveats():
    home = (DOCS / "index.md").read_text()
    assert "| continuous batching | 3,850 (4.53x) | 88.2% | 85 ms | 22.5 ms | < 0.1% |" in home
    assert "88.2% cannot be compute (FLOP) utilisation" in home
    assert "impossible" in RESULTS and "3,850 x 141 GFLOP/token = 0.54 PFLOP/s = 22% of peak" in RESULTS
    assert "P99 inter-token latency: the opposite of the note" in RESULTS


# --- nothing cites a document the repository does not have ------------------------------------------
# The design notes and the note minicb grew from are in the docs (docs/design.md, docs/origins.md); a
# citation of a file outside the repository, or "the seed" for that note, cannot be resolved by a reader.
WORDS_ROOTS = ("src", "tests", "tutorials", "docs", "bench", "README.md")
UNRESOLVABLE = re.compile(r"DESIGN\.md|(?i:\bthe seed\b)")     # design.md (lower case) is the page
BINARY = {".png", ".jpg", ".gif", ".ico", ".woff", ".woff2", ".so", ".pyc"}


def _text_files() -> list[pathlib.Path]:
    """The repository's own files (what git tracks, or would: build output such as the egg-info that an
    editable install writes from an older README is not the repository's text)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *WORDS_ROOTS],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    return [ROOT / f for f in listed if f and (ROOT / f).is_file() and pathlib.Path(f).suffix not in BINARY
            and (ROOT / f).resolve() != pathlib.Path(__file__).resolve()]


def unresolvable_citations(text: str) -> list[str]:
    return [m.group(0) for m in UNRESOLVABLE.finditer(text)]


def test_the_citation_check_finds_what_it_should():
    assert unresolvable_citations("as DESIGN.md says; The seed's table; beside the seed.") == \
        ["DESIGN.md", "The seed", "the seed"]
    assert unresolvable_citations("see docs/design.md; --seed 3; seeded; the seeds; a seed=1") == []


def test_nothing_cites_design_md_or_the_seed():
    files = _text_files()
    assert len(files) > 100
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for p in files
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if unresolvable_citations(line)]
    assert not found, "say 'docs/design.md' or 'the static-batching note' (docs/origins.md):\n" + \
        "\n".join(found)


# --- the design page -----------------------------------------------------------------------------
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


@pytest.mark.parametrize("page", ["design.md", "origins.md"])
def test_every_relative_link_of_the_design_pages_resolves(page):
    """Each link lands on a page of the site, and on a heading of it where it names one."""
    text = (DOCS / page).read_text()
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    assert len(links) >= 5, links
    bad = []
    for target in links:
        path, _, anchor = target.partition("#")
        dest = (DOCS / page).parent / path if path else DOCS / page
        if not dest.is_file():
            bad.append(f"{target}: no such page")
        elif anchor and anchor not in {_slug(h) for h in HEADING.findall(dest.read_text())}:
            bad.append(f"{target}: no such heading")
    assert not bad, bad
    assert page in (ROOT / "mkdocs.yml").read_text(), f"{page} is not in the nav"


def test_the_design_page_names_every_package():
    """The package table of docs/design.md is the layout of src/minicb: no package left out, none stale."""
    text = (DOCS / "design.md").read_text()
    table = text[text.index("| package | what it is for"):].split("\n\n")[0]
    named = {m for row in table.splitlines()[2:] for m in re.findall(r"^\| `minicb\.(\w+)`", row)}
    present = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert named == present, (sorted(named - present), sorted(present - named))
