"""The chapters as pages: their cell format, pages that show the scripts' current code, and nothing
wider than the documentation's code column.

**The column is 80 characters.** Measured once in headless Chromium (and re-measured by
``test_the_column_holds_80_characters_in_chromium``): a one-page mkdocs site with this project's
theme settings (mkdocs-material 9.8, ``font: false``, so code is set in the system monospace font,
DejaVu Sans Mono here) and a 200-digit line in a fenced code block. At every viewport at least 1220 px
wide (where the navigation and the table of contents both show and the content column has its
maximum width) the ``pre > code`` box is 656 px wide at a root font of 20 px (721.8 px at 22 px,
787.6 px at 24 px) and a character is 8.184 px (9.003, 9.821): 80.2 characters. Narrower windows drop
the sidebars and give more room (87.7 at 1024 px). A code block inside a folded admonition
(``??? example``) uses a smaller font and holds 97. So a line of at most 80 characters is never cut,
and ``tutorials/_common.WIDTH`` and ``tutorials/ruff.toml`` use 80.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import site_check  # noqa: E402
from preconditions import unavailable  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS, TUTORIALS = ROOT / "docs", ROOT / "tutorials"
COLUMN = 80
CHAPTERS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
# Pages whose code blocks are not held to the column, and why.
EXEMPT = {
    "bench/RESULTS.md": "lab notes written by the benchmark scripts, pulled into the benchmarks page "
                        "(docs/hooks.py); the page's summary on top is what fits the screen",
}


def _import(folder: pathlib.Path, name: str):
    sys.path.insert(0, str(folder))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(folder))


cells = _import(TUTORIALS, "_cells")
gen_pages = _import(DOCS, "gen_pages")


def fenced_lines(markdown: str):
    """(line number, text) of every line inside a fenced code block, the block's own indentation
    (an admonition's, a list's) removed."""
    fence = None
    for number, line in enumerate(markdown.splitlines(), 1):
        m = re.match(r"^( *)(`{3,}|~{3,})", line)
        if m and fence is None:
            fence = (m.group(1), m.group(2))
        elif m and fence is not None and m.group(1) == fence[0] and line.strip() == fence[1]:
            fence = None
        elif fence is not None:
            yield number, line[len(fence[0]):]


def overwide(markdown: str, width: int = COLUMN) -> list[tuple[int, int, str]]:
    """(line number, characters, text) of each code or output line wider than ``width``."""
    return [(n, len(text), text) for n, text in fenced_lines(markdown) if len(text) > width]


def with_includes(path: pathlib.Path) -> str:
    """A page as the site shows it: ``--8<-- "file"`` snippet lines and ``<!-- include: file -->``
    markers (docs/hooks.py) replaced by the files, except the ``EXEMPT`` ones."""
    def text(name: str) -> str:
        return "" if name in EXEMPT else (ROOT / name).read_text().rstrip("\n")

    page = re.sub(r'^--8<-- "([^"]+)"$', lambda m: text(m.group(1)), path.read_text(), flags=re.M)
    return re.sub(r"<!-- include: (\S+) -->", lambda m: text(m.group(1)), page)


def code_blocks(markdown: str, lang: str) -> list[str]:
    """The bodies of the fenced blocks of language ``lang``, in order, indentation removed."""
    out, current, fence = [], None, None
    for line in markdown.splitlines():
        m = re.match(r"^( *)```(\w*)", line)
        if m and current is None:
            fence, current = m.group(1), [] if m.group(2) == lang else None
            if current is None:
                fence = m.group(1) + "#other"
        elif m and current is not None and line.strip() == "```" and m.group(1) == fence:
            out.append("\n".join(current))
            current = fence = None
        elif current is not None:
            current.append(line[len(fence):])
        elif fence and fence.endswith("#other") and line.strip() == "```":
            fence = None
    return out


# --- the width check --------------------------------------------------------------------------------
def test_the_width_check_finds_what_is_too_wide():
    page = textwrap.dedent("""\
        # Title
        A prose line that is much longer than eighty characters is fine: prose wraps by itself, always.
        ```python
        short = 1
        wide = "%s"
        ```
        ??? example "folded"

            ```text
            %s
            %s
            ```
        """) % ("x" * 80, "y" * COLUMN, "z" * (COLUMN + 1))
    found = overwide(page)
    assert [(n, w) for n, w, _ in found] == [(5, 89), (11, 81)]          # indentation is not counted
    assert found[1][2] == "z" * (COLUMN + 1)
    assert overwide("```\n" + "a" * 200) == [(2, 200, "a" * 200)]        # an unclosed block still counts


def test_chapter_pages_fit_the_column():
    """Every code and output line of the chapter pages (and the index) fits in the column."""
    problems = {p.name: overwide(p.read_text()) for p in sorted((DOCS / "tutorials").glob("*.md"))}
    assert not {k: v for k, v in problems.items() if v}, problems


def test_other_pages_fit_the_column():
    """The hand-written pages too, with the files they include (``EXEMPT`` aside)."""
    # (api and annotated: generated from src/, whose lines are 110 wide; annotated pages scroll them)
    pages = [p for p in DOCS.rglob("*.md")
             if not {"api", "tutorials", "annotated"} & set(p.relative_to(DOCS).parts)]
    assert len(pages) > 10
    problems = {}
    for page in pages:
        if found := overwide(with_includes(page)):
            problems[page.relative_to(ROOT).as_posix()] = found[:3]
    assert not problems, problems
    included = "".join(p.read_text() for p in pages)
    for name in EXEMPT:
        assert f"<!-- include: {name} -->" in included or f'--8<-- "{name}"' in included, \
            f"EXEMPT names {name}, which no page includes any more: drop it"


# --- the cell format --------------------------------------------------------------------------------
SAMPLE = '''"""Chapter 99: a sample.

