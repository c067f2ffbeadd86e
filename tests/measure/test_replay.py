"""The step-through replay: the recorder (``minicb.measure.replay``) keeps what the step events say, rows
are classified by one rule (``minicb.core.plan.row_kind``) on its three edge cases, waiting requests get
their reason, shared blocks their ref counts, victims their former blocks; the committed recording is
the one the code makes now, the replay page's claims hold for it, and the player
(``src/minicb/measure/replay_web/replay.js``) shows in headless Chromium exactly the recorded state,
on the site and as the self-contained page ``minicb trace --replay`` writes."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from minicb.core.plan import DECODE, PREFILL, row_kind
from minicb.core.sampling_params import SamplingParams
from minicb.engine.arrivals import Arrival, drive
from minicb.entrypoints.cli import main
from minicb.measure import replay
from minicb.measure.trace import TraceRecorder, build_engine, contrast_ratio

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
        held = {b for t in st["block_tables"].values() for b in t}
        assert sorted(held) + [] == sorted(set(range(cfg["num_blocks"])) - set(st["free_blocks"]))
        assert f["cu_seqlens_q"][-1] == sum(s["n"] for s in f["seqs"])
        for rid in f["finished"]:
            assert rid not in f["after"]["slots"] and rid not in f["after"]["block_tables"]
    assert sorted(r for f in frames for r in f["finished"]) == ["q0", "q1", "q2"]
    assert data["requests"] == ["q0", "q1", "q2"] and len(set(data["colours"].values())) == 3


def test_recorder_sees_padding_of_the_padded_policies():
    data, _ = _record("static", num_blocks=16)
    assert sum(sum(f["padding"]) for f in data["frames"]) > 0
    assert data["config"]["policy"] == "static"


# --- one rule for prefill vs decode -------------------------------------------------------------------
def test_row_kind_is_decided_by_where_the_row_starts():
    assert row_kind(0, 8, 9) == PREFILL and row_kind(8, 1, 9) == PREFILL     # a one-token last chunk
    assert row_kind(9, 1, 9) == DECODE and row_kind(20, 1, 9) == DECODE
    assert row_kind(0, 1, 5) == PREFILL and row_kind(3, 1, 5) == PREFILL     # one-token grants
    assert row_kind(12, 3, 9) == PREFILL                                     # a recompute re-feed


def _kinds(policy="continuous", prompts=((9, 0),), **config):
    """Run ``prompts`` ((length, arrival step) per request, token ids per request i: 5 + i, or the
    shared list when ``config`` says so) and return ``{request: [(start, n, kind), ...]}`` from the
    replay and the same from the slot trace, with the engine."""
    shared = config.pop("same_prompt", False)
    engine = build_engine("tiny", policy=policy, block_size=4, **config)
    rec = replay.ReplayRecorder().attach(engine)
    tr = TraceRecorder(engine.config.max_num_seqs, skip_empty=False).attach(engine)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    drive(engine, [Arrival(t, f"q{i}", [7 if shared else 5 + i] * n, params)
                   for i, (n, t) in enumerate(prompts)])
    rows: dict = {}
    for f in rec.to_json()["frames"]:
        for s in f["seqs"]:
            kind = PREFILL if s["kind"] in ("chunk", "prefill") else s["kind"]
            rows.setdefault(s["id"], []).append((s["start"], s["n"], kind))
    cells: dict = {}
    for step in tr.trace.cells:
        for c in step:
            if c.busy:
                cells.setdefault(c.request_id, []).append((c.num_tokens, c.kind))
    for rid, seen in rows.items():      # the trace says the same as the replay, row by row
        assert cells[rid] == [(n, k) for _, n, k in seen], rid
    return rows, engine


def test_a_one_token_last_chunk_is_a_prefill():
    rows, _ = _kinds(prompts=((9, 0),), long_prefill_chunk=8)
    assert rows["q0"] == [(0, 8, PREFILL), (8, 1, PREFILL), (9, 1, DECODE), (10, 1, DECODE)]


def test_a_one_token_remainder_after_a_prefix_hit_is_a_prefill():
    rows, engine = _kinds(prompts=((9, 0), (9, 4)), enable_prefix_caching=True, same_prompt=True)
    assert rows["q0"][0] == (0, 9, PREFILL)
    assert rows["q1"][0] == (8, 1, PREFILL)       # 2 blocks hit (capped below 9): one token left
    assert rows["q1"][1] == (9, 1, DECODE)


def test_a_one_token_budget_grant_is_a_prefill():
    # three one-token prompts take 3 of the 4 tokens; q3's 5-token prompt gets 1 token a step
    rows, _ = _kinds(prompts=((1, 0), (1, 0), (1, 0), (5, 0)), max_num_seqs=4, max_num_batched_tokens=4)
    assert rows["q3"][:3] == [(0, 1, PREFILL), (1, 1, PREFILL), (2, 1, PREFILL)]
    assert [k for s, _, k in rows["q3"] if s >= 5] and all(k == DECODE for s, _, k in rows["q3"] if s >= 5)
    assert all(k == PREFILL for s, _, k in rows["q3"] if s < 5)


# --- why a request waits, shared blocks, victims -----------------------------------------------------
def test_waiting_for_the_budget_with_a_slot_free():
    engine = build_engine("tiny", max_num_seqs=2, block_size=4, max_num_batched_tokens=4, num_blocks=16)
    rec = replay.ReplayRecorder().attach(engine)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    drive(engine, [Arrival(0, "a", [5] * 8, params), Arrival(0, "b", [6] * 3, params)])
    f0 = rec.frames[0]
    assert [s["id"] for s in f0["seqs"]] == ["a"] and f0["state"]["slots"].count(None) == 1
    assert f0["waiting"] == {"b": ["no budget", "the step's 4 tokens are spent"]} and f0["budget_left"] == 0


def test_waiting_reasons_of_the_docs_run(committed):
    fr = committed["frames"]
    why = lambda k: {r: w[0] for r, w in fr[k]["waiting"].items()}          # noqa: E731
    # every waiting request of every step has a reason, and only they
    assert all(set(f["waiting"]) == set(f["state"]["waiting"]) for f in fr)
    assert why(4) == {"r4": "no slot"} and None not in fr[4]["state"]["slots"]
    assert why(10)["r4"] == "no blocks" and fr[10]["state"]["free_blocks"] == []
    assert why(10)["r5"] == "behind r4"
    assert set(why(12).values()) == {"swap pending"} and fr[12]["state"]["swapped"] == ["r3"]
    assert why(7)["r3"] == "no blocks" and fr[7]["preempted"] == ["r3"]


def test_ref_counts_cache_and_victims_of_the_docs_run(committed):
    fr = committed["frames"]
    for f in fr:
        for st in (f["state"], f["after"]):
            count = {}
            for t in st["block_tables"].values():
                for b in t:
                    count[b] = count.get(b, 0) + 1
            assert st["refs"] == {str(b): n for b, n in count.items() if n > 1}
        for rid, v in f["victims"].items():
            prev = fr[f["step"] - 1]["after"]["block_tables"][rid]
            assert v["blocks"] == prev and rid not in f["state"]["block_tables"]
            assert v["mode"] == ("swap" if rid in f["state"]["swapped"] else "recompute")
    st = fr[4]["state"]          # r3 arrived with r1's system prompt: its two blocks are shared
    assert st["refs"] == {"2": 2, "3": 2}
    assert st["block_tables"]["r1"][:2] == st["block_tables"]["r3"][:2] == [2, 3]
    assert {2, 3} <= set(st["cached"])
    # r3 holds shared blocks, so it is recomputed, not swapped (the block manager's rule)
    assert fr[7]["victims"] == {"r3": {"mode": "recompute", "blocks": [2, 3, 7, 8, 11, 12]}}


def test_request_colours_and_their_text_reach_4_5_to_1(committed):
    for rid, colour in committed["colours"].items():
        assert contrast_ratio(colour, committed["text_colours"][rid]) >= 4.5, rid


def test_committed_recording_is_what_the_code_records_now(committed):
    assert replay.demo() == committed, "run: make docs-pages (or python -m minicb.measure.replay)"


def test_the_replay_page_says_what_the_recording_shows(committed):
    """Every step the page points to, and the run it describes, checked against the recording."""
    fr, cfg, text = committed["frames"], committed["config"], " ".join(PAGE.read_text().split())
    reqs = replay.DEMO_REQUESTS
    assert len(reqs) == 8 and max(t for t, *_ in reqs) == 12 and "Eight requests" in text
    assert (min(p for _, p, *_ in reqs), max(p for _, p, *_ in reqs)) == (3, 19) and "3 to 19 tokens" in text
    assert (min(r[2] for r in reqs), max(r[2] for r in reqs)) == (5, 16) and "5 to 16 output" in text
    assert sum(r[3] for r in reqs) == 4 and len(replay.DEMO_SYSTEM) == 8 and "four of them begin" in text
    assert (cfg["num_slots"], cfg["max_num_batched_tokens"], cfg["long_prefill_chunk"], cfg["num_blocks"],
            cfg["block_size"], cfg["num_host_blocks"], cfg["prefix_caching"]) == (4, 16, 8, 14, 4, 16, True)
    assert cfg["num_blocks"] * cfg["block_size"] == 56 and max(p + o for _, p, o, _ in reqs) == 25
    assert "(56 token positions, for requests that need up to 25 each)" in text
    rows = lambda k: {s["id"]: (s["kind"], s["start"], s["n"]) for s in fr[k]["seqs"]}   # noqa: E731
    why = lambda k: {r: w[0] for r, w in fr[k]["waiting"].items()}                       # noqa: E731
    # step 2: r3's chunk starts at 8 after a hit on r1's blocks 2, 3, beside three decodes
    assert rows(2)["r3"] == ("chunk", 8, 8) and sum(s["kind"] == "decode" for s in fr[2]["seqs"]) == 3
    assert fr[2]["state"]["refs"] == {"2": 2, "3": 2} and rows(3)["r3"] == ("prefill", 16, 3)
    # step 4: r4 waits for a slot while 2 and 3 are shared
    assert why(4) == {"r4": "no slot"} and fr[4]["state"]["refs"] == {"2": 2, "3": 2}
    # step 7: r3 recomputed (it holds shared blocks), its 6 former blocks; two go to others at once
    v = fr[7]["victims"]["r3"]
    assert v["mode"] == "recompute" and len(v["blocks"]) == 6 and v["blocks"][:2] == [2, 3]
    held = {b for t in fr[7]["state"]["block_tables"].values() for b in t}
    assert set(fr[7]["state"]["block_tables"]["r1"][:2]) == {2, 3} and len(held & set(v["blocks"][2:])) == 2
    assert set(why(7).values()) == {"no blocks"}
    # step 10: r1 finished at 9; r3 back from the front, positions 16-22 recomputed; r4 no blocks
    assert "r1" in fr[9]["finished"] and fr[9]["state"]["waiting"][0] == "r3"
    assert rows(10)["r3"] == ("recompute", 16, 7) and why(10) == {"r4": "no blocks", "r5": "behind r4",
                                                              "r6": "behind r4"}
    # step 11: swapped this time; step 12: swap pending
    assert fr[11]["victims"]["r3"]["mode"] == "swap" and fr[11]["state"]["refs"] == {}
    assert set(why(12).values()) == {"swap pending"}
    # step 14: r3 swapped in, decodes its last token; r4 hits two of its blocks; 1 + 1 + 2 + 8 tokens
    assert fr[14]["swap_in"] and len(fr[14]["swap_in"]) == 6 and "r3" in fr[14]["finished"]
    assert rows(14) == {"r2": ("decode", 16, 1), "r3": ("decode", 23, 1), "r4": ("prefill", 8, 2),
                        "r5": ("chunk", 0, 8)} and why(14) == {"r6": "no slot", "r7": "no slot"}
    swapped_in = {dst for _, dst in fr[14]["swap_in"]}
    assert fr[14]["state"]["block_tables"]["r3"] and set(fr[14]["state"]["block_tables"]["r3"]) == swapped_in
    shared = fr[14]["state"]["block_tables"]["r4"][:2]
    assert shared == [10, 8] and set(shared) <= swapped_in and fr[14]["state"]["refs"] == {"10": 2, "8": 2}
    assert "(10 and 8, now `×2`)" in text and "(1 + 1 + 2 + 8 = 12 tokens)" in text
    # step 15: r6 hits the same blocks; r5's one-token prefill at position 8 of 9; r4 decodes
    assert fr[15]["state"]["block_tables"]["r6"][:2] == shared and rows(15)["r6"] == ("prefill", 8, 6)
    r5 = next(s for s in fr[15]["seqs"] if s["id"] == "r5")
    assert (r5["kind"], r5["start"], r5["n"], r5["prompt"]) == ("prefill", 8, 1, 9)
    assert rows(15)["r4"] == ("decode", 10, 1) and "position 8 of 9" in text
    # step 17: r2 finished at 16, r7 takes its slot with its whole 3-token prompt; only decodes after
    assert "r2" in fr[16]["finished"] and rows(17)["r7"] == ("prefill", 0, 3)
    assert all(s["kind"] == "decode" for f in fr[18:] for s in f["seqs"])
    for k in (2, 4, 7, 10, 11, 12, 14, 15, 17):
        assert f"?step={k})" in text


REPLAY_JS = ROOT / "src/minicb/measure/replay_web/replay.js"


def _row_texts(rows: list[dict]) -> list[str]:
    """What the player's ``rowText`` says for each recorded row (run with node, no browser)."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        unavailable("node is not installed (the player's wording is checked with it or in Chromium)")
    script = ("global.window = {}; global.document = {readyState: 'complete', querySelectorAll: () => []};"
              f"require({json.dumps(str(REPLAY_JS))});"
              f"console.log(JSON.stringify({json.dumps(rows)}.map(window.MinicbReplay.rowText)));")
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _recompute_words(start: int, n: int, num_prompt: int) -> str:
    last = start + n - 1
    pos = f"position {start}" if n == 1 else f"positions {start}–{last}"
    words = f"recompute, {pos}: prompt 0–{num_prompt - 1}"
    if last >= num_prompt:
        words += ", generated " + (str(num_prompt) if last == num_prompt else f"{num_prompt}–{last}")
    return words


