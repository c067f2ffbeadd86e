"""A run, step by step, as plain JSON: what the replay player (``replay_web/replay.js``) plays back.

``ReplayRecorder`` is an engine listener (``engine.listen``; ``minicb.engine.events``). For every step it
keeps the plan and the scheduler's snapshots as JSON values, and a few facts derived from them::

    {"step": 7,
     "seqs":   [{"id": "r2", "slot": 1, "start": 12, "n": 1, "sample": true, "kind": "decode",
                 "prompt": 11, "table": [3, 9, 10, 12], "kv_slots": [48]}, ...],   # packed rows, in order
     "cu_seqlens_q": [0, 1, 2, 10],                                      # where each row starts
     "padding": [], "swap_out": [[5, 0], ...], "swap_in": [], "preempted": ["r4"],
     "state": {"slots": ["r0", "r2", null, "r5"], "block_tables": {"r0": [0, 4]}, "host_tables": {},
               "free_blocks": [...], "waiting": [...], "running": [...], "swapped": [...],
               "cached": [0, 4], "refs": {"0": 2}},
     "after": {...the same fields after the step...},
     "waiting": {"r6": ["no blocks", "its first chunk needs more blocks than the 0 free"]},
     "victims": {"r4": {"mode": "swap", "blocks": [7, 8, 11]}},
     "budget_left": 6, "finished": ["r1"], "error": null}

``state`` is the scheduler as planned (right after ``schedule()``: the step's rows hold their slots
and blocks, victims are already in the swapped or waiting queue), ``after`` the scheduler once the step
is recorded (finished requests gone). ``kv_slots`` is the row's ``slot_mapping``: where each new
token's K/V is written, ``table[p // block_size] * block_size + p % block_size``. ``kind`` is
``minicb.core.plan.row_kind`` (a row is a decode when it starts at or past the prompt's end *and* feeds
one token; any other row is a prefill), refined: ``"recompute"`` is a prefill that computes again what
a recompute preemption threw away (the request was preempted by recompute and has not sampled since,
or the row feeds generated tokens: it ends past the prompt), ``"chunk"`` a prefill that does not
reach the prompt's end, ``"prefill"`` one that does. The player words a recompute row with both
parts of the sequence it covers: "recompute, positions 16-22: prompt 0-18, generated 19-22".

With a tokenizer (``minicb trace --prompts FILE``), the recording also has each request's prompt as
text (``"prompts": {"r0": "..."}``) and every frame the text each request has generated so far, for
the requests that got a token in that step (``"text": {"r0": "..."}``); the player shows both.

The derived facts, each from the snapshot, the plan and the config (the scheduler is not asked):

* ``refs``: the device blocks that more than one table names, with that count (a block's ref count
  is the number of tables that name it); ``cached``: the blocks in the prefix cache (read from the
  engine's block manager when the step is planned; empty without prefix caching);
* ``waiting``: why each waiting request waits (``waiting_reasons``): ``swap pending``, ``no slot``,
  ``no budget``, ``no blocks``, or ``behind rX`` (first come, first served: no overtaking);
* ``victims``: each request preempted in this step, and the device blocks it held before it.

``demo()`` records the run the docs show (a tiny random model: the tokens are noise, the schedule is
real). ``python -m minicb.measure.replay OUT.js`` writes it as ``window.MINICB_REPLAY = {...};``
(``make docs-pages`` does); ``write_html`` writes any recording as one self-contained page (the
player's script, style and the data inline, nothing loaded from the network): ``minicb trace
--replay out.html``. The recorder imports no torch; ``demo()`` does (it runs the engine).
"""

from __future__ import annotations

import argparse
import html
import json
import pathlib
import sys
from dataclasses import dataclass, field

from minicb.core.plan import PREFILL
from minicb.measure.trace import PromptLengths, request_colour, text_colour

SNAPSHOT_FIELDS = ("slots", "free_blocks", "waiting", "running", "swapped")
WEB = pathlib.Path(__file__).resolve().parent / "replay_web"
NO_SLOT, NO_BUDGET, NO_BLOCKS, SWAP_PENDING = "no slot", "no budget", "no blocks", "swap pending"


