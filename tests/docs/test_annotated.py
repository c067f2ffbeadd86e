"""The annotated source pages (docs/annotated/, written by ``docs/gen_pages.py``): each is what the
generator makes of the current source, every code block is the file's own lines at the line numbers it
shows, and every page names chapters and tests that exist."""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import gen_pages  # noqa: E402
import rest_literal  # noqa: E402

sys.path.remove(str(DOCS))

NAMES = [spec[0] for spec in gen_pages.ANNOTATED]
BLOCK = re.compile(r'^```python linenums="(\d+)"\n(.*?)\n```$', re.S | re.M)


@pytest.mark.parametrize("name", NAMES)
def test_the_page_is_up_to_date_with_the_source(name):
    page = DOCS / "annotated" / f"{name}.md"
    assert page.read_text() == gen_pages.annotated_page(name), \
        f"{page.name} is older than its source: python docs/gen_pages.py --only annotated"


@pytest.mark.parametrize("name", NAMES)
def test_every_code_block_is_the_source_at_its_line_numbers(name):
    text = (DOCS / "annotated" / f"{name}.md").read_text()
    parts = re.split(r"^## `minicb/(\S+)`$", text, flags=re.M)
    blocks = 0
    for rel, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = (ROOT / "src" / "minicb" / rel).read_text().splitlines()
        for m in BLOCK.finditer(body):
            start, code = int(m.group(1)), m.group(2).split("\n")
            assert code == lines[start - 1:start - 1 + len(code)], (rel, start)
            blocks += 1
    assert blocks >= len(next(s for s in gen_pages.ANNOTATED if s[0] == name)[4])


@pytest.mark.parametrize("name", NAMES)
def test_the_page_names_chapters_and_tests_that_exist(name):
    _, _, chapters, tests, parts = next(s for s in gen_pages.ANNOTATED if s[0] == name)
    for chapter in chapters:
        assert (DOCS / "tutorials" / f"{chapter}.md").exists(), chapter
        assert (ROOT / "tutorials" / f"{chapter}.py").exists(), chapter
    for test in tests:
        assert (ROOT / test).exists(), test
    assert parts


def test_every_section_has_prose():
    """Each shown piece of code is explained: a section without a comment or docstring is a gap to fill
    in the source (comments only)."""
    gaps = [(name, qualname, start)
            for name, _, _, _, qualnames in gen_pages.ANNOTATED
            for rel, names in gen_pages.annotated_parts(qualnames)
            for qualname in names
            for prose, ((start, _), *_) in gen_pages.source_sections((ROOT / "src/minicb" / rel).read_text(),
                                                                     qualname)
            if not prose.strip()]
    assert not gaps, gaps  # load-independent: gaps in prose, not in time


def test_sections_split_at_docstrings_and_comment_blocks():
    source = '''
class A:
    def f(self, x):
        """Double x."""
        y = x + x

        # then check it
        # (twice)
        assert y == 2 * x
        return y  # a trailing comment stays
'''
    got = gen_pages.source_sections(source, "A.f")
    assert got == [("Double x.", [(3, ["    def f(self, x):"]), (5, ["        y = x + x"])]),
                   ("then check it\n(twice)", [(9, ["        assert y == 2 * x",
                                                   "        return y  # a trailing comment stays"])])]
    with pytest.raises(ValueError):
        gen_pages.source_sections(source, "A.g")
    # no docstring: the signature is shown with the first comment's section
    bare = "def g():\n    # say one\n    return 1\n"
    assert gen_pages.source_sections(bare, "g") == [("say one", [(1, ["def g():"]), (3, ["    return 1"])])]


def _literal_blocks(doc: str) -> list[str]:
    """The reST literal blocks of a docstring, dedented: the indented lines after a line ending in
    ``::`` (read here independently of the generator's converter)."""
    lines, blocks = doc.splitlines(), []
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        base, body = len(line) - len(line.lstrip()), []
        for follow in lines[i + 1:]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= base:
                break
            body.append(follow)
        blocks.append(textwrap.dedent("\n".join(body)).strip("\n"))
    return blocks


def test_the_continuous_page_shows_the_module_docstrings_steps_and_sharing_diagram():
    """The page the scheduler's lesson is on carries the three numbered steps and the same-step
    sharing picture of ``core/continuous.py``'s module docstring, as code blocks (not a literal ``::``)."""
    doc = ast.get_docstring(ast.parse((ROOT / "src/minicb/core/continuous.py").read_text()))
    blocks = _literal_blocks(doc)
    steps = next(b for b in blocks if re.match(r"1\. ", b))
    assert [m.group(1) for m in re.finditer(r"^(\d)\. ", steps, re.M)] == ["1", "2", "3"]
    sharing = doc[doc.index("**Sharing within one step.**"):]
    diagram = _literal_blocks(sharing)[0]
    assert "step 0:" in diagram and diagram.count("\n") >= 1
    page = (DOCS / "annotated" / "continuous_schedule.md").read_text()
    for block in (steps, diagram):
        assert f"```text\n{block}\n```" in page, block
    assert "in this order::" not in page and "in this order:" in page


def test_every_module_docstring_is_shown_whole():
    for name, _, _, _, qualnames in gen_pages.ANNOTATED:
        page = (DOCS / "annotated" / f"{name}.md").read_text()
        for rel, _ in gen_pages.annotated_parts(qualnames):
            doc = ast.get_docstring(ast.parse((ROOT / "src/minicb" / rel).read_text())) or ""
            last = [ln.strip() for ln in doc.strip().splitlines() if ln.strip()][-1]
            assert last in page, (name, rel, last)          # the docstring's last line: not cut short


def test_names_are_found_wherever_they_are_defined_and_a_missing_one_stops_the_generator(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core/a.py").write_text("class Scheduler:\n    def _make_plan(self):\n        pass\n")
    (pkg / "core/b.py").write_text("def pack():\n    pass\n")
    assert gen_pages.definition_file("Scheduler._make_plan", pkg) == "core/a.py"
    (pkg / "core/a.py").write_text("")                  # the method moves to another module
    (pkg / "core/c.py").write_text("class Scheduler:\n    def _make_plan(self):\n        pass\n")
    assert gen_pages.definition_file("Scheduler._make_plan", pkg) == "core/c.py"
    with pytest.raises(ValueError, match="no module"):
        gen_pages.definition_file("Scheduler.gone", pkg)
    (pkg / "core/d.py").write_text("def pack():\n    pass\n")
    with pytest.raises(ValueError, match="several modules"):
        gen_pages.definition_file("pack", pkg)
    assert gen_pages.definition_file("core/d.py:pack", pkg) == "core/d.py"
    for _, _, _, _, qualnames in gen_pages.ANNOTATED:       # the real pages' names all resolve
        assert gen_pages.annotated_parts(qualnames)


def test_rest_literal_blocks_become_fenced_code():
    doc = "Which victim::\n\n    a  b\n      c\n\nAfter.\nPlain ::\n\n    x\n\n::\n\n    y\nNo block::\nend"
    assert rest_literal.rest_to_markdown(doc) == (
        "Which victim:\n\n```text\na  b\n  c\n```\n\nAfter.\nPlain\n\n```text\nx\n```\n\n```text\ny\n```"
        "\n\nNo block::\nend")
