"""The step-through replay: the recorder (``minicb.measure.replay``) keeps what the step events say, the
committed recording is the one the code makes now, the replay page's claims hold for it, and the
widget (``docs/assets/replay/replay.js``) shows in headless Chromium exactly the recorded occupancy."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

from minicb.core.sampling_params import SamplingParams
from minicb.engine.arrivals import Arrival, drive
from minicb.measure import replay
from minicb.measure.trace import build_engine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import site_check  # noqa: E402
from preconditions import unavailable  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "assets" / "replay" / "data.js"
PAGE = ROOT / "docs" / "replay.md"


@pytest.fixture(scope="module")
def committed() -> dict:
    return replay.from_js(DATA.read_text())


def _record(policy: str, **config) -> tuple[dict, object]:
    engine = build_engine("tiny", policy=policy, max_num_seqs=2, block_size=4, **config)
    rec = replay.ReplayRecorder().attach(engine)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    drive(engine, [Arrival(6 * i, f"q{i}", [5 + i] * (3 + 2 * i), params) for i in range(3)])
    return rec.to_json(), engine


def test_recorder_keeps_every_step_with_consistent_state():
    data, engine = _record("continuous", num_blocks=8, max_num_batched_tokens=4)
    json.dumps(data)                                           # plain JSON values only
    frames, cfg = data["frames"], data["config"]
    assert [f["step"] for f in frames] == list(range(engine.stats.num_steps))   # idle steps too
    assert any(not f["seqs"] for f in frames)                  # q0 is done before q1 arrives at step 6
    for f in frames:
        st, bs = f["state"], cfg["block_size"]
        for s in f["seqs"]:
            assert st["slots"][s["slot"]] == s["id"] and st["block_tables"][s["id"]] == s["table"]
            positions = range(s["start"], s["start"] + s["n"])
            assert s["kv_slots"] == [s["table"][p // bs] * bs + p % bs for p in positions]
        held = [b for t in st["block_tables"].values() for b in t]
        assert sorted(held + st["free_blocks"]) == list(range(cfg["num_blocks"]))   # blocks conserved
        assert f["cu_seqlens_q"][-1] == sum(s["n"] for s in f["seqs"])
        for rid in f["finished"]:
            assert rid not in f["after"]["slots"] and rid not in f["after"]["block_tables"]
    assert sorted(r for f in frames for r in f["finished"]) == ["q0", "q1", "q2"]
    assert data["requests"] == ["q0", "q1", "q2"] and len(set(data["colours"].values())) == 3


def test_recorder_sees_padding_of_the_padded_policies():
    data, _ = _record("static", num_blocks=16)
    assert sum(sum(f["padding"]) for f in data["frames"]) > 0
    assert data["config"]["policy"] == "static"


def test_committed_recording_is_what_the_code_records_now(committed):
    assert replay.demo() == committed, "run: make docs-pages (or python -m minicb.measure.replay)"


def test_the_replay_page_says_what_the_recording_shows(committed):
    """Every step the page points to, and the run it describes, checked against the recording."""
    fr, cfg, text = committed["frames"], committed["config"], PAGE.read_text()
    reqs = replay.DEMO_REQUESTS
    assert len(reqs) == 8 and max(t for t, _, _ in reqs) == 12 and "Eight requests" in text
    assert (min(p for _, p, _ in reqs), max(p for _, p, _ in reqs)) == (3, 19) and "3 to 19 tokens" in text
    assert (min(o for *_, o in reqs), max(o for *_, o in reqs)) == (5, 16) and "5 to 16 output" in text
    assert (cfg["num_slots"], cfg["max_num_batched_tokens"], cfg["long_prefill_chunk"], cfg["num_blocks"],
            cfg["block_size"], cfg["num_host_blocks"]) == (4, 16, 8, 14, 4, 16)
    assert cfg["num_blocks"] * cfg["block_size"] == 56 and max(p + o for _, p, o in reqs) == 25
    assert "(56 token positions, for requests that need up to 25 each)" in " ".join(text.split())
    rows = lambda k: {s["id"]: (s["kind"], s["start"], s["n"]) for s in fr[k]["seqs"]}   # noqa: E731
    # step 2: three decodes beside r3's first 8-token chunk; its last 3 tokens at step 4
    assert sum(s["kind"] == "decode" for s in fr[2]["seqs"]) == 3 and rows(2)["r3"] == ("chunk", 0, 8)
    assert rows(3)["r3"] == ("chunk", 8, 8) and rows(4)["r3"] == ("prefill", 16, 3)
    # step 4: r4 waits, no free block
    assert "r4" in fr[4]["state"]["waiting"] and fr[4]["state"]["free_blocks"] == []
    # step 6: the newest running request, r3, swapped out with its 5 blocks; r4 still waits, a slot free
    assert fr[6]["preempted"] == ["r3"] and len(fr[6]["swap_out"]) == 5
    assert fr[6]["state"]["swapped"] == ["r3"] and "r4" in fr[6]["state"]["waiting"]
    assert None in fr[6]["state"]["slots"]
    # steps 9-11: r1 finishes, r3 back in r1's slot (the lowest free one), out again
    assert "r1" in fr[9]["finished"] and fr[10]["swap_in"] and rows(10)["r3"][0] == "decode"
    assert fr[10]["state"]["slots"].index("r3") == fr[9]["state"]["slots"].index("r1")
    assert fr[11]["preempted"] == ["r3"]
    # step 14: r0 finished at 13; r3 swapped in and r4 admitted
    assert "r0" in fr[13]["finished"] and fr[14]["swap_in"] and {"r3", "r4"} <= set(rows(14))
    # step 17: r2, r3 finished at 16; r5 and r6 chunked beside r4's decode: 1 + 8 + 7
    assert {"r2", "r3"} <= set(fr[16]["finished"]) and fr[17]["state"]["slots"].count(None) == 1
    assert rows(17) == {"r4": ("decode", 7, 1), "r5": ("chunk", 0, 8), "r6": ("chunk", 0, 7)}
    for k in (2, 4, 6, 10, 11, 14, 17):
        assert f"?step={k})" in text



SLOTS = "[...document.querySelectorAll('[data-slot]')].map(c => c.dataset.request || null)"
BLOCKS = "[...document.querySelectorAll('[data-block]')].map(c => c.dataset.owner || null)"
LABEL = "document.querySelector('.mr-label').textContent"


def _owners(frame: dict, num_blocks: int) -> list:
    owner = [None] * num_blocks
    for rid, table in frame["state"]["block_tables"].items():
        for b in table:
            owner[b] = rid
    return owner


@pytest.mark.slow
def test_replay_widget_in_headless_chromium(site, committed):
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed (make setup installs it with apt-get)")
    fr, nb = committed["frames"], committed["config"]["num_blocks"]
    assert (site / "assets/replay/replay.js").exists() and (site / "assets/replay/data.js").exists()
    with site_check.Chromium(binary) as browser, site_check.serve(site) as base:
        with browser.tab(base + "replay/#step=7") as tab:
            assert tab.evaluate(SLOTS) == fr[7]["state"]["slots"]          # the recorded occupancy
            assert tab.evaluate(BLOCKS) == _owners(fr[7], nb)
            tokens = tab.evaluate("[...document.querySelectorAll('[data-token]')].map(t => t.dataset.token)")
            assert tokens == [f"{s['id']}:{s['start'] + k}" for s in fr[7]["seqs"] for k in range(s["n"])]
            assert tab.evaluate(LABEL) == f"step 7 of {len(fr) - 1}"
            tab.evaluate("document.querySelector('.mr-next').click()")     # step forward
            assert tab.evaluate("location.hash") == "#step=8"
            assert tab.evaluate(SLOTS) == fr[8]["state"]["slots"]
            queue = ("[...document.querySelectorAll('[data-queue=swapped] [data-request]')]"
                     ".map(c => c.dataset.request)")
            assert tab.evaluate(queue) == fr[8]["state"]["swapped"] == ["r3"]
            tab.evaluate("(s => { s.value = '14'; s.dispatchEvent(new Event('input')); })"
                         "(document.querySelector('.mr-slider'))")           # the slider
            assert tab.evaluate(SLOTS) == fr[14]["state"]["slots"]
            assert tab.evaluate("location.hash") == "#step=14"
            tab.evaluate("document.querySelector('.mr-play').click()")       # play advances by itself
            tab.wait(2.0)
            playing = int(re.match(r"step (\d+)", tab.evaluate(LABEL)).group(1))
            assert playing > 14 and tab.evaluate(SLOTS) == fr[playing]["state"]["slots"]
            assert tab.errors() == []
        with browser.tab(base + "replay/?step=6") as tab:                 # the page's own step links
            assert tab.evaluate(SLOTS) == fr[6]["state"]["slots"] and None in fr[6]["state"]["slots"]
            assert tab.evaluate(BLOCKS) == _owners(fr[6], nb)
            host = "[...document.querySelectorAll('[data-host-block]')].map(c => c.dataset.owner || null)"
            assert tab.evaluate(host)[:5] == ["r3"] * 5
            assert tab.errors() == []