Run: python tutorials/99_sample.py
Prerequisites: chapter 01 and a
long line.

Introduction.
"""

# %% [markdown]
# ## A heading
#
# Some *prose*.

# %%
X = 1
print("one")

# %% helper: something folded
def f():
    return 2


# %% [markdown]
# More prose.

# %%
EXERCISES = [1]
'''


def test_cells_split_a_chapter_into_prose_and_code():
    got = cells.split(SAMPLE)
    assert [(c.kind, c.title) for c in got] == [("markdown", ""), ("code", ""),
                                               ("code", "helper: something folded"),
                                               ("markdown", ""), ("code", "")]
    assert got[0].text == "## A heading\n\nSome *prose*."
    assert got[1].text == 'X = 1\nprint("one")' and got[1].lineno == 16
    assert SAMPLE.splitlines()[got[2].lineno - 1] == "def f():"
    assert [c.is_exercises for c in got] == [False, False, False, False, True]
    assert [c.kind for c in cells.split('"""Doc."""\nx = 1\n')] == ["code"]    # no markers: one cell
    with pytest.raises(ValueError, match="line 3"):
        cells.split('"""Doc."""\n# %% [markdown]\n#not a markdown line\n')
    head = gen_pages.chapter_header(cells.docstring(SAMPLE))
    assert head == {"title": "Chapter 99: a sample", "run": "python tutorials/99_sample.py",
                    "prerequisites": "chapter 01 and a long line.", "intro": "Introduction."}


def test_run_keeps_each_cells_output_and_the_scripts_line_numbers(tmp_path):
    (tmp_path / "tutorials").mkdir()
    script = tmp_path / "tutorials" / "99_sample.py"
    script.write_text(SAMPLE.replace("EXERCISES = [1]", "import sys\nprint(sys.argv[1:], __name__)"))
    run = cells.run(script, ("--flag", "2"))
    assert run.outputs == ["one\n", "", "['--flag', '2'] __main__\n"]
    assert run.constants == {"X": 1}
    script.write_text(SAMPLE.replace("EXERCISES = [1]", "raise KeyError('boom')"))
    with pytest.raises(RuntimeError, match=r'99_sample.py", line 28[\s\S]*KeyError'):
        cells.run(script)


@functools.cache
def chapter(path: pathlib.Path):
    source = path.read_text()
    return source, cells.split(source), gen_pages.chapter_header(cells.docstring(source))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapter_is_literate_and_ends_with_exercises(path):
    source, parts, head = chapter(path)
    assert head["run"] == f"python tutorials/{path.name}"
    assert head["title"].startswith(f"Chapter {path.name[:2]}: ")
    kinds = [c.kind for c in parts]
    assert kinds.count("markdown") >= 3 and kinds.count("code") >= 3
    assert parts[-1].is_exercises, "a chapter ends with its EXERCISES cell"
    exercises = ast.literal_eval(parts[-1].text.split("=", 1)[1].replace("Exercise(", "("))
    assert 1 <= len(exercises) <= 2
    declared = {f for f, _ in gen_pages.chapter_flags(source)}
    for flags, question, answer, *_ in exercises:
        assert {f for f in flags.split() if f.startswith("--")} <= declared, flags
        assert question.endswith("?") and re.compile(answer)
    for c in parts:
        if c.kind == "code":
            long = [line for line in c.text.splitlines() if len(line) > COLUMN]
            assert not long, long


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_each_page_shows_its_scripts_current_code_and_prose(path):
    """The page is the script: its code cells, in order, and its prose. (That the outputs are those of
    the current script is checked where the chapters run: tests/docs/test_tutorials.py.)"""
    page = (DOCS / "tutorials" / f"{path.stem}.md").read_text()
    _, parts, head = chapter(path)
    assert page.startswith(f"# {head['title']}\n"), "regenerate: python docs/gen_pages.py --only tutorials"
    code = [c.text for c in parts if c.kind == "code" and not c.is_exercises]
    assert code_blocks(page, "python") == code, "regenerate: python docs/gen_pages.py --only tutorials"
    for c in parts:
        if c.kind == "markdown":
            assert c.text in page
    meta = gen_pages.chapter_meta(DOCS / "tutorials" / f"{path.stem}.md")
    assert meta["read_min"] >= 1 and meta["run_s"] > 0  # load-independent: metadata of a committed page
    assert ("## Try it" in page) == any(c.is_exercises for c in parts)


def test_the_index_lists_every_chapter_with_prerequisites_and_minutes():
    index = (DOCS / "tutorials" / "index.md").read_text()
    for path in CHAPTERS:
        _, _, head = chapter(path)
        meta = gen_pages.chapter_meta(DOCS / "tutorials" / f"{path.stem}.md")
        row = next(line for line in index.splitlines() if f"]({path.stem}.md)" in line)
        assert head["prerequisites"] in row
        assert f"| {meta['read_min']} min |" in row
    assert "## A reading path" in index and "](../glossary.md)" in index
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f"tutorials/{p.stem}.md" in nav for p in CHAPTERS)


# --- the column, measured ---------------------------------------------------------------------------
MEASURE = """JSON.stringify([...document.querySelectorAll('article pre > code')].map(code => {
    const cs = getComputedStyle(code);
    const inner = code.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
    const probe = document.createElement('span');
    probe.style.font = cs.font; probe.style.whiteSpace = 'pre'; probe.style.position = 'absolute';
    probe.textContent = 'x'.repeat(1000);
    code.appendChild(probe);
    const cw = probe.getBoundingClientRect().width / 1000;
    probe.remove();
    return inner / cw;
}))"""


@pytest.mark.slow
def test_the_column_holds_80_characters_in_chromium(tmp_path):
    """A one-page site with this project's theme settings: the code column at its widest layout holds
    exactly ``COLUMN`` characters (80.2 measured), a folded block at least as many."""
    try:
        import yaml
    except ImportError:
        unavailable("mkdocs (and PyYAML) are in the dev extra: pip install -e '.[dev]'")
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed (make setup installs it with apt-get)")
    project = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config = {k: project[k] for k in ("theme", "markdown_extensions", "extra_css") if k in project}
    (tmp_path / "docs").mkdir()
    for css in config.get("extra_css", []):
        (tmp_path / "docs" / css).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / css).write_bytes((DOCS / css).read_bytes())
    config |= {"site_name": "width", "nav": [{"Home": "index.md"}, {"Other": "other.md"}]}
    (tmp_path / "mkdocs.yml").write_text(json.dumps(config))             # JSON is YAML
    digits = "".join(str(i % 10) for i in range(1, 201))
    (tmp_path / "docs" / "index.md").write_text(
        f"# Width\n\n## A section\n\n```text\n{digits}\n```\n\n"
        f'??? example "folded"\n\n    ```python\n    {digits}\n    ```\n')
    (tmp_path / "docs" / "other.md").write_text("# Other\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--site-dir", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with site_check.Chromium(binary) as browser, site_check.serve(tmp_path / "site") as base:
        for width in (1220, 1440, 1920, 2560):
            with browser.tab(base, width=width) as tab:
                top, folded = json.loads(tab.evaluate(MEASURE))
            assert int(top) == COLUMN, f"{width} px: the code column holds {top:.1f} characters"
            assert folded >= COLUMN, f"{width} px: a folded block holds {folded:.1f} characters"