def snapshot_json(state, cached: list[int] | None = None) -> dict:
    """A ``SchedulerSnapshot`` as JSON values (tables as ``{request: [blocks]}``), with the shared
    blocks' ref counts (``refs``) and the prefix-cached blocks (``cached``, when given)."""
    out = {name: list(getattr(state, name)) for name in SNAPSHOT_FIELDS}
    out["block_tables"] = {rid: list(t) for rid, t in state.block_tables}
    out["host_tables"] = {rid: list(t) for rid, t in state.host_tables}
    out["num_free_host_blocks"] = state.num_free_host_blocks
    out["refs"] = ref_counts(out["block_tables"])
    out["cached"] = list(cached or [])
    return out


def ref_counts(block_tables: dict[str, list[int]]) -> dict[str, int]:
    """``{block: tables naming it}`` for the blocks named by more than one table (keys as strings:
    JSON objects have string keys)."""
    count: dict[int, int] = {}
    for table in block_tables.values():
        for b in table:
            count[b] = count.get(b, 0) + 1
    return {str(b): n for b, n in sorted(count.items()) if n > 1}


def waiting_reasons(plan, state: dict, config: dict) -> dict[str, list[str]]:
    """Why each waiting request did not get in this step: ``{request: [reason, explanation]}``.

    Derived from the planned snapshot (``state``, JSON as ``snapshot_json`` writes it), the plan and
    the config, by the continuous policy's admission rule (``minicb.core.continuous``): nobody is
    admitted in a step that preempted or while a request sits swapped (``swap pending``); otherwise
    admission takes the front of the queue while a slot is free (``no slot``), the budget has tokens
    left (``no budget``) and the block manager can allocate its first chunk (``no blocks``); the
    first that does not fit stays at the front and everyone behind it waits too (``behind rX``). The
    padded policies admit only into an empty batch.
    """
    waiting = state["waiting"]
    if not waiting:
        return {}
    free_slots = state["slots"].count(None)
    if config.get("policy", "continuous") != "continuous":
        why = [NO_SLOT, "every slot is held"] if not free_slots else \
            ["batch running", "a padded batch admits new requests only when it is empty"]
        return {rid: why for rid in waiting}
    if plan.preempted:
        why = [NO_BLOCKS, f"the pool ran out this step ({', '.join(plan.preempted)} preempted): "
                          "nobody is admitted"]
        return {rid: why for rid in waiting}
    if state["swapped"]:
        why = [SWAP_PENDING, f"{', '.join(state['swapped'])} swapped out: swapped requests come back "
                             "before anyone waiting is admitted"]
        return {rid: why for rid in waiting}
    if not free_slots:
        return {rid: [NO_SLOT, f"all {len(state['slots'])} slots are held"] for rid in waiting}
    budget_left = config["max_num_batched_tokens"] - plan.num_batched_tokens
    if budget_left <= 0:
        why = [NO_BUDGET, f"the step's {config['max_num_batched_tokens']} tokens are spent"]
        return {rid: why for rid in waiting}
    front = waiting[0]
    out = {front: [NO_BLOCKS, f"its next tokens need more blocks than the {len(state['free_blocks'])} "
                              "free ones (or the prefix cache can give)"]}
    for rid in waiting[1:]:
        out[rid] = [f"behind {front}", f"first come, first served: {front} is at the front"]
    return out


RECOMPUTE, CHUNK = "recompute", "chunk"


def _row_kind(prompts: PromptLengths, seq, recomputing: bool = False) -> str:
    """``row_kind`` refined (module docstring): recompute, chunk, prefill or decode."""
    kind = prompts.kind(seq)
    if kind != PREFILL:
        return kind
    num_prompt = prompts.known(seq.request_id)
    if recomputing or (num_prompt is not None and seq.start_pos + seq.num_tokens > num_prompt):
        return RECOMPUTE                      # K/V computed before, thrown away by a recompute preemption
    return kind if seq.sample else CHUNK      # a prefill that does not reach the prompt's end


