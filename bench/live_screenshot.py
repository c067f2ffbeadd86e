"""A screenshot of the live page of a running ``minicb serve`` under load: many concurrent streams
(completions and chats that share a system prompt, so the prefix cache has blocks to show), headless
Chromium at 1280 x 800, taken once the slot grid holds ``--columns`` steps.

::

    python -m minicb serve --max-num-seqs 256 --port 8131 &
    python bench/live_screenshot.py --url http://127.0.0.1:8131 --clients 320 \\
        --out docs/images/screenshot-live-256.png

Needs Chromium (``make browser``). It prints what the page showed when the picture was taken.
"""

from __future__ import annotations

import argparse
import base64
import json
import pathlib
import random
import sys
import threading
import time

import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import site_check  # noqa: E402

SHOWN = """JSON.stringify({status: document.getElementById("status").textContent,
  step: parseInt(document.getElementById("step").textContent),
  running: parseInt(document.getElementById("running").textContent),
  waiting: parseInt(document.getElementById("waiting").textContent),
  kv: document.getElementById("kv").textContent, tps: document.getElementById("tps").textContent,
  pool: document.getElementById("poolnote").textContent})"""

SYSTEM = "You are a patient teacher. Answer in two or three plain sentences, without lists. " * 3
TOPICS = ["tides", "rainbows", "volcanoes", "bread", "magnets", "bees", "glaciers", "clocks", "bridges",
          "comets", "coral", "wind", "ink", "salt", "owls", "moss", "fog", "sand", "maps", "kites"]


def clients(url: str, n: int, model: str, stop: threading.Event) -> list[threading.Thread]:
    def run(k: int) -> None:
        rng = random.Random(k)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        while not stop.is_set():
            topic = rng.choice(TOPICS)
            if k % 2:
                messages = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"Why do {topic} matter?"}]
                s = c.chat.completions.create(model=model, stream=True, max_tokens=rng.randrange(40, 160),
                                              messages=messages)
            else:
                prompt = f"A short story about {topic}, told by a child:" * rng.randrange(1, 4)
                s = c.completions.create(model=model, stream=True, max_tokens=rng.randrange(40, 160),
                                         prompt=prompt)
            try:
                for _ in s:
                    if stop.is_set():
                        break
            finally:
                s.close()

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=320)
    ap.add_argument("--columns", type=int, default=60, help="steps drawn before the picture (of 96)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default="docs/images/screenshot-live-256.png")
    args = ap.parse_args()
    model = openai.OpenAI(base_url=args.url + "/v1", api_key="unused").models.list().data[0].id
    binary = site_check.find_chromium()
    if binary is None:
        sys.exit("chromium is not installed (make browser)")
    stop = threading.Event()
    threads = clients(args.url, args.clients, model, stop)
    try:
        with site_check.Chromium(binary, timeout=120) as browser:
            target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.call("Target.attachToTarget",
                                   {"targetId": target, "flatten": True})["sessionId"]
            browser.call("Page.enable", session=session)
            browser.call("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 800,
                                                                "deviceScaleFactor": 1, "mobile": False},
                         session=session)
            browser.call("Page.navigate", {"url": args.url + "/"}, session=session)
            browser.wait_event("Page.loadEventFired", session, 60)
            first, deadline = None, time.monotonic() + args.timeout
            while True:
                reply = browser.call("Runtime.evaluate", {"expression": SHOWN, "returnByValue": True},
                                     session=session)
                facts = json.loads(reply["result"]["value"])
                first = facts["step"] if first is None and facts["step"] > 0 else first
                if first is not None and facts["step"] - first >= args.columns and facts["waiting"] > 0:
                    break
                if time.monotonic() > deadline:
                    print("timed out; taking the picture anyway", file=sys.stderr)
                    break
                time.sleep(1)
            shot = browser.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
    finally:
        stop.set()
    pathlib.Path(args.out).write_bytes(base64.b64decode(shot))
    print(json.dumps({k: facts[k] for k in ("step", "running", "waiting", "kv", "tps", "pool")}))
    print(f"wrote {args.out} ({args.clients} clients)")
    del threads


if __name__ == "__main__":
    main()
