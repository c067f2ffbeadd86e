"""The slot timeline: who held which batch slot at every step, drawn as a space-time diagram.

A *trace* is a grid, one row per slot and one column per step. Each cell says what that slot computed
in that step: a request's prompt (or a chunk of it, even a one-token one), one decode token (a row
that starts past the prompt: ``minicb.core.plan.row_kind``, the rule every picture and the replay
share), padding (the throw-away tokens of the padded policies), nothing while holding the slot (a
"stall": the slot is held but the step's budget ran out), or nothing at all (idle)::

    static: the batch runs until its longest member ends; A's row keeps computing padding
    slot 0 |Aaa.........Cccccc|          A..D  requests (UPPER = prefill step, lower = decode)
    slot 1 |Bbbbbbbbbbbbdddd..|          .     padding      -  held, no tokens    ' '  idle

    continuous: A's slot is refilled by C at the very next step
    slot 0 |AaaCcccccc|
    slot 1 |BbbbbbbbbbbbDddd|

How it is recorded: the engine publishes a ``PlanEvent`` (the ``StepPlan`` and a snapshot of who
holds which slot) before running each step; ``TraceRecorder.attach`` listens to them. A
``ScheduledSeq`` carries its ``slot_id``, so the
real work of a step is placed exactly. Padding rows (``plan.padding``) carry no slot: they belong to
the members of the padded batch that are shorter than its longest row (a short prompt in the prefill
step) or already finished (every decode step). The recorder attributes them the way the padded
policies create them: a scheduled member gets ``longest - its tokens``; a finished member keeps its
slot and gets ``longest`` per step. When the caller passes the slot holders (``held``; the
plan event does) the finished members are known exactly; otherwise the recorder remembers who held
each slot in the batch's first step. If the numbers do not add up, the padding is kept as
``unattributed_padding`` rather than drawn in a wrong place.

The recorder also notes when each request *arrived*: the first recorded step whose snapshot names it
(waiting, running or swapped), kept in ``SlotTrace.arrivals`` and drawn as ticks under the slots, so a
picture shows how long a request waited before it got a slot.

Renderers: ``render_ascii`` (colour on a TTY, ``NO_COLOR`` respected) and ``render_image`` (PNG or SVG
through matplotlib, an optional dependency: ``pip install 'minicb[plots]'``). ``draw_trace`` draws one
trace on a matplotlib ``Axes`` (``render_image`` and the docs' stacked pictures both use it). Request
colours (``REQUEST_COLOURS``) hold no red, pink or grey: padding is pink-red and "held, no tokens" is
grey, so a request's bar never reads as waste. ``run_trace`` runs a
random workload through the real engine with a tiny random model (or a real one) and returns the
trace: it is what ``minicb trace`` calls.

The recorder and the renderers import no torch; ``run_trace`` does (it runs the engine).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from minicb.core.errors import InvalidArgument, MinicbError, check_int
from minicb.core.plan import DECODE, PREFILL, row_kind  # noqa: F401  (DECODE: re-exported)

PADDING, STALL, IDLE = "padding", "stall", "idle"
_LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(slots=True, frozen=True)
class Cell:
    """What one slot did in one step."""

    kind: str                      # prefill / decode / padding / stall / idle
    request_id: str | None = None  # the holder (None when idle, or for unattributed padding)
    num_tokens: int = 0            # real tokens computed for the holder this step
    num_padding: int = 0           # padding tokens computed in this slot's row(s) this step

    @property
    def busy(self) -> bool:
        """True when the slot computed real tokens this step."""
        return self.num_tokens > 0


IDLE_CELL = Cell(IDLE)


@dataclass(slots=True)
class TraceSummary:
    """Totals over a trace; ``padding_waste`` is the benchmark table's "padding bubble" ratio in tokens."""

    num_steps: int
    num_slots: int
    busy_slot_steps: int           # cells that computed real tokens
    padding_slot_steps: int        # cells that computed only padding
    stall_slot_steps: int          # held, nothing computed
    idle_slot_steps: int           # free
    real_tokens: int
    padding_tokens: int

    @property
    def slot_steps(self) -> int:
        return self.num_steps * self.num_slots

    @property
    def slot_utilisation(self) -> float:
        """Busy cells / all cells: how full the batch was, step by step."""
        return self.busy_slot_steps / max(self.slot_steps, 1)

    @property
    def padding_waste(self) -> float:
        """Padding tokens / all tokens computed."""
        return self.padding_tokens / max(self.real_tokens + self.padding_tokens, 1)


