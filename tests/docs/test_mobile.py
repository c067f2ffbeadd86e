"""The site and the live page on a phone: at 390 px the home page, chapter 00, an annotated page, the
replay and the server's live page (256 slots) never scroll sideways (the page itself:
``document.documentElement.scrollWidth <= innerWidth``); every SVG picture fits the column and links to
its file at full size; identifiers in tables break only after ``.``, ``_`` or ``/``.

``python tests/docs/test_mobile.py SITE_DIR OUT_DIR`` saves screenshots of the five pages at 390 and
1280 px (the ones in ``docs/images/mobile/``; the site built with ``mkdocs build --site-dir SITE_DIR``).
"""

from __future__ import annotations

import pathlib
import sys
import threading

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "docs"))
import hooks  # noqa: E402

import site_check  # noqa: E402
from preconditions import unavailable  # noqa: E402

sys.path.pop(0)

PHONE, LAPTOP = 390, 1280
PAGES = {"home": "", "chapter-00": "tutorials/00_why_batch/",
         "annotated": "annotated/continuous_schedule/", "replay": "replay/#step=10"}
SHOT_AT = {"home": "article img[src$='.svg']", "chapter-00": "article img[src$='roofline.svg']",
           "replay": "[data-minicb-replay]"}
FITS = "[document.documentElement.scrollWidth, innerWidth]"
PICTURES = """[...document.querySelectorAll('article img')]
  .filter(i => i.getAttribute('src').endsWith('.svg'))
  .map(i => ({src: i.getAttribute('src'), right: i.getBoundingClientRect().right,
              column: i.closest('article').getBoundingClientRect().right,
              link: i.closest('a') && i.closest('a').getAttribute('href'),
              open: [...i.closest('p').querySelectorAll('.svg-open a')].map(a => a.getAttribute('href'))}))"""


def _browser():
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed: `make browser` installs it (apt-get, as root)")
    return site_check.Chromium(binary)


def test_table_identifiers_break_after_dots_and_underscores_only():
    html = ('<table><tr><td><code>BlockManager.can_allocate</code></td><td><code>a&amp;b</code></td>'
            '<td><code>docs/x.md</code></td></tr></table><p><code>not_in.a_table</code></p>')
    out = hooks.fit_narrow(html)
    assert "<code>BlockManager.<wbr>can_<wbr>allocate</code>" in out
    assert "<code>a&amp;b</code>" in out and "<code>docs/<wbr>x.<wbr>md</code>" in out
    assert "<code>not_in.a_table</code>" in out                    # outside tables: left alone


def test_svg_pictures_link_to_their_full_size_file():
    out = hooks.fit_narrow('<p><img alt="a" src="../images/x.svg" /></p>'
                           '<p><a href="big.svg"><img src="big.svg"></a></p><img src="y.png">')
    assert out.count('<a class="svg-full" href="../images/x.svg"><img') == 1
    assert out.count('class="svg-open"><a href="../images/x.svg"') == 1
    assert '<a href="big.svg"><img src="big.svg"></a><span class="svg-open">' in out   # linked already
    assert '<img src="y.png">' in out and out.count("svg-open") == 2


@pytest.mark.slow
def test_the_site_fits_a_phone(site):
    wide, shrunk_wrong = [], []
    with _browser() as browser, site_check.serve(site) as base:
        for name, page in PAGES.items():
            with browser.tab(base + page, width=PHONE, height=844) as tab:
                scroll, inner = tab.evaluate(FITS)
                if scroll > inner:
                    wide.append(f"{name}: {scroll} px wide in a {inner} px window")
                for pic in tab.evaluate(PICTURES):
                    if pic["right"] > pic["column"] + 1 or pic["link"] != pic["src"] \
                            or pic["open"] != [pic["src"]]:
                        shrunk_wrong.append((name, pic))
                assert tab.errors() == [], (name, tab.errors())
    assert not wide, wide
    assert not shrunk_wrong, shrunk_wrong
    # the home page and chapter 00 have pictures; all of them were checked
    assert "static-vs-continuous.svg" in (site / "index.html").read_text()
    assert "roofline.svg" in (site / "tutorials/00_why_batch/index.html").read_text()


