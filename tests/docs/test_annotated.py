"""The annotated source pages (docs/annotated/, written by ``docs/gen_pages.py``): each is what the
generator makes of the current source, every code block is the file's own lines at the line numbers it
shows, and every page names chapters and tests that exist."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import gen_pages  # noqa: E402

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
    assert blocks >= sum(len(names) for _, names in next(s for s in gen_pages.ANNOTATED
                                                         if s[0] == name)[4])


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
            for name, _, _, _, parts in gen_pages.ANNOTATED
            for rel, names in parts
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