def test_rows_after_a_recompute_preemption_are_worded_as_recompute():
    """A real run (tiny model) whose pool is too small: a request is preempted by recompute, and the
    rows that compute its tokens again are ``recompute`` rows, worded with the part of the prompt and
    the generated tokens they cover; every other row keeps ``row_kind``'s word."""
    engine = build_engine("tiny", policy="continuous", max_num_seqs=3, block_size=4, num_blocks=7,
                          max_num_batched_tokens=32, preemption_mode="recompute", enable_prefix_caching=False)
    rec = replay.ReplayRecorder().attach(engine)
    prompts = {f"q{i}": [7 + i] * (5 + 3 * i) for i in range(3)}
    drive(engine, [Arrival(0, rid, p, SamplingParams(max_tokens=8, ignore_eos=True))
                   for rid, p in prompts.items()])
    frames = rec.to_json()["frames"]
    preempted_at = {rid: f["step"] for f in frames for rid, v in f["victims"].items()
                    if v["mode"] == "recompute"}
    assert preempted_at, "the pool was meant to force a recompute preemption"
    rows, expected = [], []
    for f in frames:
        for s in f["seqs"]:
            num_prompt = len(prompts[s["id"]])
            assert s["prompt"] == num_prompt
            again = s["id"] in preempted_at and f["step"] > preempted_at[s["id"]] and s["start"] == 0
            if again:        # no prefix cache: it starts over, prompt and generated tokens in one go
                assert s["kind"] == "recompute" and s["start"] + s["n"] > num_prompt, s
                expected.append(_recompute_words(s["start"], s["n"], num_prompt))
            else:
                kind = row_kind(s["start"], s["n"], num_prompt)
                assert s["kind"] in ((DECODE,) if kind == DECODE else ("prefill", "chunk")), s
                expected.append(None)
            rows.append(s)
    said = _row_texts(rows)
    checked = [(w, e) for w, e in zip(said, expected, strict=True) if e is not None]
    assert checked and all(w == e for w, e in checked), checked
    assert not any(w.startswith("recompute") for w, e in zip(said, expected) if e is None)