@dataclass(slots=True)
class SlotTrace:
    """The grid: ``cells[t][slot]`` for the t-th recorded step (plan number ``steps[t]``)."""

    num_slots: int
    policy: str = ""
    steps: list[int] = field(default_factory=list)
    cells: list[tuple[Cell, ...]] = field(default_factory=list)
    preempted: list[tuple[str, ...]] = field(default_factory=list)     # per recorded step
    unattributed_padding: int = 0
    request_ids: list[str] = field(default_factory=list)               # in order of first appearance
    arrivals: dict[str, int] = field(default_factory=dict)             # request -> column it arrived at

    @property
    def num_steps(self) -> int:
        return len(self.cells)

    def row(self, slot_id: int) -> list[Cell]:
        """Every step's cell of one slot."""
        return [step[slot_id] for step in self.cells]

    def label(self, request_id: str) -> str:
        """The one-letter label of a request (A, B, ... in order of first appearance; cycles after Z)."""
        return _LABELS[self.request_ids.index(request_id) % len(_LABELS)]

    def slots_of(self, request_id: str) -> list[int]:
        """The slots a request occupied, in order (more than one if it was preempted and came back)."""
        out: list[int] = []
        for step in self.cells:
            for slot, c in enumerate(step):
                if c.request_id == request_id and c.kind != PADDING and (not out or out[-1] != slot):
                    out.append(slot)
        return out

    def summary(self) -> TraceSummary:
        flat = [c for step in self.cells for c in step]
        return TraceSummary(
            num_steps=self.num_steps, num_slots=self.num_slots,
            busy_slot_steps=sum(c.busy for c in flat),
            padding_slot_steps=sum(c.kind == PADDING for c in flat),
            stall_slot_steps=sum(c.kind == STALL for c in flat),
            idle_slot_steps=sum(c.kind == IDLE for c in flat),
            real_tokens=sum(c.num_tokens for c in flat),
            padding_tokens=sum(c.num_padding for c in flat) + self.unattributed_padding,
        )


class PromptLengths:
    """Each request's prompt length, which ``row_kind`` needs to tell a prefill row from a decode.

    Told by the engine (``note``, from the scheduler's sequences) or learned from the plans alone: a
    request's first sampled row ends its prompt, since nothing has been generated before it, so its
    prompt is ``start_pos + num_tokens`` of that row, and every row before it is a prefill.
    """

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    def note(self, request_id: str, num_prompt_tokens: int) -> None:
        self._known.setdefault(request_id, num_prompt_tokens)

    def note_engine(self, engine, plan) -> None:
        """Note the prompt length of every row of ``plan`` from ``engine``'s scheduler (if it has one)."""
        get = getattr(getattr(engine, "scheduler", None), "get", None)
        for s in plan.seqs if get is not None else ():
            seq = get(s.request_id)
            if seq is not None:
                self.note(s.request_id, seq.num_prompt_tokens)

    def __len__(self) -> int:
        return len(self._known)

    def keep(self, request_ids) -> None:
        """Forget every request but ``request_ids`` (a long-lived listener's memory stays bounded)."""
        self._known = {r: n for r, n in self._known.items() if r in request_ids}

    def known(self, request_id: str) -> int | None:
        """The request's prompt length, or None while it is not known yet."""
        return self._known.get(request_id)

    def kind(self, seq) -> str:
        """``"prefill"`` or ``"decode"`` for the ``ScheduledSeq`` ``seq`` (``row_kind``)."""
        n = self._known.get(seq.request_id)
        if n is None:
            if seq.sample:                       # the first sampled row: the prompt ends here, for the
                for rid in (seq.request_id, *seq.forks):     # children it forks (n > 1) too
                    self._known[rid] = seq.start_pos + seq.num_tokens
            return PREFILL                       # nothing sampled yet: still inside the prompt
        return row_kind(seq.start_pos, seq.num_tokens, n)


