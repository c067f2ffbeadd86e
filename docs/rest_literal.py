"""reST literal blocks as Markdown code blocks, for every page that shows a docstring.

minicb's docstrings introduce a picture or a piece of code the reST way: a paragraph ending in ``::``
and an indented block after it::

    Which victim::                          Which victim:

        running, most important first  ->   ```text
                                            running, most important first
                                            ```

Markdown would show the ``::`` as written and (depending on the renderer) the block as code or as a
paragraph with its spaces lost. ``rest_to_markdown`` follows reST's own rule: ``text::`` becomes
``text:``, ``text ::`` and a lone ``::`` disappear, and the indented lines after it (up to the first
line indented no deeper than the paragraph) become one fenced block, dedented.

Used by ``docs/gen_pages.py`` (chapter introductions, annotated pages) and, as a griffe extension
(``RestLiteralBlocks``, named in ``mkdocs.yml``), by the API pages that mkdocstrings renders.
"""

from __future__ import annotations

import textwrap

try:                                         # the API pages' hook; gen_pages works without griffe
    from griffe import Extension
except ImportError:                          # pragma: no cover - griffe comes with mkdocstrings
    Extension = object


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def rest_to_markdown(doc: str, lang: str = "text") -> str:
    """``doc`` with every reST literal block (``::`` then an indented block) as a fenced code block."""
    lines = doc.split("\n")
    out: list[str] = []
    fence = "```"
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if not stripped.endswith("::") or stripped.lstrip().startswith((">>>", "#")):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= base:
            out.append(line)                 # no indented block follows: not a literal block
            i += 1
            continue
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        while end > j and not lines[end - 1].strip():
            end -= 1
        text = stripped[:-2]
        if text.strip():
            out.append(text.rstrip() if text.endswith(" ") else text + ":")
            out.append("")
        block = textwrap.dedent("\n".join(lines[j:end]))
        pad = " " * base
        out += [pad + fence + lang, *[(pad + b) if b.strip() else "" for b in block.split("\n")], pad + fence]
        i = end
        if i < len(lines) and lines[i].strip():
            out.append("")
    return "\n".join(out)


class RestLiteralBlocks(Extension):
    """A griffe extension: every docstring griffe loads for mkdocstrings gets ``rest_to_markdown``."""

    def on_instance(self, *, obj, **kwargs) -> None:   # griffe calls it for each module, class, function
        if obj.docstring is not None and "::" in obj.docstring.value:
            obj.docstring.value = rest_to_markdown(obj.docstring.value)