@dataclass(slots=True)
class ReplayRecorder:
    """Keeps every step of an engine's run as JSON values (see the module docstring)."""

    frames: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)     # in order of first appearance
    prompts: PromptLengths = field(default_factory=PromptLengths)
    _engine: object = None
    _cached: list[int] = field(default_factory=list)          # the prefix cache when the step was planned
    _recomputing: set[str] = field(default_factory=set)       # recompute-preempted, not sampled since
    record_text: bool = False                                 # keep each request's text so far

    def attach(self, engine) -> ReplayRecorder:
        c = engine.config
        self.config = {"policy": c.policy, "num_slots": c.max_num_seqs, "num_blocks": c.num_blocks,
                       "block_size": c.block_size, "num_host_blocks": c.num_host_blocks,
                       "max_num_batched_tokens": c.max_num_batched_tokens,
                       "long_prefill_chunk": c.long_prefill_chunk, "preemption_mode": c.preemption_mode,
                       "prefix_caching": c.prefix_caching}
        self._engine = engine
        engine.listen(on_plan=self.on_plan, on_step=self.on_step)
        return self

    def on_plan(self, event) -> None:
        """A ``PlanEvent`` listener: the rows' prompt lengths and the prefix cache, as planned."""
        self.prompts.note_engine(self._engine, event.plan)
        bm = getattr(getattr(self._engine, "scheduler", None), "block_manager", None)
        is_cached = getattr(bm, "is_cached", None)
        self._cached = [b for b in range(self.config["num_blocks"]) if is_cached(b)] \
            if is_cached is not None and self.config.get("prefix_caching") else []

    def on_step(self, event) -> None:
        """A ``StepEvent`` listener: one frame per step, idle steps included."""
        plan, bs = event.plan, event.plan.block_size
        seqs, cu = [], [0]
        for s in plan.seqs:
            positions = range(s.start_pos, s.start_pos + s.num_tokens)
            kind = _row_kind(self.prompts, s, s.request_id in self._recomputing)
            if s.sample:
                self._recomputing.discard(s.request_id)
            seqs.append({"id": s.request_id, "slot": s.slot_id, "start": s.start_pos, "n": s.num_tokens,
                         "sample": s.sample, "kind": kind, "prompt": self.prompts.known(s.request_id),
                         "table": list(s.block_table),
                         "kv_slots": [s.block_table[p // bs] * bs + p % bs for p in positions]})
            cu.append(cu[-1] + s.num_tokens)
        state = snapshot_json(event.state, self._cached)
        after = snapshot_json(event.after, self._after_cached())
        for st in (state, after):
            for rid in (*st["waiting"], *st["running"], *st["swapped"]):
                if rid not in self.request_ids:
                    self.request_ids.append(rid)
        before = self.frames[-1]["after"]["block_tables"] if self.frames else {}
        victims = {rid: {"mode": "swap" if rid in state["swapped"] else "recompute",
                         "blocks": list(before.get(rid, []))} for rid in plan.preempted}
        self._recomputing |= {rid for rid, v in victims.items() if v["mode"] == "recompute"}
        self.frames.append({
            "step": plan.step, "seqs": seqs, "cu_seqlens_q": cu, "padding": list(plan.padding),
            "swap_out": [list(m) for m in plan.swap_out], "swap_in": [list(m) for m in plan.swap_in],
            "preempted": list(plan.preempted), "state": state, "after": after,
            "waiting": waiting_reasons(plan, state, self.config), "victims": victims,
            "budget_left": self.config.get("max_num_batched_tokens", 0) - plan.num_batched_tokens,
            "finished": [o.request_id for o in event.outputs if o.finished], "error": event.error})
        if self.record_text:
            self.frames[-1]["text"] = {o.request_id: o.text for o in event.outputs}

    def _after_cached(self) -> list[int]:
        bm = getattr(getattr(self._engine, "scheduler", None), "block_manager", None)
        if bm is None or not self.config.get("prefix_caching"):
            return []
        return [b for b in range(self.config["num_blocks"]) if bm.is_cached(b)]

    def to_json(self) -> dict:
        colours = {rid: request_colour(i) for i, rid in enumerate(self.request_ids)}
        return {"config": self.config, "requests": self.request_ids, "colours": colours,
                "text_colours": {rid: text_colour(c) for rid, c in colours.items()},
                "frames": self.frames}


# The docs' run: (arrival step, prompt tokens, output tokens, shares the system prompt) per request.
DEMO_REQUESTS = ((0, 6, 14, False), (0, 11, 9, True), (1, 4, 16, False), (2, 19, 6, True),
                 (4, 10, 12, True), (6, 9, 10, False), (9, 14, 5, True), (12, 3, 8, False))
DEMO_SYSTEM = tuple(range(230, 238))     # an 8-token "system prompt": two full blocks, cacheable
DEMO_CONFIG = dict(policy="continuous", max_num_seqs=4, max_num_batched_tokens=16, long_prefill_chunk=8,
                   block_size=4, num_blocks=14, num_host_blocks=16, preemption_mode="swap",
                   enable_prefix_caching=True)


def demo_prompt(i: int, num_tokens: int, shared: bool) -> list[int]:
    """Request i's prompt: the system prompt then its own tokens when ``shared``, else its own."""
    own = [10 + (i * 7 + j) % 200 for j in range(num_tokens)]
    return (list(DEMO_SYSTEM) + own)[:num_tokens] if shared else own


def record(engine, arrivals) -> dict:
    """Run ``arrivals`` (``minicb.engine.arrivals.Arrival``) through ``engine`` and return the
    recording, with each request's arrival step."""
    from minicb.engine.arrivals import drive

    rec = ReplayRecorder().attach(engine)
    drive(engine, list(arrivals))
    data = rec.to_json()
    data["arrivals"] = {a.request_id: a.time for a in arrivals}
    return data


def demo() -> dict:
    """Record the docs' run (``DEMO_REQUESTS`` under ``DEMO_CONFIG``) with a tiny random model."""
    import torch

    from minicb.core.config import TINY_MODEL, SchedulerConfig
    from minicb.core.sampling_params import SamplingParams
    from minicb.engine.arrivals import Arrival
    from minicb.model.llama import LlamaForCausalLM
    from minicb.runtime.runner import engine_for

    model = LlamaForCausalLM.random(TINY_MODEL, seed=0, dtype=torch.float32, std=0.3)
    engine = engine_for(model, SchedulerConfig(**DEMO_CONFIG), seed=0, clock=lambda: 0.0)
    return record(engine, [Arrival(t, f"r{i}", demo_prompt(i, p, shared),
                                   SamplingParams(max_tokens=o, ignore_eos=True))
                           for i, (t, p, o, shared) in enumerate(DEMO_REQUESTS)])


def to_js(data: dict) -> str:
    """``data`` as a script that sets ``window.MINICB_REPLAY`` (works from file:// too: no fetch)."""
    return ("// generated by python -m minicb.measure.replay (make docs-pages): a recorded minicb run\n"
            f"window.MINICB_REPLAY = {json.dumps(data, separators=(',', ':'), sort_keys=True)};\n")


def from_js(text: str) -> dict:
    """The data of a file written by ``to_js`` (or of a page ``write_html`` wrote)."""
    start = text.index("window.MINICB_REPLAY = ") + len("window.MINICB_REPLAY = ")
    return json.loads(text[start:text.index(";\n", start)])


def to_html(data: dict, title: str = "minicb replay") -> str:
    """One self-contained page that plays ``data``: the player's style, script and the recording
    inline; it loads nothing (opens from file:// with no network)."""
    css = (WEB / "replay.css").read_text()
    js = (WEB / "replay.js").read_text()
    script = to_js(data).replace("</", "<\\/")          # no "</script>" can end the block early
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html.escape(title)}</title>\n"
            "<style>body { font-family: system-ui, sans-serif; font-size: 16px; margin: 0.8em; "
            "color: #111; }</style>\n"
            f"<style>\n{css}</style>\n</head><body>\n"
            f"<h1 style=\"font-size: 1.2em\">{html.escape(title)}</h1>\n"
            "<div data-minicb-replay=\"page\"></div>\n"
            f"<script>\n{script}</script>\n<script>\n{js}</script>\n</body></html>\n")


def write_html(data: dict, path: str, title: str = "minicb replay") -> str:
    """Write ``to_html(data)`` to ``path``; return the path."""
    pathlib.Path(path).write_text(to_html(data, title), encoding="utf-8")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minicb.measure.replay", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="docs/assets/replay/data.js")
    args = p.parse_args(argv)
    with open(args.out, "w") as f:
        f.write(to_js(demo()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