class TraceRecorder:
    """Builds a ``SlotTrace`` from the plans of a run, one ``record`` call per step.

    >>> rec = TraceRecorder(num_slots=4).attach(engine)    # doctest: +SKIP
    >>> engine.run_until_done(); print(render_ascii(rec.trace))   # doctest: +SKIP
    """

    def __init__(self, num_slots: int, policy: str = "", skip_empty: bool = True) -> None:
        check_int("num_slots", num_slots, lo=1)
        self.trace = SlotTrace(num_slots, policy)
        self.skip_empty = skip_empty
        self._members: dict[int, str] = {}     # padded batch members by slot (fallback without held)
        self.prompts = PromptLengths()
        self._engine = None

    def attach(self, engine) -> TraceRecorder:
        """Record every plan ``engine`` runs, from its plan events (``engine.listen``)."""
        self.trace.policy = self.trace.policy or engine.config.policy
        self._engine = engine
        engine.listen(on_plan=self.on_plan)
        return self

    def on_plan(self, event) -> None:
        """A ``PlanEvent`` listener: the step's column, with the slots held when it was planned; a request
        seen for the first time (in any queue or slot) arrived at this column."""
        st = event.state
        column = len(self.trace.cells)
        for rid in (*st.waiting, *st.running, *st.swapped, *(r for r in st.slots if r is not None)):
            self.trace.arrivals.setdefault(rid, column)
        self.prompts.note_engine(self._engine, event.plan)
        self.record(event.plan, {i: r for i, r in enumerate(st.slots) if r is not None})

    def record(self, plan, held: Mapping[int, str] | None = None,
               prompt_lens: Mapping[str, int] | None = None) -> None:
        """Add the column of ``plan``. ``held``: ``{slot: request_id}`` when the plan was made;
        ``prompt_lens``: ``{request_id: prompt tokens}`` where known (else learned, ``PromptLengths``)."""
        for rid, n in (prompt_lens or {}).items():
            self.prompts.note(rid, n)
        if self.skip_empty and not plan.seqs and not plan.padding:
            return
        n = self.trace.num_slots
        cells: list[Cell] = [IDLE_CELL] * n
        real: dict[int, tuple[str, int, str]] = {}
        for s in plan.seqs:
            if not 0 <= s.slot_id < n:
                raise InvalidArgument(f"plan step {plan.step}: slot_id {s.slot_id} outside [0, {n - 1}]")
            kind = self.prompts.kind(s)
            real[s.slot_id] = (s.request_id, s.num_tokens, kind)
            self._see(s.request_id)
        padding = self._attribute_padding(plan, real, held)
        for slot in range(n):
            if slot in real:
                rid, k, kind = real[slot]
                cells[slot] = Cell(kind, rid, k, padding.get(slot, 0))
            elif slot in padding:
                cells[slot] = Cell(PADDING, self._members.get(slot),
                                   0, padding[slot])
            elif held is not None and slot in held:
                cells[slot] = Cell(STALL, held[slot])
                self._see(held[slot])
        self.trace.steps.append(plan.step)
        self.trace.cells.append(tuple(cells))
        self.trace.preempted.append(tuple(plan.preempted))

    def _see(self, request_id: str) -> None:
        if request_id not in self.trace.request_ids:
            self.trace.request_ids.append(request_id)

    def _attribute_padding(self, plan, real, held) -> dict[int, int]:
        """Per slot padding tokens, or {} (and ``unattributed_padding`` grows) if they do not add up."""
        if held is not None:
            members = dict(held)
        elif all(s.start_pos == 0 for s in plan.seqs):
            # a padded batch's first step schedules every member from position 0: exactly the members
            members = {slot: rid for slot, (rid, _, _) in real.items()}
        else:
            members = {**self._members, **{slot: rid for slot, (rid, _, _) in real.items()}}
        self._members = members
        if not plan.padding:
            return {}
        longest = max([k for _, k, _ in real.values()] + [0])   # the padded policies pad to this
        out: dict[int, int] = {}
        for slot in members:
            k = real[slot][1] if slot in real else 0
            if longest - k:
                out[slot] = longest - k
        if not longest or sorted(out.values()) != sorted(plan.padding):
            self.trace.unattributed_padding += plan.num_padding_tokens
            return {}
        return out


