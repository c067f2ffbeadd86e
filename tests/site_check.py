"""Checks of the built documentation site (``site/``), used by tests/docs/test_docs.py.

* ``broken_links(site)``: every internal ``href`` / ``src`` of every page must name a file of the site
  (and an element id, for ``#fragment`` links); nothing may be loaded from the network (the site must
  work offline: no CDN scripts, fonts or images).
* ``serve(site)``: the site over HTTP on 127.0.0.1 (a free port), in a thread.
* ``Chromium``: headless Chromium driven through the DevTools protocol on a pipe
  (``--remote-debugging-pipe``: no port, no websocket library). ``open(url)`` loads a page and returns
  its headings, its images' load state and every console error, uncaught exception and failed load;
  ``tab(url)`` keeps a loaded page open for scripted checks (``evaluate``, ``screenshot``).
* ``python tests/site_check.py screenshots SITE OUT_DIR``: PNG screenshots of the home page, a chapter
  and the replay (what ``docs/images/screenshot-*.png`` are).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import pathlib
import select
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from html.parser import HTMLParser

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")


# --- links ------------------------------------------------------------------------------------------
class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str, str]] = []     # (tag, attribute, value)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs) -> None:
        for name, val in attrs:
            if val is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(val)
            if name in ("href", "src") or (name == "srcset" and tag in ("img", "source")):
                self.refs.append((tag, name, val))


@functools.cache
def _parse(path: pathlib.Path) -> _Refs:
    p = _Refs()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    return p


def broken_links(site: pathlib.Path) -> list[str]:
    """Problems found in the built HTML: missing targets, missing anchors, resources from the network."""
    site = site.resolve()
    problems = []
    for page in sorted(site.rglob("*.html")):
        rel_page = page.relative_to(site).as_posix()
        for tag, attr, value in _parse(page).refs:
            url = urllib.parse.urlsplit(value.split()[0] if attr == "srcset" else value)
            if url.scheme in ("http", "https") or value.startswith("//"):
                if not (tag == "a" and attr == "href"):      # links out are fine; loading from out is not
                    problems.append(f"{rel_page}: <{tag} {attr}> loads {value!r} from the network")
                continue
            if url.scheme or not (url.path or url.fragment):
                continue                                       # mailto:, data:, javascript:, ""
            path = urllib.parse.unquote(url.path)
            base = site if path.startswith("/") else page.parent     # absolute: from the site's root
            target = (base / path.lstrip("/")).resolve() if path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_relative_to(site) or not target.exists():
                problems.append(f"{rel_page}: <{tag} {attr}={value!r}> points to a missing file")
                continue
            if url.fragment and target.suffix == ".html" and url.fragment not in _parse(target).ids:
                problems.append(f"{rel_page}: <{tag} {attr}={value!r}>: no id {url.fragment!r} in "
                                f"{target.relative_to(site).as_posix()}")
    return problems


# --- serving ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve(site: pathlib.Path):
    """Serve ``site`` on 127.0.0.1; yields the base URL (``http://127.0.0.1:PORT/``)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- the browser ------------------------------------------------------------------------------------
def find_chromium() -> str | None:
    for name in CHROMIUM_CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageReport:
    url: str
    title: str = ""
    headings: list[tuple[str, str]] = field(default_factory=list)    # (tag, text) of h1..h3
    images: list[tuple[str, bool]] = field(default_factory=list)     # (src, loaded)
    errors: list[str] = field(default_factory=list)        # console errors, exceptions, failed loads


class Chromium:
    """Headless Chromium over the DevTools protocol on fds 3 (commands in) and 4 (replies out)."""

    def __init__(self, binary: str, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="minicb-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:                     # in the child: the protocol pipe must be fds 3 and 4
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        args = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--disable-default-apps", "--no-first-run", "--mute-audio",
                "--no-default-browser-check", f"--user-data-dir={self._tmp.name}",
                "--remote-debugging-pipe", "about:blank"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=fds, pass_fds=(3, 4))
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []

    # protocol plumbing
    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        return self._next_id

    def _read(self, deadline: float) -> dict | None:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                chunk = os.read(self._from_child, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe (did it crash?)")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send a command and wait for its reply; events that arrive meanwhile are kept."""
        mid = self._send(method, params, session)
        deadline = time.monotonic() + self.timeout
        while True:
            msg = self._read(deadline)
            if msg is None:
                raise TimeoutError(f"no reply to {method} within {self.timeout} s")
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, session: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events:
                if e.get("method") == method and e.get("sessionId") == session:
                    return True
            msg = self._read(deadline)
            if msg is None:
                return False
            self.events.append(msg)

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (msg := self._read(deadline)) is not None:
            self.events.append(msg)

    # what the tests use
    def open(self, url: str, settle: float = 1.0) -> PageReport:
        """Load ``url`` in a fresh tab; report its headings, images and every error it produced."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=session)
        self.events = [e for e in self.events if e.get("sessionId") != session]
        self.call("Page.navigate", {"url": url}, session=session)
        if not self.wait_event("Page.loadEventFired", session, self.timeout):
            raise TimeoutError(f"{url} did not finish loading within {self.timeout} s")
        self.drain(settle)                     # late errors: scripts run after load, workers start
        report = PageReport(url)
        expr = """JSON.stringify({
            title: document.title,
            headings: [...document.querySelectorAll('article h1, article h2, article h3')]
                .map(h => [h.tagName.toLowerCase(), h.textContent.replace(/\\u00b6$/, '').trim()]),
            images: [...document.images].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])
        })"""
        value = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True},
                          session=session)["result"]["value"]
        data = json.loads(value)
        report.title = data["title"]
        report.headings = [tuple(h) for h in data["headings"]]
        report.images = [tuple(i) for i in data["images"]]
        for e in self.events:
            if e.get("sessionId") != session:
                continue
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                what = d.get("exception", {}).get("description") or d.get("text")
                report.errors.append(f"exception: {what}")
            elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                report.errors.append(f"console.{p['type']}: {args}")
            elif e.get("method") == "Log.entryAdded" and p["entry"].get("level") == "error":
                entry = p["entry"]
                report.errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
        self.call("Target.closeTarget", {"targetId": target})
        return report

    @contextlib.contextmanager
    def tab(self, url: str, width: int = 1280, height: int = 900, settle: float = 1.0):
        """``url`` loaded in a fresh tab of the given viewport, for scripted checks: yields a ``Tab``
        (``evaluate``, ``screenshot``, ``errors``); the tab is closed on leaving."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            for domain in ("Runtime", "Log", "Page"):
                self.call(f"{domain}.enable", session=session)
            self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": False},
                      session=session)
            self.events = [e for e in self.events if e.get("sessionId") != session]
            self.call("Page.navigate", {"url": url}, session=session)
            if not self.wait_event("Page.loadEventFired", session, self.timeout):
                raise TimeoutError(f"{url} did not finish loading within {self.timeout} s")
            self.drain(settle)
            yield Tab(self, session)
        finally:
            self.call("Target.closeTarget", {"targetId": target})

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._send("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._tmp.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Tab:
    """One loaded page of a ``Chromium`` (``Chromium.tab``)."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser, self.session = browser, session

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able values come back as Python)."""
        reply = self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                       "awaitPromise": True}, session=self.session)
        if "exceptionDetails" in reply:
            d = reply["exceptionDetails"]
            raise RuntimeError(d.get("exception", {}).get("description") or d.get("text"))
        return reply["result"].get("value")

    def wait(self, seconds: float) -> None:
        self.browser.drain(seconds)

    def screenshot(self, path: str | os.PathLike, full_page: bool = False) -> None:
        """Save a PNG of the viewport (or of the whole page)."""
        import base64

        params: dict = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            size = self.evaluate("[document.documentElement.scrollWidth, "
                                 "document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        data = self.browser.call("Page.captureScreenshot", params, session=self.session)["data"]
        pathlib.Path(path).write_bytes(base64.b64decode(data))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads of this tab so far."""
        out = []
        for e in self.browser.events:
            if e.get("sessionId") != self.session:
                continue
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description", "")))
                                                              for a in p.get("args", [])))
            elif e.get("method") == "Log.entryAdded" and p["entry"].get("level") == "error":
                entry = p["entry"]
                out.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
        return out


# --- screenshots ------------------------------------------------------------------------------------
SCREENSHOTS = {   # file: (page, element to scroll to, or None for the top)
    "screenshot-home.png": ("", None),
    "screenshot-home-table.png": ("", "article table"),        # the benchmark table, caveats
    "screenshot-chapter.png": ("tutorials/01_static_batching/", None),
    "screenshot-home-timeline.png": ("", "article img[src$='.svg']"),   # static vs continuous, one axis
    "screenshot-replay.png": ("replay/#step=4", "[data-minicb-replay]"),  # r4 waits (no slot); 2, 3 shared
    "screenshot-annotated.png": ("annotated/continuous_schedule/", "h2:nth-of-type(2)"),
    "screenshot-roofline.png": ("tutorials/00_why_batch/", "img[src$='roofline.svg']"),
    "screenshot-exercise.png": ("exercises/", "h2#what-a-checker-says"),    # a checker's verdict
}


def screenshots(site: pathlib.Path, out_dir: pathlib.Path, width: int = 1280, height: int = 1000) -> list:
    """Screenshots of the built ``site``'s pages in ``SCREENSHOTS`` into ``out_dir``; returns the paths.
    Raises if a page logs an error."""
    binary = find_chromium()
    if binary is None:
        raise RuntimeError("chromium is not installed")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with Chromium(binary) as browser, serve(site) as base:
        for name, (page, target) in SCREENSHOTS.items():
            with browser.tab(base + page, width=width, height=height) as tab:
                if target:                      # scroll down to it (never up: no "back to top" button)
                    tab.evaluate(f"window.scrollTo(0, document.querySelector({target!r})"
                                 ".getBoundingClientRect().top + window.scrollY - 70)")
                    tab.wait(0.5)
                errors = tab.errors()
                if errors:
                    raise RuntimeError(f"{page}: {errors}")
                tab.screenshot(out_dir / name)
                paths.append(out_dir / name)
    return paths


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "screenshots":
        sys.exit("usage: python tests/site_check.py screenshots SITE_DIR OUT_DIR")
    for path in screenshots(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])):
        print(f"wrote {path}")