SLOTS = "[...document.querySelectorAll('[data-slot]')].map(c => c.dataset.request || null)"
BLOCKS = "[...document.querySelectorAll('[data-block]')].map(c => c.dataset.owner || null)"
LABEL = "document.querySelector('.mr-label').textContent"


def _owners(frame: dict, num_blocks: int) -> list:
    owner: list = [[] for _ in range(num_blocks)]
    for rid in sorted(frame["state"]["block_tables"]):
        for b in frame["state"]["block_tables"][rid]:
            owner[b].append(rid)
    return [" ".join(o) or None for o in owner]


STRIP = ("[...document.querySelectorAll('[data-strip-slot]')].map(c => [+c.dataset.stripSlot, "
         "+c.dataset.stripStep, c.dataset.request || null, c.dataset.kind, c.classList.contains('mr-now')])")
WAITING = ("Object.fromEntries([...document.querySelectorAll('[data-waiting]')]"
           ".map(c => [c.dataset.waiting, c.dataset.reason]))")


def _strip(frames: list, num_slots: int, now: int) -> list:
    """The strip the player must draw: every (slot, step), its holder and what it computed."""
    out = []
    for slot in range(num_slots):
        for f in frames:
            rid = f["state"]["slots"][slot]
            row = next((s for s in f["seqs"] if s["slot"] == slot), None)
            kind = "free" if rid is None else row["kind"] if row else "held"
            out.append([slot, f["step"], rid, kind, f["step"] == now])
    return out