# --- rendering ---------------------------------------------------------------------------------------
_GLYPH = {PADDING: ".", STALL: "-", IDLE: " "}
_COLOURS = (33, 208, 34, 163, 39, 178, 99, 167, 36, 127, 70, 202, 27, 136, 170, 29)   # xterm-256
_PADDING_COLOUR = 196


def _glyph(trace: SlotTrace, c: Cell) -> str:
    if c.busy:
        ch = trace.label(c.request_id)
        return ch if c.kind == PREFILL else ch.lower()
    return _GLYPH[c.kind]


def _use_colour(colour: bool | None, stream) -> bool:
    if colour is not None:
        return colour
    if os.environ.get("NO_COLOR"):
        return False
    return bool(getattr(stream, "isatty", lambda: False)())


def _paint(text: str, trace: SlotTrace, c: Cell) -> str:
    if c.busy:
        code = _COLOURS[trace.request_ids.index(c.request_id) % len(_COLOURS)]
        bold = "1;" if c.kind == PREFILL else ""
        return f"\x1b[{bold}38;5;{code}m{text}\x1b[0m"
    if c.kind == PADDING:
        return f"\x1b[38;5;{_PADDING_COLOUR}m{text}\x1b[0m"
    return text


def render_ascii(trace: SlotTrace, width: int | None = None, colour: bool | None = None,
                 title: str | None = None, legend: bool = True, summary: bool = True,
                 stream=None) -> str:
    """The space-time diagram as text: one line per slot, one character per step.

    ``width`` (default: the terminal's) wraps long runs into bands of steps. ``colour``: None means
    "on a TTY unless NO_COLOR is set" (judged on ``stream``, default stdout).
    """
    paint = _use_colour(colour, sys.stdout if stream is None else stream)
    width = width or shutil.get_terminal_size((100, 24)).columns
    lw = max(len(f"slot {trace.num_slots - 1}"), len("preempt"))      # label column width
    band = max(10, width - lw - 3)
    lines = []
    if title is not None:
        lines.append(title)
    elif trace.policy:
        lines.append(f"policy {trace.policy}: {trace.num_slots} slots x {trace.num_steps} steps")
    for start in range(0, max(trace.num_steps, 1), band):
        stop = min(start + band, trace.num_steps)
        ruler = "".join(str(t // 10 % 10) if t % 10 == 0 else " " for t in range(start, stop))
        lines.append(f"{'step':<{lw}}  {ruler.rstrip()}")
        lines.append(f"{'':<{lw}}  " + "".join(str(t % 10) for t in range(start, stop)))
        for slot in range(trace.num_slots):
            row = trace.cells[start:stop]
            chars = [_glyph(trace, step[slot]) for step in row]
            if paint:
                chars = [_paint(ch, trace, step[slot]) for ch, step in zip(chars, row, strict=True)]
            lines.append(f"{'slot ' + str(slot):<{lw}} |{''.join(chars)}|")
        if any(trace.preempted[start:stop]):
            marks = "".join("^" if p else " " for p in trace.preempted[start:stop])
            lines.append(f"{'preempt':<{lw}}  {marks.rstrip()}")
    if legend:
        names = [f"{trace.label(r)}={r}" for r in trace.request_ids[:12]]
        if len(trace.request_ids) > 12:
            names.append(f"... ({len(trace.request_ids)} requests)")
        lines += _pack("legend: ", names, width)
        lines += _pack(" " * 8, ["UPPER = prefill step", "lower = decode", "'.' = padding",
                                 "'-' = slot held but no tokens", "' ' = idle", "'^' = a preemption"], width)
    if summary:
        for line in summary_lines(trace.summary()):
            head, sep, tail = line.partition("  (")     # too wide: the ratio goes on a line of its own
            if len(line) <= width or not sep:
                lines.append(line)
            else:
                lines += textwrap.wrap(head, width, subsequent_indent="  ") + ["  (" + tail]
    return "\n".join(lines)


def _pack(prefix: str, items: list[str], width: int) -> list[str]:
    """``items`` joined by ", " after ``prefix``, in lines of at most ``width`` (an item never splits)."""
    out, line = [], prefix
    for k, item in enumerate(items):
        piece = item + ("," if k < len(items) - 1 else "")
        if line.strip() and len(line) + 1 + len(piece) > width:
            out.append(line.rstrip())
            line = " " * len(prefix)
        line += ("" if line.endswith(" ") or not line.strip() else " ") + piece
    out.append(line.rstrip())
    return out


def summary_lines(s: TraceSummary) -> list[str]:
    """The trace's totals in two lines (the tutorials and ``minicb trace`` print them)."""
    return [
        f"slot-steps: {s.slot_steps} = {s.busy_slot_steps} busy + {s.padding_slot_steps} padding + "
        f"{s.stall_slot_steps} stalled + {s.idle_slot_steps} idle  (slot utilisation "
        f"{100 * s.slot_utilisation:.1f}%)",
        f"tokens computed: {s.real_tokens} real + {s.padding_tokens} padding  (padding waste "
        f"{100 * s.padding_waste:.1f}%)",
    ]


# Image colours. A request's colour must never be mistaken for padding (pink-red) or for a held slot
# that computes nothing (grey): no reds, pinks or greys among them (tests/measure/test_trace.py measures it).
REQUEST_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#17becf", "#bcbd22", "#8c564b",
                   "#393b79", "#637939", "#e7ba52", "#6baed6", "#005f73")
PADDING_FACE = "#f3c1c1"
HELD_FACE = "#dddddd"
PREEMPT_COLOUR = "#c00000"


_NAMED = {"white": "#ffffff", "black": "#000000"}


def _luminance(colour: str) -> float:
    """WCAG relative luminance of ``#rrggbb`` (or ``white``, ``black``)."""
    colour = _NAMED.get(colour, colour)

    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)


