"""A run, step by step, as plain JSON: what the docs' replay widget plays back.

``ReplayRecorder`` is a step-event listener (``engine.listen(on_step=...)``; ``minicb.engine.events``). For
every step it keeps the plan and the scheduler's snapshots as JSON values, nothing else::

    {"step": 7,
     "seqs":   [{"id": "r2", "slot": 1, "start": 12, "n": 1, "sample": true, "kind": "decode",
                 "table": [3, 9, 10, 12], "kv_slots": [48]}, ...],      # the packed rows, in order
     "cu_seqlens_q": [0, 1, 2, 10],                                      # where each row starts
     "padding": [], "swap_out": [[5, 0], ...], "swap_in": [], "preempted": ["r4"],
     "state": {"slots": ["r0", "r2", null, "r5"], "block_tables": {"r0": [0, 4]}, "host_tables": {},
               "free_blocks": [...], "waiting": [...], "running": [...], "swapped": [...]},
     "after": {...the same fields after the step...},
     "finished": ["r1"], "error": null}

``state`` is the scheduler as planned (right after ``schedule()``: the step's rows hold their slots
and blocks, victims are already in the swapped or waiting queue), ``after`` the scheduler once the step
is recorded (finished requests gone). ``kv_slots`` is the row's ``slot_mapping``: where each new
token's K/V is written, ``table[p // block_size] * block_size + p % block_size``.

``demo()`` records the run the docs show (a tiny random model: the tokens are noise, the schedule is
real): eight requests arriving over time into 4 slots and a 14-block pool, prompts chunked under a
16-token budget, swap preemption into a 16-block host pool. ``python -m minicb.measure.replay OUT.js``
writes it as ``window.MINICB_REPLAY = {...};`` for ``docs/assets/replay/replay.js``; ``make docs-pages``
does so. The recorder imports no torch; ``demo()`` does (it runs the engine).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from minicb.measure.trace import request_colour

SNAPSHOT_FIELDS = ("slots", "free_blocks", "waiting", "running", "swapped")


def snapshot_json(state) -> dict:
    """A ``SchedulerSnapshot`` as JSON values (tables as ``{request: [blocks]}``)."""
    out = {name: list(getattr(state, name)) for name in SNAPSHOT_FIELDS}
    out["block_tables"] = {rid: list(t) for rid, t in state.block_tables}
    out["host_tables"] = {rid: list(t) for rid, t in state.host_tables}
    out["num_free_host_blocks"] = state.num_free_host_blocks
    return out


def _kind(seq) -> str:
    if seq.num_tokens == 1 and seq.start_pos > 0:
        return "decode"
    return "prefill" if seq.sample else "chunk"          # a chunk that does not reach the prompt's end


@dataclass(slots=True)
class ReplayRecorder:
    """Keeps every step of an engine's run as JSON values (see the module docstring)."""

    frames: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)     # in order of first appearance

    def attach(self, engine) -> ReplayRecorder:
        c = engine.config
        self.config = {"policy": c.policy, "num_slots": c.max_num_seqs, "num_blocks": c.num_blocks,
                       "block_size": c.block_size, "num_host_blocks": c.num_host_blocks,
                       "max_num_batched_tokens": c.max_num_batched_tokens,
                       "long_prefill_chunk": c.long_prefill_chunk, "preemption_mode": c.preemption_mode,
                       "prefix_caching": c.prefix_caching}
        engine.listen(on_step=self.on_step)
        return self

    def on_step(self, event) -> None:
        """A ``StepEvent`` listener: one frame per step, idle steps included."""
        plan, bs = event.plan, event.plan.block_size
        seqs, cu = [], [0]
        for s in plan.seqs:
            positions = range(s.start_pos, s.start_pos + s.num_tokens)
            seqs.append({"id": s.request_id, "slot": s.slot_id, "start": s.start_pos, "n": s.num_tokens,
                         "sample": s.sample, "kind": _kind(s), "table": list(s.block_table),
                         "kv_slots": [s.block_table[p // bs] * bs + p % bs for p in positions]})
            cu.append(cu[-1] + s.num_tokens)
        state, after = snapshot_json(event.state), snapshot_json(event.after)
        for st in (state, after):
            for rid in (*st["waiting"], *st["running"], *st["swapped"]):
                if rid not in self.request_ids:
                    self.request_ids.append(rid)
        self.frames.append({
            "step": plan.step, "seqs": seqs, "cu_seqlens_q": cu, "padding": list(plan.padding),
            "swap_out": [list(m) for m in plan.swap_out], "swap_in": [list(m) for m in plan.swap_in],
            "preempted": list(plan.preempted), "state": state, "after": after,
            "finished": [o.request_id for o in event.outputs if o.finished], "error": event.error})

    def to_json(self) -> dict:
        return {"config": self.config, "requests": self.request_ids,
                "colours": {rid: request_colour(i) for i, rid in enumerate(self.request_ids)},
                "frames": self.frames}


# The docs' run: (arrival step, prompt tokens, output tokens) per request.
DEMO_REQUESTS = ((0, 6, 14), (0, 11, 9), (1, 4, 16), (2, 19, 6), (4, 5, 12), (6, 9, 10), (9, 14, 5),
                 (12, 3, 8))
DEMO_CONFIG = dict(policy="continuous", max_num_seqs=4, max_num_batched_tokens=16, long_prefill_chunk=8,
                   block_size=4, num_blocks=14, num_host_blocks=16, preemption_mode="swap",
                   enable_prefix_caching=False)


def demo() -> dict:
    """Record the docs' run (``DEMO_REQUESTS`` under ``DEMO_CONFIG``) with a tiny random model."""
    import torch

    from minicb.core.config import TINY_MODEL, SchedulerConfig
    from minicb.core.sampling_params import SamplingParams
    from minicb.engine.arrivals import Arrival, drive
    from minicb.model.llama import LlamaForCausalLM
    from minicb.runtime.runner import engine_for

    model = LlamaForCausalLM.random(TINY_MODEL, seed=0, dtype=torch.float32, std=0.3)
    engine = engine_for(model, SchedulerConfig(**DEMO_CONFIG), seed=0, clock=lambda: 0.0)
    rec = ReplayRecorder().attach(engine)
    drive(engine, [Arrival(t, f"r{i}", [10 + (i * 7 + j) % 200 for j in range(p)],
                           SamplingParams(max_tokens=o, ignore_eos=True))
                   for i, (t, p, o) in enumerate(DEMO_REQUESTS)])
    data = rec.to_json()
    data["arrivals"] = {f"r{i}": t for i, (t, _, _) in enumerate(DEMO_REQUESTS)}
    return data


def to_js(data: dict) -> str:
    """``data`` as a script that sets ``window.MINICB_REPLAY`` (works from file:// too: no fetch)."""
    return ("// generated by python -m minicb.measure.replay (make docs-pages): a recorded minicb run\n"
            f"window.MINICB_REPLAY = {json.dumps(data, separators=(',', ':'), sort_keys=True)};\n")


def from_js(text: str) -> dict:
    """The data of a file written by ``to_js``."""
    start = text.index("window.MINICB_REPLAY = ") + len("window.MINICB_REPLAY = ")
    return json.loads(text[start:text.rindex(";")])


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
