"""The live page in headless Chromium while requests run: it shows the slots of at least two running
requests (the ids the clients were given), their KV blocks and a token rate, with no script error.

The screenshot is kept as a test artefact, ``build/artefacts/live-page.png``; with
``MINICB_UPDATE_DOCS_IMAGES=1`` it also replaces ``docs/images/live-page.png`` (the docs' picture).
Chromium is driven over its DevTools pipe by ``site_check.Chromium`` (as tests/docs/test_docs.py does),
started before the server's threads.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import random
import shutil
import threading
import time

import pytest

import site_check
from preconditions import unavailable
from serve_helpers import MODEL, client, running_server
from tiny_files import write_gguf

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTEFACT = ROOT / "build" / "artefacts" / "live-page.png"
DOCS_IMAGE = ROOT / "docs" / "images" / "live-page.png"

pytestmark = pytest.mark.slow

# the slot grid is a canvas: its rows come from the page's data, and ``painted`` checks the pixels: the
# middle of every decode cell has the colour of the request the hover's hit test names there
FACTS = """JSON.stringify({
  title: document.title,
  status: document.getElementById("status").textContent,
  slotRids: window.minicbLive.rows().map(r => r[1]),
  kinds: [...new Set(window.minicbLive.rows().map(r => r[2]))],
  labels: [...document.querySelectorAll("#slots .slotlabel")].map(l => l.title),
  ...(() => {
    const live = window.minicbLive, g = live.geom(), grid = document.getElementById("grid");
    if (!g) return {checked: 0, painted: 0};                  // before the first frame
    const dpr = window.devicePixelRatio || 1;
    const px = grid.getContext("2d").getImageData(0, 0, grid.width, grid.height);
    const probe = document.createElement("canvas").getContext("2d");
    const rgb = css => { probe.fillStyle = css; probe.fillRect(0, 0, 1, 1);
                         return [...probe.getImageData(0, 0, 1, 1).data]; };
    let checked = 0, painted = 0;
    for (let y = g.row / 2; y < grid.height / dpr; y += g.row + 1)
      for (let x = g.cell / 2; x < grid.width / dpr; x += g.cell + 1) {
        const r = live.cellAt(x, y);
        if (!r || r[2] !== "decode") continue;
        const k = 4 * (Math.floor(y * dpr) * grid.width + Math.floor(x * dpr)), want = rgb(live.colour(r[1]));
        checked++;
        painted += [0, 1, 2].every(c => Math.abs(px.data[k + c] - want[c]) <= 2);
      }
    return {checked, painted};
  })(),
  blockRids: [...document.querySelectorAll("#blocks .blk[data-rid]")].map(b => b.dataset.rid),
  numBlocks: document.querySelectorAll("#blocks .blk").length,
  tps: parseFloat(document.getElementById("tps").textContent),
  step: parseInt(document.getElementById("step").textContent),
})"""


class Clients:
    """``n`` client threads, each sending streaming requests one after another until ``stop()``."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.ids, self._stop = url, set(), threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        rng, c = random.Random(k), client(self.url)
        while not self._stop.is_set():
            prompt = [rng.randrange(4, 260) for _ in range(rng.randrange(8, 60))]
            stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=rng.randrange(30, 120),
                                          temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                self.ids.add(chunk.id)
                if self._stop.is_set():
                    stream.close()
                    break

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=30)


def console_errors(browser, session: str) -> list[str]:
    errors = []
    for e in browser.events:
        p = e.get("params", {})
        if e.get("sessionId") != session:
            continue
        if e.get("method") == "Runtime.exceptionThrown":
            errors.append(str(p["exceptionDetails"].get("text")))
        elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append(str(p.get("args")))
        elif e.get("method") == "Log.entryAdded" and p["entry"].get("level") == "error":
            errors.append(p["entry"].get("text", ""))
    return errors


def test_the_live_page_shows_the_slots_of_running_requests(tmp_path):
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed (make setup installs it with apt-get)")
    gguf = write_gguf(tmp_path / "tiny.gguf")
    with site_check.Chromium(binary) as browser, \
            running_server(gguf, max_num_seqs=4, num_blocks=96, block_size=4, max_num_batched_tokens=32) \
            as (_, url):
        clients = Clients(url, 6)                      # 6 clients, 4 slots: there is always a queue
        try:
            target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.call("Target.attachToTarget",
                                   {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                browser.call(f"{domain}.enable", session=session)
            browser.call("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 760,
                                                                "deviceScaleFactor": 1, "mobile": False},
                         session=session)
            browser.call("Page.navigate", {"url": url + "/"}, session=session)
            # load-independent: a hang guard (the page loads in well under a second)
            assert browser.wait_event("Page.loadEventFired", session, 120)
            # Polls until the page shows a full window; the deadline only ends a wait that would never
            # end (Chromium and six streams share a busy machine's cores): ready is usually met in seconds
            deadline = time.monotonic() + 240
            while True:
                reply = browser.call("Runtime.evaluate", {"expression": FACTS, "returnByValue": True},
                                     session=session)
                facts = json.loads(reply["result"]["value"])
                ready = (len(set(facts["slotRids"])) >= 3 and facts["blockRids"] and facts["tps"] > 0
                         and facts["step"] >= 160)          # a full window: slots have changed hands
                if ready or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            shot = browser.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
            errors = console_errors(browser, session)
        finally:
            clients.stop()
    ARTEFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTEFACT.write_bytes(base64.b64decode(shot))
    if os.environ.get("MINICB_UPDATE_DOCS_IMAGES"):
        shutil.copyfile(ARTEFACT, DOCS_IMAGE)
    assert errors == []
    assert facts["title"] == "minicb serve: live" and facts["status"] == "live"
    shown = set(facts["slotRids"])
    assert len(shown) >= 2 and shown <= clients.ids, (shown, clients.ids)   # real requests, >= 2 of them
    assert "decode" in facts["kinds"]
    assert facts["checked"] > 0 and facts["painted"] == facts["checked"], facts
    assert sum(any(r in label for r in clients.ids) for label in facts["labels"]) >= 2   # slot holders
    assert len(facts["labels"]) == 4 and facts["numBlocks"] == 96
    # load-independent: read once the page was ready (polled above with a hang guard, not a fixed wait)
    assert set(facts["blockRids"]) <= clients.ids and facts["tps"] > 0
    assert ARTEFACT.stat().st_size > 10_000