def contrast_ratio(a: str, b: str) -> float:
    """WCAG contrast ratio of two ``#rrggbb`` colours, from 1 (the same) to 21 (black on white)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_colour(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (every ``REQUEST_COLOURS`` entry
    reaches 4.5:1 with it: tests/measure/test_trace.py measures it)."""
    return "#000000" if contrast_ratio(background, "#000000") >= contrast_ratio(background, "#ffffff") \
        else "#ffffff"


def request_colour(index: int) -> str:
    """The image colour of the ``index``-th request (cycles after ``len(REQUEST_COLOURS)``)."""
    return REQUEST_COLOURS[index % len(REQUEST_COLOURS)]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MinicbError("drawing a PNG or SVG needs matplotlib, which is not installed: "
                          "pip install 'minicb[plots]' (or leave out --out for the ASCII diagram)") from None
    matplotlib.rcParams["svg.hashsalt"] = "minicb"     # stable ids: the same trace gives the same SVG
    matplotlib.rcParams.update(READABLE_RC)
    return plt


# Pictures that read at the size they are shown: SVG text stays text (the browser draws it, a test can
# measure it), and no text is smaller than MIN_FONT_PX once the SVG is shown at its own size (the docs
# show every SVG at its native size: docs/assets/pictures.css). 1 pt = 4/3 px.
MIN_FONT_PX = 11.0
READABLE_RC = {"svg.fonttype": "none", "font.size": 9, "axes.titlesize": 9.5, "axes.labelsize": 9,
               "xtick.labelsize": 9, "ytick.labelsize": 9, "legend.fontsize": 9}
