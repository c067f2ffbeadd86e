"""How much code one decode step crosses: files and functions of ``src/minicb`` seen by a tracer.

Builds the tiny random model, queues two requests, runs until both are decoding, then traces exactly
one ``engine.step()`` with ``sys.settrace`` and counts the distinct files and the distinct functions
(file, first line, name) of the package that the step called. Torch's own code is not counted; the
model's Python code (``minicb.model``) is. ``--list`` prints them, grouped by file.

    python bench/step_trace.py            # "one decode step: 17 files, 88 functions under src/minicb"
    python bench/step_trace.py --list

It runs on any revision of the engine: it uses ``minicb.runtime.runner.engine_for`` where it exists and
``LLMEngine(model, config)`` otherwise, so the figure before and after a change comes from one script.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections import defaultdict

import minicb
from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.measure.bench_cli import build_model

PACKAGE = pathlib.Path(minicb.__file__).resolve().parent


def make_engine(config: SchedulerConfig):
    model = build_model("tiny", "float32")[0]
    try:
        from minicb.runtime.runner import engine_for
    except ImportError:                        # an engine that builds its own runner
        from minicb.engine.llm_engine import LLMEngine

        return LLMEngine(model, config, seed=0)
    return engine_for(model, config, seed=0)


def trace_one_decode_step(engine) -> dict[str, set[tuple[int, str]]]:
    """{file relative to the package: {(first line, function name)}} called by one ``step()``."""
    seen: dict[str, set[tuple[int, str]]] = defaultdict(set)

    def tracer(frame, event, arg):
        if event == "call":
            path = pathlib.Path(frame.f_code.co_filename)
            if path.is_relative_to(PACKAGE):
                seen[str(path.relative_to(PACKAGE))].add((frame.f_code.co_firstlineno, frame.f_code.co_name))
        return None                            # calls only: no line events

    sys.settrace(tracer)
    try:
        engine.step()
    finally:
        sys.settrace(None)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print every file and function")
    args = ap.parse_args()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64)
    engine = make_engine(config)
    for i, prompt in enumerate(([5, 6, 7, 8, 9], [10, 11, 12])):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    engine.step()                              # both prompts (one step: the budget holds them)
    engine.step()                              # a decode step: warm every lazy path once
    plan_before = engine.last_plan
    seen = trace_one_decode_step(engine)
    plan = engine.last_plan
    assert plan is not plan_before and plan.seqs and all(s.num_tokens == 1 for s in plan.seqs), \
        "the traced step must be a decode step"
    n_funcs = sum(len(f) for f in seen.values())
    print(f"one decode step: {len(seen)} files, {n_funcs} functions under src/minicb")
    if args.list:
        for name in sorted(seen):
            funcs = ", ".join(f for _, f in sorted(seen[name]))
            print(f"  {name} ({len(seen[name])}): {funcs}")


if __name__ == "__main__":
    main()