@pytest.mark.slow
def test_replay_widget_in_headless_chromium(site, committed):
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed (make setup installs it with apt-get)")
    fr, nb, ns = committed["frames"], committed["config"]["num_blocks"], committed["config"]["num_slots"]
    assert (site / "assets/replay/replay.js").exists() and (site / "assets/replay/data.js").exists()
    with site_check.Chromium(binary) as browser, site_check.serve(site) as base:
        with browser.tab(base + "replay/#step=4") as tab:
            assert tab.evaluate(SLOTS) == fr[4]["state"]["slots"]          # the recorded occupancy
            assert tab.evaluate(BLOCKS) == _owners(fr[4], nb)
            tokens = tab.evaluate("[...document.querySelectorAll('[data-token]')].map(t => t.dataset.token)")
            assert tokens == [f"{s['id']}:{s['start'] + k}" for s in fr[4]["seqs"] for k in range(s["n"])]
            assert tab.evaluate(LABEL) == f"step 4 of {len(fr) - 1}"
            assert tab.evaluate(STRIP) == _strip(fr, ns, 4)                # the strip, step 4 framed
            assert tab.evaluate(WAITING) == {"r4": "no slot"}              # the reason beside the request
            refs = tab.evaluate("[...document.querySelectorAll('[data-block]')].map(c => +c.dataset.refs)")
            assert [refs[2], refs[3]] == [2, 2] and refs.count(2) == 2
            cached = tab.evaluate("[...document.querySelectorAll('[data-block][data-cached]')]"
                                  ".map(c => +c.dataset.block)")
            assert cached == fr[4]["state"]["cached"]
            tab.evaluate("document.querySelector('.mr-next').click()")     # step forward
            assert tab.evaluate("location.hash") == "#step=5"
            assert tab.evaluate(SLOTS) == fr[5]["state"]["slots"]
            tab.evaluate("document.querySelector('[data-strip-slot=\"0\"][data-strip-step=\"12\"]').click()")
            assert tab.evaluate("location.hash") == "#step=12"             # a click on the strip
            queue = ("[...document.querySelectorAll('[data-queue=swapped] [data-request]')]"
                     ".map(c => c.dataset.request)")
            assert tab.evaluate(queue) == fr[12]["state"]["swapped"] == ["r3"]
            assert set(tab.evaluate(WAITING).values()) == {"swap pending"}
            tab.evaluate("(s => { s.value = '14'; s.dispatchEvent(new Event('input')); })"
                         "(document.querySelector('.mr-slider'))")           # the slider
            assert tab.evaluate(SLOTS) == fr[14]["state"]["slots"]
            assert tab.evaluate("location.hash") == "#step=14"
            tab.evaluate("document.querySelector('.mr-play').click()")       # play advances by itself
            # Polled until it has, not read after a fixed wait (a busy machine slows the page's timer);
            # the label and the slots in one evaluation, so both are of the same step.
            deadline = time.monotonic() + 60                                 # a hang guard
            while True:
                label, slots = tab.evaluate(f"[{LABEL}, {SLOTS}]")
                playing = int(re.match(r"step (\d+)", label).group(1))
                if playing > 14 or time.monotonic() > deadline:
                    break
                tab.wait(0.1)
            # load-independent: polled with a hang guard, not a fixed wait
            assert playing > 14 and slots == fr[playing]["state"]["slots"]
            assert tab.errors() == []
        with browser.tab(base + "replay/?step=7") as tab:                 # the page's own step links
            assert tab.evaluate(BLOCKS) == _owners(fr[7], nb)
            former = tab.evaluate("[...document.querySelectorAll('[data-block][data-former]')]"
                                  ".map(c => [+c.dataset.block, c.dataset.former])")
            assert former == [[b, "r3"] for b in sorted(fr[7]["victims"]["r3"]["blocks"])]
            kinds = tab.evaluate("[...document.querySelectorAll('[data-row-kind]')]"
                                 ".map(c => c.dataset.rowKind)")
            by_slot = {s["slot"]: s["kind"] for s in fr[7]["seqs"]}
            assert kinds == [by_slot.get(i, "") for i in range(ns)]
            assert tab.errors() == []
        with browser.tab(base + "replay/?step=10") as tab:                # the recompute row's words
            r3 = next(s for s in fr[10]["seqs"] if s["id"] == "r3")
            words = tab.evaluate(f"document.querySelector('[data-slot=\"{r3['slot']}\"]')"
                                 ".parentElement.querySelector('.mr-what').textContent")
            num_prompt = replay.DEMO_REQUESTS[3][1]
            assert words == _recompute_words(r3["start"], r3["n"], num_prompt) \
                == "recompute, positions 16–22: prompt 0–18, generated 19–22"
            assert words.replace("–", "-") in " ".join(PAGE.read_text().split()).replace("–", "-")
        with browser.tab(base + "replay/?step=7") as tab:                 # every former block shows its mark
            said = int(re.search(r"Its (\d+) former blocks have a dashed red border",
                                 PAGE.read_text()).group(1))
            dashed = tab.evaluate("[...document.querySelectorAll('[data-block]')].filter(c => {"
                                  " const s = getComputedStyle(c); return s.borderTopStyle === 'dashed'"
                                  " && s.outlineStyle === 'none'; }).length")
            assert dashed == said == len(fr[7]["victims"]["r3"]["blocks"])
        with browser.tab(base + "replay/?step=14") as tab:                # the swap's ring, in the legend
            moved = tab.evaluate("[...document.querySelectorAll('[data-block]')].filter(c =>"
                                 " getComputedStyle(c).outlineStyle === 'solid').map(c => +c.dataset.block)")
            assert sorted(moved) == sorted(dst for _, dst in fr[14]["swap_in"])
            notes = tab.evaluate("[...document.querySelectorAll('.mr-note')]"
                                 ".map(n => n.textContent).join(' ')")
            assert "solid red ring: copied in from the host by a swap" in notes
            assert "dashed red border" in notes and "framed inside: written" in notes
        with browser.tab(base + "replay/?step=11") as tab:
            host = "[...document.querySelectorAll('[data-host-block]')].map(c => c.dataset.owner || null)"
            assert tab.evaluate(host)[:6] == ["r3"] * 6
        with browser.tab(base + "replay/?step=16", width=390, height=900) as tab:   # a phone
            assert tab.evaluate("document.documentElement.scrollWidth") <= 390
            assert tab.evaluate("(() => { const r = document.querySelector('[data-minicb-replay]')"
                                ".getBoundingClientRect(); return r.right; })()") <= 390
            assert tab.evaluate(STRIP) == _strip(fr, ns, 16)
            assert tab.errors() == []


