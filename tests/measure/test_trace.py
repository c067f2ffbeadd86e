"""The slot trace: recorder (exact cells, padding attribution), ASCII and image renderers, CLI."""

from __future__ import annotations

import re

import pytest

from drain import drain
from minicb.core.config import TINY_MODEL, SchedulerConfig
from minicb.core.errors import InvalidArgument, MinicbError
from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import Sequence
from minicb.entrypoints.cli import main
from minicb.measure.trace import (
    DECODE,
    IDLE,
    PADDING,
    PREFILL,
    STALL,
    TraceRecorder,
    make_workload,
    render_ascii,
    render_image,
)
from preconditions import unavailable


def _needs_matplotlib() -> None:
    """matplotlib draws the images: locally its absence skips (with the reason), in CI it fails
    (``make setup`` installs the dev extra), so a skip cannot pass for a drawn image there."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        unavailable("matplotlib is in the plots and dev extras: pip install -e '.[dev]'")


def _seq(rid, slot, n, start, sample=True):
    return ScheduledSeq(rid, slot, tuple([7] * n), start, (0,), sample)


def drive(config: SchedulerConfig, lengths, held=True):
    """Run a scheduler with a fake model (token 5 always); ``lengths``: (prompt, output) per request."""
    sched = Scheduler(config)
    rec = TraceRecorder(config.max_num_seqs, config.policy)
    for i, (p, o) in enumerate(lengths):
        sched.add(Sequence(f"r{i}", [4] * p, SamplingParams(max_tokens=o, ignore_eos=True)))
    sched.close_arrivals()

    def one_step(sched: Scheduler) -> list:
        plan = sched.schedule()
        rec.record(plan, sched.slot_table.held() if held else None)
        return sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample}, 0.0)

    drain(sched, one_step)
    return rec.trace, sched


def test_recorder_exact_cells_for_hand_made_plans():
    rec = TraceRecorder(3)
    rec.record(StepPlan(0, (_seq("a", 0, 3, 0), _seq("b", 2, 1, 9))), prompt_lens={"b": 9})  # b: a decode
    rec.record(StepPlan(1, (_seq("a", 0, 1, 3),)), held={0: "a", 2: "b"})
    rec.record(StepPlan(2))                              # empty plans are skipped
    t = rec.trace
    assert t.num_steps == 2 and t.steps == [0, 1] and t.request_ids == ["a", "b"]
    assert [c.kind for c in t.cells[0]] == [PREFILL, IDLE, DECODE]
    assert [c.kind for c in t.cells[1]] == [DECODE, IDLE, STALL]
    assert t.cells[0][0].num_tokens == 3 and t.cells[1][2].request_id == "b"
    s = t.summary()
    assert (s.busy_slot_steps, s.stall_slot_steps, s.idle_slot_steps, s.real_tokens) == (3, 1, 2, 5)


def test_recorder_rejects_slot_outside_the_table():
    with pytest.raises(InvalidArgument, match="slot_id 5"):
        TraceRecorder(2).record(StepPlan(0, (_seq("a", 5, 1, 0),)))


@pytest.mark.parametrize("policy", ["static", "dynamic"])
@pytest.mark.parametrize("held", [True, False])
def test_padded_policies_padding_lands_on_the_right_slots(policy, held):
    lengths = [(3, 2), (5, 6), (2, 1), (4, 3), (6, 2)]
    trace, sched = drive(SchedulerConfig(max_num_seqs=2, num_blocks=64, block_size=4, policy=policy),
                         lengths, held)
    s = trace.summary()
    assert trace.unattributed_padding == 0
    assert s.padding_tokens == sched.stats.num_padding_tokens > 0
    assert s.real_tokens == sched.stats.num_batched_tokens
    assert s.stall_slot_steps == 0
    # first batch r0 (3+2) and r1 (5+6): step 0 prefill pads r0 by 2; r0 finishes after 2 tokens and
    # pads one token per step until r1's 6th token
    assert trace.cells[0][0].request_id == "r0" and trace.cells[0][0].num_padding == 2
    row0 = [c.kind for c in trace.row(0)[:6]]
    assert row0 == [PREFILL, DECODE, PADDING, PADDING, PADDING, PADDING]
    assert all(c.request_id == "r0" for c in trace.row(0)[:6])
    assert [c.kind for c in trace.row(1)[:6]] == [PREFILL] + [DECODE] * 5


def test_continuous_trace_matches_scheduler_stats_and_refills_slots():
    lengths = [(3, 2), (5, 6), (2, 1), (4, 3), (6, 2)]
    trace, sched = drive(SchedulerConfig(max_num_seqs=2, num_blocks=64, block_size=4), lengths)
    s = trace.summary()
    assert s.padding_tokens == 0 and s.real_tokens == sched.stats.num_batched_tokens
    assert trace.slots_of("r0") == [0] and trace.slots_of("r2") == [0]      # r2 refills r0's slot
    first = {rid: next(t for t, step in enumerate(trace.cells) if any(c.request_id == rid for c in step))
             for rid in trace.request_ids}
    last_r0 = max(t for t, step in enumerate(trace.cells) if step[0].request_id == "r0")
    assert first["r2"] == last_r0 + 1


def test_preempted_request_is_marked_and_may_change_slot():
    cfg = SchedulerConfig(max_num_seqs=3, num_blocks=6, block_size=2, max_num_batched_tokens=16)
    trace, sched = drive(cfg, [(3, 6), (3, 6), (3, 6)])
    assert sched.stats.num_preemptions > 0
    assert sum(len(p) for p in trace.preempted) == sched.stats.num_preemptions
    assert "^" in render_ascii(trace, width=80, colour=False)


def test_render_ascii_exact():
    rec = TraceRecorder(2, "demo")
    rec.record(StepPlan(0, (_seq("a", 0, 3, 0), _seq("b", 1, 2, 0)), padding=(1,)))
    rec.record(StepPlan(1, (_seq("a", 0, 1, 3), _seq("b", 1, 1, 2))))
    rec.record(StepPlan(2, (_seq("b", 1, 1, 3),), padding=(1,)))
    text = render_ascii(rec.trace, width=40, colour=False, legend=False, summary=False)
    assert text.splitlines() == [
        "policy demo: 2 slots x 3 steps",
        "step     0",
        "         012",
        "slot 0  |Aa.|",
        "slot 1  |Bbb|",
    ]
    full = render_ascii(rec.trace, width=80, colour=False)
    assert "legend: A=a, B=b" in full
    assert "tokens computed: 8 real + 2 padding  (padding waste 20.0%)" in full


def test_render_ascii_keeps_every_line_within_the_width():
    """Legend and totals wrap (an item is never split), so a page column of 80 characters holds it."""
    trace, _ = drive(SchedulerConfig(max_num_seqs=3, num_blocks=64, block_size=4),
                     [(3 + i % 5, 2 + i % 7) for i in range(14)])
    for width in (50, 80):
        text = render_ascii(trace, width=width, colour=False)
        assert max(len(line) for line in text.splitlines()) <= width, width
        assert "... (14 requests)" in text and "'^' = a preemption" in text
        assert "(slot utilisation" in text and "(padding waste" in text
    wide = render_ascii(trace, width=300, colour=False).splitlines()
    assert any(ln.startswith("slot-steps:") and "(slot utilisation" in ln for ln in wide)   # one line


def test_render_ascii_wraps_and_colours():
    trace, _ = drive(SchedulerConfig(max_num_seqs=2, num_blocks=64, block_size=4, policy="static"),
                     [(3, 30), (3, 2)])
    text = render_ascii(trace, width=25, colour=False, legend=False, summary=False)
    bands = [ln for ln in text.splitlines() if ln.startswith("slot 0")]
    assert len(bands) == -(-trace.num_steps // 15)                  # 25 - 7 - 3 = 15 steps a band
    assert "".join(b[9:-1] for b in bands) == "A" + "a" * (trace.num_steps - 1)
    coloured = render_ascii(trace, width=25, colour=True)
    assert "\x1b[" in coloured and re.sub(r"\x1b\[[0-9;]*m", "", coloured) == \
        render_ascii(trace, width=25, colour=False)


def test_colour_auto_respects_tty_and_no_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    trace, _ = drive(SchedulerConfig(max_num_seqs=1, num_blocks=8, block_size=4), [(2, 2)])
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert "\x1b[" in render_ascii(trace, stream=Tty())
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in render_ascii(trace, stream=Tty())


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_render_image(tmp_path, ext):
    _needs_matplotlib()
    trace, _ = drive(SchedulerConfig(max_num_seqs=2, num_blocks=64, block_size=4, policy="static"),
                     [(3, 4), (5, 2), (2, 3)])
    a, b = tmp_path / f"a.{ext}", tmp_path / f"b.{ext}"
    render_image(trace, str(a))
    render_image(trace, str(b))
    data = a.read_bytes()
    assert data.startswith(b"\x89PNG") if ext == "png" else b"<svg" in data
    if ext == "svg":
        assert a.read_bytes() == b.read_bytes()           # deterministic: safe to commit under docs/


def test_render_image_errors(tmp_path, monkeypatch):
    trace, _ = drive(SchedulerConfig(max_num_seqs=1, num_blocks=8, block_size=4), [(2, 2)])
    with pytest.raises(InvalidArgument, match=r"\.png or \.svg"):
        render_image(trace, str(tmp_path / "x.jpg"))
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(MinicbError, match="needs matplotlib.*pip install"):
        render_image(trace, str(tmp_path / "x.png"))


def test_make_workload_is_reproducible_and_validated():
    a, b = make_workload(5, 3, 64), make_workload(5, 3, 64)
    assert a == b and len(a.prompts) == 5 and all(4 <= t < 64 for p in a.prompts for t in p)
    assert make_workload(3, 0, 64, arrival_gap=2).arrivals == (0, 2, 4)  # load-independent: steps
    with pytest.raises(InvalidArgument, match="num_requests"):
        make_workload(0, 0, 64)


def test_cli_trace_ascii_and_svg(tmp_path, capsys):
    out = tmp_path / "t.svg"
    assert main(["trace", "--policy", "static", "--num-requests", "5", "--seed", "2", "--max-num-seqs",
                 "2", "--width", "200", "--color", "never", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("policy static: 2 slots x ")
    assert "padding waste" in text and f"wrote {out}" in text and out.read_bytes().startswith(b"<?xml")
    wl = make_workload(5, 2, TINY_MODEL.vocab_size)       # the workload minicb trace --model tiny makes
    assert sum(len(p) for p in wl.prompts) + sum(wl.max_tokens) - 5 == \
        int(re.search(r"tokens computed: (\d+) real", text).group(1))


def test_cli_trace_errors(capsys):
    assert main(["trace", "--out", "x.gif"]) == 2
    assert "--out must end in .png or .svg" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["trace", "--policy", "nope"])
    assert e.value.code == 2


def _lab(hex_colour: str) -> tuple[float, float, float]:
    """sRGB hex -> CIE L*a*b* (D65), to measure how different two colours look (CIE76 distance)."""
    rgb = [int(hex_colour.lstrip("#")[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    r, g, b = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz]
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def _delta_e(a: str, b: str) -> float:
    return sum((p - q) ** 2 for p, q in zip(_lab(a), _lab(b))) ** 0.5


def test_request_colours_never_look_like_padding_or_a_held_slot():
    from minicb.measure.trace import HELD_FACE, PADDING_FACE, REQUEST_COLOURS

    for c in REQUEST_COLOURS:          # 30 is far beyond "just noticeable" (about 2.3)
        assert _delta_e(c, PADDING_FACE) > 30 and _delta_e(c, HELD_FACE) > 30, c
    pairs = [(a, b) for i, a in enumerate(REQUEST_COLOURS) for b in REQUEST_COLOURS[i + 1:]]
    assert min(_delta_e(a, b) for a, b in pairs) > 20
    assert _delta_e("#ff9896", PADDING_FACE) < 30      # the check bites: tab20's light red was too close


def test_arrivals_are_recorded_from_events_and_drawn(tmp_path):
    _needs_matplotlib()
    from minicb.measure.trace import build_engine, run_trace

    engine = build_engine("tiny", policy="static", max_num_seqs=2, block_size=4, num_blocks=64)
    wl = make_workload(3, 1, engine.runner.vocab_size, prompt_len=(2, 4), output_len=(2, 3),
                       arrival_gap=4)
    trace = run_trace(engine, wl)
    assert trace.arrivals == {"r0": 0, "r1": 4, "r2": 8}      # drive(): request i joins before step 4i
    assert trace.row(0)[0].kind == IDLE        # static waits for a second request; idle steps stay
    first_busy = min(t for t, step in enumerate(trace.cells) if any(c.busy for c in step))
    assert first_busy == 4
    out = tmp_path / "t.svg"
    render_image(trace, str(out))
    svg = out.read_text()
    assert "A = r0" in svg and "C = r2" in svg and "arrival" in svg and "arrives" in svg
