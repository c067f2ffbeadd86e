"""The documentation site: it builds with ``mkdocs build --strict``, its built HTML has no broken
internal link, missing image or network resource, and headless Chromium opens the home page and a
tutorial page with no console error and the expected headings. Also: the generated pages cover every
tutorial and API module."""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import site_check  # noqa: E402
from preconditions import unavailable  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _gen_pages():
    sys.path.insert(0, str(DOCS))
    try:
        import gen_pages

        return gen_pages
    finally:
        sys.path.remove(str(DOCS))



@pytest.mark.slow
def test_strict_build_writes_every_page(site):
    for page in ("index.html", "tutorials/01_static_batching/index.html", "concepts/scheduler/index.html",
                 "api/scheduler/index.html", "vllm/index.html", "benchmarks/index.html", "errors/index.html"):
        assert (site / page).exists(), page
    api = (site / "api/scheduler/index.html").read_text()
    assert "schedule" in api and "StepPlan" in api                  # docstrings made it in
    # reST literal blocks (``text::`` + an indented block) are code blocks, the ``::`` gone
    # (docs/rest_literal.py, a griffe extension for the API pages)
    preemption = (site / "api/preemption/index.html").read_text()
    assert "Which victim:" in preemption and "Which victim::" not in preemption
    literal = [str(p.relative_to(site)) for p in site.glob("*/**/index.html")
               if re.search(r"\w::(</p>|\n)", p.read_text())]
    assert not literal, literal
    bench = (site / "benchmarks/index.html").read_text()
    assert "include: bench/RESULTS.md" not in bench                 # the hook replaced the marker
    if (ROOT / "bench/RESULTS.md").exists():
        first = next(ln for ln in (ROOT / "bench/RESULTS.md").read_text().splitlines() if ln.startswith("#"))
        assert first.lstrip("# ").strip().split()[0] in bench


@pytest.mark.slow
def test_no_broken_links_missing_images_or_network_resources(site):
    problems = site_check.broken_links(site)
    assert not problems, "\n".join(problems[:50])


def test_link_checker_catches_problems(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a/index.html").write_text('<h1 id="top">x</h1><a href="#top">ok</a><a href="../b/">ok</a>'
                                           '<img src="missing.png"><a href="#nope">bad</a>'
                                           '<script src="https://cdn.example/x.js"></script>'
                                           '<a href="https://example.org/">fine: a link out</a>')
    (tmp_path / "b").mkdir()
    (tmp_path / "b/index.html").write_text('<a href="/a/#top">ok</a><a href="/c/">bad</a>')
    problems = site_check.broken_links(tmp_path)
    assert len(problems) == 4, problems
    assert any("missing.png" in p for p in problems) and any("'nope'" in p for p in problems)
    assert any("from the network" in p for p in problems) and any("/c/" in p for p in problems)


@pytest.mark.slow
def test_pages_in_headless_chromium(site):
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed: `make browser` installs it (apt-get, as root); CI does")
    with site_check.Chromium(binary) as browser, site_check.serve(site) as base:   # fork before threads
        home = browser.open(base)
        tutorial = browser.open(base + "tutorials/01_static_batching/")
    assert home.errors == [] and tutorial.errors == [], home.errors + tutorial.errors
    assert home.title.startswith("minicb")
    assert ("h1", "minicb") in home.headings
    assert ("h2", "What continuous batching is, and why") in home.headings
    assert ("h2", "The story, as the static-batching note tells it") in home.headings
    assert home.images and all(ok for _, ok in home.images), home.images
    assert ("h1", "Chapter 01: static batching and its padding bubbles") in tutorial.headings
    assert ("h2", "1. One padded static batch of all four requests") in tutorial.headings   # literate
    assert ("h2", "Try it") in tutorial.headings


def test_tutorial_pages_cover_every_tutorial_and_are_current():
    scripts = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
    pages = sorted((DOCS / "tutorials").glob("[0-9][0-9]_*.md"))
    assert [p.stem for p in scripts] == [p.stem for p in pages]
    nav = (ROOT / "mkdocs.yml").read_text()
    for script in scripts:
        page = (DOCS / "tutorials" / f"{script.stem}.md").read_text()
        title = ast.get_docstring(ast.parse(script.read_text())).splitlines()[0].rstrip(".")
        assert page.startswith(f"# {title}\n"), f"{script.name}: run python docs/gen_pages.py"
        # the page's code is the script's (cell by cell): tests/docs/test_chapters.py
        assert "## Try it" in page and f"tutorials/{script.stem}.md" in nav


def test_api_pages_cover_the_listed_modules():
    gen = _gen_pages()
    nav = (ROOT / "mkdocs.yml").read_text()
    for _, modules in gen.API_MODULES:
        for page, shown in modules:
            text = (DOCS / "api" / f"{page}.md").read_text()
            assert f"api/{page}.md" in nav
            for m in gen.api_modules(shown):
                assert f"\n::: minicb.{m}\n" in text, (page, m)
                path = ROOT / "src/minicb" / m.replace(".", "/")
                assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), m