def test_trace_replay_writes_one_offline_page(tmp_path, capsys):
    """``minicb trace --replay``: one HTML file, nothing loaded from anywhere, the recording inside."""
    out = tmp_path / "run.html"
    assert main(["trace", "--num-requests", "5", "--num-blocks", "10", "--max-num-batched-tokens", "12",
                 "--long-prefill-chunk", "6", "--arrival-gap", "1", "--width", "80", "--color", "never",
                 "--replay", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.html"]
    page = out.read_text()
    assert site_check.broken_links(tmp_path) == []                 # no src/href to the network or elsewhere
    assert "<script src" not in page and "<link" not in page and "http" not in page.split("</style>")[0]
    data = replay.from_js(page)
    assert data["config"]["num_blocks"] == 10 and data["config"]["max_num_batched_tokens"] == 12
    assert sorted(r for f in data["frames"] for r in f["finished"]) == [f"r{i}" for i in range(5)]
    assert data["arrivals"] == {f"r{i}": i for i in range(5)}


def test_trace_replay_refuses_a_name_that_is_not_html(tmp_path, capsys):
    assert main(["trace", "--num-requests", "2", "--replay", str(tmp_path / "x.png")]) == 2
    assert "--replay must end in .html" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_trace_replay_page_plays_from_a_file(tmp_path):
    binary = site_check.find_chromium()
    if binary is None:
        unavailable("chromium is not installed (make setup installs it with apt-get)")
    out = tmp_path / "run.html"
    assert main(["trace", "--num-requests", "4", "--num-blocks", "16", "--width", "80", "--color", "never",
                 "--replay", str(out)]) == 0
    data = replay.from_js(out.read_text())
    with site_check.Chromium(binary) as browser, browser.tab(out.as_uri() + "#step=3") as tab:
        assert tab.evaluate(SLOTS) == data["frames"][3]["state"]["slots"]
        assert tab.evaluate(LABEL) == f"step 3 of {len(data['frames']) - 1}"
        assert len(tab.evaluate(STRIP)) == data["config"]["num_slots"] * len(data["frames"])
        assert tab.errors() == []


def test_trace_prompts_records_your_prompts_and_their_text(tmp_path, capsys, smollm2_path):
    """``minicb trace --prompts FILE --replay out.html``: your prompts on SmolLM2, each with the text it
    has generated so far, step by step; the player shows both."""
    prompts = ["The capital of France is", "1, 2, 3,"]
    src = tmp_path / "prompts.txt"
    src.write_text("\n".join(prompts[:1] + [""] + prompts[1:]) + "\n")     # a blank line is skipped
    out = tmp_path / "own.html"
    assert main(["trace", "--prompts", str(src), "--max-tokens", "4", "--width", "80", "--color", "never",
                 "--replay", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    data = replay.from_js(out.read_text())
    assert data["prompts"] == {"r0": prompts[0], "r1": prompts[1]}
    texts: dict[str, list[str]] = {}
    for f in data["frames"]:
        for rid, text in f["text"].items():
            texts.setdefault(rid, []).append(text)
    assert set(texts) == {"r0", "r1"}
    for rid, seen in texts.items():         # the text so far only grows, and something was generated
        assert seen[-1].strip() and all(b.startswith(a) for a, b in zip(seen, seen[1:])), (rid, seen)
    binary = site_check.find_chromium()
    if binary is None:
        return                               # the page's own test below needs a browser
    with site_check.Chromium(binary) as browser, \
            browser.tab(out.as_uri() + f"#step={len(data['frames']) - 1}", width=390) as tab:
        shown = tab.evaluate("Object.fromEntries([...document.querySelectorAll('[data-text]')].map(e =>"
                             " [e.dataset.text, [e.querySelector('.mr-prompt').textContent,"
                             " e.querySelector('.mr-generated').textContent]]))")
        assert shown == {rid: [data["prompts"][rid], texts[rid][-1]] for rid in texts}
        assert tab.evaluate("document.documentElement.scrollWidth") <= 390
        assert tab.errors() == []


def test_trace_prompts_refuses_the_tiny_model_and_an_empty_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["trace", "--prompts", str(empty)]) == 2
    assert "has no prompt" in capsys.readouterr().err
    src = tmp_path / "p.txt"
    src.write_text("hello\n")
    assert main(["trace", "--prompts", str(src), "--model", "tiny"]) == 2
    assert "needs a model with a tokenizer" in capsys.readouterr().err