_SVG_FONT = re.compile(r"font(?:-size)?:\s*(?:[a-z]+\s+)*([0-9.]+)px")


def svg_font_sizes(svg: str) -> list[float]:
    """The font sizes of an SVG's text, in its own units (matplotlib: points)."""
    return [float(m) for m in _SVG_FONT.findall(svg)]


def save_readable(fig, path: str, **savefig) -> str:
    """``fig.savefig(path)``; for an SVG, then enlarge its declared size (never its drawing) until its
    smallest text is ``MIN_FONT_PX`` at that size."""
    fig.savefig(path, **savefig)
    if str(path).lower().endswith(".svg"):
        text = pathlib.Path(path).read_text()
        sizes = svg_font_sizes(text)
        scale = max(1.0, 1.01 * MIN_FONT_PX / (min(sizes) * 4 / 3)) if sizes else 1.0   # 1%: rounding
        if scale > 1.0:
            def grow(m: re.Match) -> str:
                return f'{m.group(1)}="{float(m.group(2)) * scale:.2f}pt"'
            head, rest = text.split("<svg", 1)
            tag, body = rest.split(">", 1)
            tag = re.sub(r'(width|height)="([0-9.]+)pt"', grow, tag)
            pathlib.Path(path).write_text(f"{head}<svg{tag}>{body}")
    return str(path)


def draw_trace(ax, trace: SlotTrace, colour_of: Callable[[str], str] | None = None,
               label_of: Callable[[str], str] | None = None, num_steps: int | None = None) -> None:
    """Draw ``trace`` on the matplotlib ``ax``: one row per slot, one column per step, and under the
    slots a row of arrival ticks (``trace.arrivals``). ``colour_of`` / ``label_of`` map a request id to
    its colour / letter (default: order of first appearance, ``REQUEST_COLOURS`` and ``trace.label``);
    pass them to keep several traces of one workload in the same colours. ``num_steps`` sets the x
    range (default: this trace's steps), so stacked traces can share one time axis."""
    order = trace.request_ids + [r for r in trace.arrivals if r not in trace.request_ids]
    colour_of = colour_of or (lambda rid: request_colour(order.index(rid)))
    label_of = label_of or (lambda rid: _LABELS[order.index(rid) % len(_LABELS)])
    n_steps, n_slots = max(num_steps or trace.num_steps, 1), trace.num_slots
    for slot in range(n_slots):
        for t0, t1, c in _spans(trace.row(slot)):
            if c.busy:
                face = colour_of(c.request_id)
            elif c.kind == IDLE:
                continue
            else:
                face = PADDING_FACE if c.kind == PADDING else HELD_FACE
            hatch = {PREFILL: "//", PADDING: "xx"}.get(c.kind)
            ax.broken_barh([(t0, t1 - t0)], (slot - 0.4, 0.8), facecolors=face, edgecolor="white",
                           linewidth=0.6, hatch=hatch)
        for start, rid in _runs(trace.row(slot)):
            face = colour_of(rid)     # on its own colour, even where the letter is wider than the bar
            ax.text(start + 0.15, slot, label_of(rid), va="center", ha="left", fontsize=9,
                    color=text_colour(face), fontweight="bold",
                    bbox={"boxstyle": "square,pad=0.08", "facecolor": face, "edgecolor": "none"})
    for t, victims in enumerate(trace.preempted):
        for rid in victims:
            slot = _last_slot(trace, rid, t)
            if slot is not None:
                ax.plot([t], [slot - 0.45], marker="v", color=PREEMPT_COLOUR, markersize=7)
    by_step: dict[int, list[str]] = {}
    for rid, t in trace.arrivals.items():
        by_step.setdefault(t, []).append(rid)
    y = n_slots - 0.1
    for t, rids in sorted(by_step.items()):   # several arrivals at one step share a grey tick
        letters = sorted(label_of(r) for r in rids)
        text = "".join(letters) if len(rids) <= 3 else f"{letters[0]}..{letters[-1]} ({len(rids)})"
        colour = colour_of(rids[0]) if len(rids) == 1 else "#444444"
        ax.plot([t + 0.5], [y], marker="^", color=colour, markersize=6, clip_on=False)
        ax.text(t + 0.9, y, text, va="center", ha="left", fontsize=8.5, clip_on=False)
    ax.set_ylim(n_slots + 0.2, -0.5)
    ax.set_xlim(0, n_steps)
    ax.set_yticks([*range(n_slots), n_slots - 0.1], [*(f"slot {i}" for i in range(n_slots)), "arrives"])
    ax.tick_params(axis="y", length=0)


