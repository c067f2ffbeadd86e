"""Pictures and the replay read at the size they are shown, measured in headless Chromium on the built
site at 1280 px (a laptop) and 390 px (a phone):

* every SVG picture that fits the column (all of the 688 px ones at 1280 px) is shown at its native
  size, its smallest text at least 11 px as displayed; a wider one (any on a 390 px phone) is scaled
  to the column, whole, and linked to its file to read at full size (tests/docs/test_mobile.py
  checks the link and that no page scrolls sideways);
* every SVG text has 4.5:1 contrast (WCAG AA) with what it is drawn on: the SVG is opened on its own,
  and under the middle of each text the browser's hit test finds the shape it sits on;
* every piece of text of the replay player is at least 11 px and has 4.5:1 contrast with its
  background.

The colours are measured, not taken from the code: a colour written into a picture or a style sheet by
hand is caught as well as one chosen by ``trace.text_colour``.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import site_check  # noqa: E402
from preconditions import unavailable  # noqa: E402

WIDTHS = (1280, 390)
MIN_PX, MIN_CONTRAST = 11.0, 4.5

# every SVG <img> of the page: its shown and natural width, and the font sizes and viewBox of its file
PICTURES = """(async () => Promise.all([...document.querySelectorAll('img')]
  .filter(i => i.getAttribute('src').endsWith('.svg')).map(async i => {
    const doc = new DOMParser().parseFromString(await (await fetch(i.src)).text(), 'image/svg+xml');
    const sizes = [...doc.querySelectorAll('text')].map(t => parseFloat(
      (t.getAttribute('style') || '').match(/font-size:\\s*([0-9.]+)px/)?.[1] || 'NaN'));
    return {src: i.getAttribute('src'), shown: i.getBoundingClientRect().width,
            column: i.closest('article').getBoundingClientRect().width,
            natural: i.naturalWidth, viewbox: doc.documentElement.viewBox.baseVal.width, sizes};
  })))()"""

# an SVG opened on its own: each text's colour and the paint of the shape under its middle
UNDER_TEXT = """(() => {
  const paint = e => { const s = getComputedStyle(e);
    return {fill: s.fill, alpha: parseFloat(s.opacity) * parseFloat(s.fillOpacity)}; };
  return [...document.querySelectorAll('text')].map(t => {
    const r = t.getBoundingClientRect(), x = r.left + r.width / 2, y = r.top + r.height / 2;
    const below = document.elementsFromPoint(x, y).filter(e => !e.closest('text') && e.tagName !== 'svg')
      .map(paint).filter(p => p.fill.startsWith('rgb'));
    return {text: t.textContent, fill: getComputedStyle(t).fill, below};
  });
})()"""

# the replay player: every element with text of its own, its font size, colour and background
REPLAY_TEXT = """(() => {
  const bg = e => { for (; e; e = e.parentElement) { const c = getComputedStyle(e).backgroundColor;
    if (!/rgba\\(.*, 0\\)$/.test(c) && c !== 'transparent') return c; } return 'rgb(255, 255, 255)'; };
  return [...document.querySelectorAll('[data-minicb-replay] *')]
    .filter(e => [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()))
    .filter(e => e.getClientRects().length)
    .map(e => ({text: e.textContent.trim().slice(0, 40), cls: e.className,
                px: parseFloat(getComputedStyle(e).fontSize), color: getComputedStyle(e).color,
                bg: bg(e), opacity: parseFloat(getComputedStyle(e).opacity)}));
})()"""


def _rgb(css: str) -> tuple[float, ...]:
    parts = [float(v) for v in css[css.index("(") + 1:css.index(")")].replace("/", ",").split(",")]
    return tuple(parts[:3]) + ((parts[3],) if len(parts) > 3 else (1.0,))


def _luminance(rgb) -> float:
    def ch(v: float) -> float:
        v /= 255
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4
    return 0.2126 * ch(rgb[0]) + 0.7152 * ch(rgb[1]) + 0.0722 * ch(rgb[2])


def _over(top, alpha: float, bottom=(255.0, 255.0, 255.0)):
    return tuple(alpha * t + (1 - alpha) * b for t, b in zip(top[:3], bottom))


def contrast(a, b) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_contrast_is_the_wcag_ratio():
    assert round(contrast((0, 0, 0), (255, 255, 255)), 1) == 21.0
    assert contrast((255, 255, 255), (255, 255, 255)) == 1.0
    assert 4.4 < contrast((119, 119, 119), (255, 255, 255)) < 4.5      # #777 on white just fails
    assert _over((0, 0, 0), 0.5) == (127.5, 127.5, 127.5)


@pytest.fixture(scope="module")
def browser():
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed (make setup installs it with apt-get)")
    with site_check.Chromium(binary) as b:
        yield b


def _pages_with_pictures(site: pathlib.Path) -> list[str]:
    out = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(errors="replace")
        if '.svg"' in text and "<img" in text and "/api/" not in page.as_posix():
            rel = page.relative_to(site).as_posix()
            if any(f'src="{p}' in text for p in ("images/", "../images/", "../../images/")):
                out.append(rel)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_pictures_are_shown_at_native_size_with_text_of_11px_or_fit_a_phone(site, browser, width):
    pages = _pages_with_pictures(site)
    assert "index.html" in pages and len(pages) >= 5
    small, shrunk, seen = [], [], set()
    with site_check.serve(site) as base:
        for page in pages:
            with browser.tab(base + page, width=width, height=900) as tab:
                for pic in tab.evaluate(PICTURES):
                    seen.add(pic["src"].rsplit("/", 1)[-1])
                    assert pic["sizes"] and all(s == s for s in pic["sizes"]), f"{pic['src']}: text as paths?"
                    if pic["column"] < pic["natural"]:  # wider than the column: whole, scaled to it
                        if pic["shown"] > pic["column"] + 1:
                            shrunk.append(f"{page}: {pic['src']} {pic['shown']:.0f} px in "
                                          f"{pic['column']:.0f}")
                        continue
                    if pic["shown"] < pic["natural"] - 1:
                        shrunk.append(f"{page}: {pic['src']} shown {pic['shown']:.0f} px of {pic['natural']}")
                    px = min(pic["sizes"]) * pic["shown"] / pic["viewbox"]
                    if px < MIN_PX:
                        small.append(f"{page}: {pic['src']}: smallest text {px:.1f} px")
    assert not shrunk, shrunk
    assert not small, small
    assert {"static-vs-continuous.svg", "policies.svg", "ragged-mask.svg", "block-tables.svg",
            "prefix-tree.svg"} <= seen


@pytest.mark.slow
def test_picture_text_contrasts_with_what_it_sits_on(site, browser):
    low = []
    pictures = sorted((site / "images").glob("*.svg"))
    assert len(pictures) >= 6
    with site_check.serve(site) as base:
        for svg in pictures:
            with browser.tab(base + f"images/{svg.name}", width=1600, height=1000) as tab:
                texts = tab.evaluate(UNDER_TEXT)
            assert texts, svg.name
            for t in texts:
                colour = _over(_rgb(t["fill"]), _rgb(t["fill"])[3])
                under = (255.0, 255.0, 255.0)
                for p in reversed(t["below"]):             # composite the shapes, bottom first
                    rgb = _rgb(p["fill"])
                    under = _over(rgb, p["alpha"] * rgb[3], under)
                ratio = contrast(colour, under)
                if ratio < MIN_CONTRAST:
                    low.append(f"{svg.name}: {t['text']!r} {ratio:.2f}:1 ({t['fill']} on {under})")
    assert not low, low


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_replay_text_is_11px_and_contrasts(site, browser, width):
    bad = []
    with site_check.serve(site) as base:
        for step in (4, 7, 16):
            with browser.tab(base + f"replay/?step={step}", width=width, height=900) as tab:
                items = tab.evaluate(REPLAY_TEXT)
                assert tab.evaluate("document.documentElement.scrollWidth") <= width
            assert len(items) > 50
            for it in items:
                ratio = contrast(_over(_rgb(it["color"]), _rgb(it["color"])[3] * it["opacity"],
                                       _rgb(it["bg"])), _rgb(it["bg"]))
                if it["px"] < MIN_PX or ratio < MIN_CONTRAST:
                    bad.append(json.dumps({**it, "ratio": round(ratio, 2), "step": step}))
    assert not bad, bad
