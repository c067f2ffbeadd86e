"""How much code one decode step crosses: files and functions of ``src/minicb`` seen by a tracer.

Builds the tiny random model, queues two requests, runs until both are decoding, then traces exactly
one ``engine.step()`` with ``sys.settrace`` and counts the distinct files and the distinct functions
(file, first line, name; comprehensions count, as the tracer sees them) of the package that the step
called. Torch's own code is not counted; the model's Python code is. Two modes:

* ``reference``: the model and runner as ``LLM(fast_paths=False)`` has them (``minicb/model`` as it
  reads, the PyTorch attention, torch's argmax);
* ``fast``: as ``LLM()`` has them (``minicb.fastpaths.install``: fused ops, packed GEMMs, the C decode
  kernel, the C argmax).

It also prints the largest classes of ``minicb/core`` and ``minicb/engine`` (lines from ``class`` to
its last line). ``tests/test_step_gauge.py`` holds the reference figures to their limits.

    python bench/step_trace.py            # "reference: one decode step crosses 14 files, 57 functions"
    python bench/step_trace.py --list     # every file and function, grouped by file
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections import defaultdict

import minicb
from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.measure.bench_cli import build_model

PACKAGE = pathlib.Path(minicb.__file__).resolve().parent
MODES = ("reference", "fast")


def make_engine(config: SchedulerConfig, mode: str = "reference"):
    from minicb.runtime.runner import engine_for

    model = build_model("tiny", "float32")[0]
    if mode == "reference":
        return engine_for(model, config, seed=0)
    from minicb.fastpaths.install import cpu_fast_paths, runner_kwargs

    cpu_fast_paths(model, "cpu")
    return engine_for(model, config, seed=0, **runner_kwargs())


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


def decode_step(mode: str) -> dict[str, set[tuple[int, str]]]:
    """What one decode step of two requests calls, in ``mode`` (module docstring)."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64)
    engine = make_engine(config, mode)
    for i, prompt in enumerate(([5, 6, 7, 8, 9], [10, 11, 12])):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    engine.step()                              # both prompts (one step: the budget holds them)
    engine.step()                              # a decode step: warm every lazy path once
    plan_before = engine.last_plan
    seen = trace_one_decode_step(engine)
    plan = engine.last_plan
    assert plan is not plan_before and plan.seqs and all(len(s.token_ids) == 1 for s in plan.seqs), \
        "the traced step must be a decode step"
    return seen


def class_sizes(*packages: str) -> list[tuple[int, str, str]]:
    """(lines, class, file) of every class in these packages of ``src/minicb``, largest first."""
    sizes = []
    for pkg in packages:
        for path in sorted((PACKAGE / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where = str(path.relative_to(PACKAGE))
                    sizes.append((node.end_lineno - node.lineno + 1, node.name, where))
    return sorted(sizes, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print every file and function")
    ap.add_argument("--mode", choices=("both", *MODES), default="both")
    args = ap.parse_args()
    for mode in MODES if args.mode == "both" else (args.mode,):
        seen = decode_step(mode)
        n_funcs = sum(len(f) for f in seen.values())
        print(f"{mode}: one decode step crosses {len(seen)} files, {n_funcs} functions under src/minicb")
        if args.list:
            for name in sorted(seen):
                funcs = ", ".join(f for _, f in sorted(seen[name]))
                print(f"  {name} ({len(seen[name])}): {funcs}")
    top = class_sizes("core", "engine")[:3]
    print("largest classes in core/ and engine/: " + ", ".join(f"{c} {n} lines ({f})" for n, c, f in top))


if __name__ == "__main__":
    main()