def render_image(trace: SlotTrace, path: str, title: str | None = None) -> str:
    """Draw the trace into ``path`` (``.png`` or ``.svg``) with matplotlib; return the path.

    Slots are rows, steps columns; under them a tick marks each request's arrival; the legend names
    the kinds of cell and the requests (letter = request id). Raises ``MinicbError`` with an install
    hint when matplotlib is missing.
    """
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in (".png", ".svg"):
        raise InvalidArgument(f"out must end in .png or .svg, got {path!r}")
    plt = _pyplot()
    n_steps, n_slots = max(trace.num_steps, 1), trace.num_slots
    # 7 inches: the docs' 688 px content column at native size; longer runs grow (and scroll there)
    fig_w = min(16.0, max(7.0, 0.7 + n_steps * 0.1))
    order = trace.request_ids + [r for r in trace.arrivals if r not in trace.request_ids]
    handles = legend_handles(plt, [(_LABELS[i % len(_LABELS)], rid, request_colour(i))
                                   for i, rid in enumerate(order)])
    legend_rows = -(-len(handles) // 4)
    fig, ax = plt.subplots(figsize=(fig_w, 1.5 + 0.42 * n_slots + 0.24 * legend_rows))
    draw_trace(ax, trace)
    s = trace.summary()
    ax.set_xlabel("step")
    ax.set_title(title or f"{trace.policy or 'trace'}: slot utilisation {100 * s.slot_utilisation:.0f}%, "
                 f"padding waste {100 * s.padding_waste:.0f}%", fontsize=10)
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.07 + 0.2 * legend_rows / (1.5 + 0.42 * n_slots + 0.24 * legend_rows),
                           1, 1))
    metadata = {"Date": None} if ext == ".svg" else {"Software": None}
    save_readable(fig, path, metadata=metadata, dpi=110)
    plt.close(fig)
    return str(path)


def legend_handles(plt, requests: Sequence[tuple[str, str, str]], max_requests: int = 12) -> list:
    """Legend entries: the kinds of cell, then ``(letter, request id, colour)`` per request (the first
    ``max_requests``; the rest summed up in one line)."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="#888888", hatch="//", label="prefill (chunk)"),
               Patch(facecolor="#888888", label="decode"),
               Patch(facecolor=PADDING_FACE, hatch="xx", label="padding"),
               Patch(facecolor=HELD_FACE, label="held, no tokens"),
               plt.Line2D([], [], marker="v", color=PREEMPT_COLOUR, linestyle="", label="preemption"),
               plt.Line2D([], [], marker="^", color="#444444", linestyle="", label="arrival")]
    handles += [Patch(facecolor=colour, label=f"{letter} = {rid}")
                for letter, rid, colour in requests[:max_requests]]
    if len(requests) > max_requests:
        handles.append(Patch(facecolor="white", label=f"... {len(requests) - max_requests} more"))
    return handles


def _last_slot(trace: SlotTrace, request_id: str, before: int) -> int | None:
    """The slot ``request_id`` last computed in before step index ``before``."""
    for t in range(before - 1, -1, -1):
        for slot, c in enumerate(trace.cells[t]):
            if c.request_id == request_id and c.busy:
                return slot
    return None


def _spans(row: Sequence[Cell]) -> list[tuple[int, int, Cell]]:
    """Maximal [t0, t1) stretches of one kind and holder (a prefill step is a span of its own)."""
    out: list[tuple[int, int, Cell]] = []
    for t, c in enumerate(row):
        key = (c.kind, c.request_id)
        if out and c.kind != PREFILL and (out[-1][2].kind, out[-1][2].request_id) == key \
                and out[-1][1] == t:
            out[-1] = (out[-1][0], t + 1, out[-1][2])
        else:
            out.append((t, t + 1, c))
    return out


def _runs(row: Sequence[Cell]) -> list[tuple[int, str]]:
    """(first step, request) of every stretch of busy cells of one request."""
    out, prev = [], None
    for t, c in enumerate(row):
        rid = c.request_id if c.busy else None
        if rid is not None and rid != prev:
            out.append((t, rid))
        prev = rid
    return out


# --- running a workload ------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Workload:
    """Random prompts (token ids) and output lengths; ``arrivals[i]`` is request i's arrival step."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    arrivals: tuple[int, ...]