def _live_server(tmp_path):
    from serve_helpers import MODEL, client, running_server
    from tiny_files import write_gguf

    gguf = write_gguf(tmp_path / "tiny.gguf")
    return MODEL, client, running_server(gguf, max_num_seqs=256, num_blocks=1024, block_size=4,
                                         max_num_batched_tokens=512)


LIVE_GRID = """(() => { const g = document.getElementById('grid').getBoundingClientRect(),
  b = document.getElementById('slotsbox').getBoundingClientRect();
  return [g.right, b.right, document.getElementById('status').textContent,
          window.minicbLive.rows().length]; })()"""


@pytest.mark.slow
def test_the_live_page_fits_a_phone(tmp_path):
    """256 slots on a 390 px screen: the page does not scroll sideways, and the slot grid (the newest
    steps that fit) ends inside its box, so the latest step is in view."""
    with _browser() as browser:
        model, client, server = _live_server(tmp_path)
        with server as (_, url):
            c = client(url)
            for k in range(3):
                c.completions.create(model=model, prompt=[5 + k] * 9, max_tokens=6, temperature=0)
            with browser.tab(url + "/", width=PHONE, height=844, settle=2.0) as tab:
                scroll, inner = tab.evaluate(FITS)
                grid_right, box_right, status, rows = tab.evaluate(LIVE_GRID)
                errors = tab.errors()
    assert status == "live" and rows > 0, (status, rows)
    assert scroll <= inner, f"the live page is {scroll} px wide in a {inner} px window"
    assert grid_right <= box_right + 1, (grid_right, box_right)
    assert errors == [], errors


def screenshots(site: pathlib.Path, out_dir: pathlib.Path, tmp: pathlib.Path) -> list[pathlib.Path]:
    """The five pages at 390 and 1280 px as PNGs (palette-reduced, to keep them small)."""
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def shoot(tab, name: str) -> None:
        path = out_dir / f"{name}.png"
        tab.screenshot(path)
        Image.open(path).convert("RGB").quantize(colors=64).save(path, optimize=True)
        paths.append(path)

    with _browser() as browser:
        with site_check.serve(site) as base:
            for name, page in PAGES.items():
                for width, height in ((PHONE, 844), (LAPTOP, 800)):
                    with browser.tab(base + page, width=width, height=height) as tab:
                        target = SHOT_AT.get(name)
                        if target:           # scroll to what the page is about on a phone
                            tab.evaluate(f"window.scrollTo(0, document.querySelector({target!r})"
                                         ".getBoundingClientRect().top + scrollY - 70)")
                            tab.wait(0.5)
                        shoot(tab, f"{name}-{width}")
        model, client, server = _live_server(tmp)
        with server as (_, url):
            stop = threading.Event()

            def load(k: int) -> None:
                cl = client(url)
                while not stop.is_set():
                    cl.completions.create(model=model, prompt=[7 + k] * (4 + k % 9), max_tokens=40,
                                          temperature=0, extra_body={"ignore_eos": True})

            threads = [threading.Thread(target=load, args=(k,)) for k in range(40)]
            for t in threads:
                t.start()
            try:
                for width, height in ((PHONE, 844), (LAPTOP, 800)):
                    with browser.tab(url + "/", width=width, height=height, settle=4.0) as tab:
                        shoot(tab, f"live-{width}")
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=120)
    return paths


if __name__ == "__main__":
    import tempfile

    if len(sys.argv) != 3:
        sys.exit("usage: python tests/docs/test_mobile.py SITE_DIR OUT_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        for p in screenshots(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(tmp)):
            print(f"wrote {p} ({p.stat().st_size // 1024} KiB)")
