"""mkdocs hooks: add the replay player's script and style (``src/minicb/measure/replay_web/``: the
package ships them, so ``minicb trace --replay`` can inline them) to the site under ``assets/replay/``;
pull ``bench/RESULTS.md`` (written by the benchmarks, outside docs/) into the
Benchmarks page at build time, so the page always shows the latest committed results; and make every
page fit a phone (``fit_narrow``): each SVG picture, scaled to the column by
``docs/assets/css/pictures.css``, becomes a link to itself at full size with an "open full size" link
under it, and identifiers in tables may break after a ``.``, ``_`` or ``/`` (a ``<wbr>``) instead of
in the middle of a word.

The page ``benchmarks.md`` holds the line ``<!-- include: bench/RESULTS.md -->``; this hook replaces
it with the file, headings pushed one level down. Files the results link to by a relative path (plots
under ``bench/``) are added to the site under ``bench-files/`` and the links rewritten to them.
"""

from __future__ import annotations

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
REPLAY_WEB = ROOT / "src" / "minicb" / "measure" / "replay_web"
RESULTS = ROOT / "bench" / "RESULTS.md"
MARKER = "<!-- include: bench/RESULTS.md -->"
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _local_targets(text: str) -> list[str]:
    """Relative link targets of the results that are files under bench/."""
    out = []
    for m in LINK.finditer(text):
        target = m.group(2).split("#")[0]
        if target and "://" not in target and not target.startswith(("/", "#", "mailto:")) \
                and (RESULTS.parent / target).is_file():
            out.append(target)
    return out


def on_files(files, config):
    for asset in sorted(REPLAY_WEB.glob("replay.*")):
        files.append(File.generated(config, f"assets/replay/{asset.name}", abs_src_path=str(asset)))
    if RESULTS.exists():
        for target in set(_local_targets(RESULTS.read_text(encoding="utf-8"))):
            files.append(File.generated(config, f"bench-files/{target}",
                                        abs_src_path=str(RESULTS.parent / target)))
    return files


SVG_IMG = re.compile(r'(<a\b[^>]*>\s*)?(<img\b[^>]*\bsrc="([^"]+\.svg)"[^>]*>)(\s*</a>)?')
TABLE = re.compile(r"<table\b.*?</table>", re.S)
TABLE_CODE = re.compile(r"<code>([^<]*)</code>")
BREAK_AFTER = re.compile(r"(?<=[._/])(?=[^\s._/&;])")


def _svg_link(m: re.Match) -> str:
    img, src = m.group(2), m.group(3)
    linked = m.group(0) if m.group(1) and m.group(4) else f'<a class="svg-full" href="{src}">{img}</a>'
    return (f'{linked}<span class="svg-open"><a href="{src}" target="_blank">open full size'
            "</a></span>")


def fit_narrow(html: str) -> str:
    """``html`` with every SVG picture linked to its full-size file and breaks allowed in tables'
    identifiers after ``.``, ``_`` and ``/`` (see the module docstring)."""
    html = SVG_IMG.sub(_svg_link, html)
    return TABLE.sub(lambda t: TABLE_CODE.sub(
        lambda c: "<code>" + BREAK_AFTER.sub("<wbr>", c.group(1)) + "</code>", t.group(0)), html)


def on_page_content(html: str, page, config, files) -> str:
    return fit_narrow(html)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    if not RESULTS.exists():
        text = ("`bench/RESULTS.md` is not in this checkout: the benchmark scripts in `bench/` write it "
                "(see the README), and this page includes it when the site is built.")
    else:
        text = re.sub(r"^(#+) ", r"#\1 ", RESULTS.read_text(encoding="utf-8"), flags=re.M)
        local = set(_local_targets(text))
        text = LINK.sub(lambda m: m.group(1) + (f"bench-files/{m.group(2)}" if m.group(2).split("#")[0]
                                                 in local else m.group(2)) + m.group(3), text)
    return markdown.replace(MARKER, text)