def make_workload(num_requests: int, seed: int, vocab_size: int, prompt_len: tuple[int, int] = (4, 24),
                  output_len: tuple[int, int] = (2, 24), arrival_gap: int = 0) -> Workload:
    """A reproducible workload: lengths uniform in the given inclusive ranges (torch-free RNG)."""
    import random

    check_int("num_requests", num_requests, lo=1, hi=100_000)
    check_int("seed", seed, lo=0)
    check_int("arrival_gap", arrival_gap, lo=0, hi=10_000)           # idle steps are run one by one
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        check_int(f"{name} low", lo, lo=1)
        check_int(f"{name} high", hi, lo=lo, hi=2**20)
    if num_requests * prompt_len[1] > 10_000_000:     # the prompts are built before any engine sees them
        raise InvalidArgument(f"num_requests x prompt_len high = {num_requests * prompt_len[1]:,} tokens of "
                              "prompts; at most 10,000,000")
    rng = random.Random(seed)
    prompts = tuple(tuple(rng.randrange(4, vocab_size) for _ in range(rng.randint(*prompt_len)))
                    for _ in range(num_requests))
    outs = tuple(rng.randint(*output_len) for _ in range(num_requests))
    return Workload(prompts, outs, tuple(i * arrival_gap for i in range(num_requests)))


def build_engine(model: str = "tiny", dtype: str = "float32", seed: int = 0, **config):
    """An ``LLMEngine`` with the tiny random model (``model="tiny"``), the default SmolLM2
    (``"default"``) or a GGUF file / Hugging Face directory; ``config``: ``SchedulerConfig`` fields.
    A real model's engine has its tokenizer (``engine.tokenizer``: outputs carry text)."""
    from minicb.core.config import SchedulerConfig
    from minicb.measure.models import build_model
    from minicb.runtime.runner import engine_for

    m, tokenizer = build_model(model, dtype, seed)
    config.setdefault("max_model_len", min(4096, m.config.max_position_embeddings))
    return engine_for(m, SchedulerConfig(**config), tokenizer, seed=seed)   # a real model's text too


def run_trace(engine, workload: Workload, on_step: Callable | None = None, ignore_eos: bool = True
              ) -> SlotTrace:
    """Run ``workload`` through ``engine`` (greedy; ``ignore_eos``, the default: lengths are the
    workload's; without it a request may stop at its end-of-sequence token) and return the slot
    trace. Arrivals are in steps (``minicb.engine.arrivals.drive``); arrivals close after the last
    request is added. Steps that compute nothing (waiting for arrivals) stay in the trace."""
    from minicb.core.sampling_params import SamplingParams
    from minicb.engine.arrivals import Arrival, drive

    # Idle steps are kept: with arrivals over time they are real time in which the slots stood empty.
    rec = TraceRecorder(engine.config.max_num_seqs, skip_empty=False).attach(engine)
    drive(engine, [Arrival(workload.arrivals[i], f"r{i}", list(workload.prompts[i]),
                           SamplingParams(max_tokens=workload.max_tokens[i], ignore_eos=ignore_eos))
                   for i in range(len(workload.prompts))], on_step=on_step)
    return rec.trace
