"""The gauges of a readable step, held: what one decode step crosses in the reference mode, the size of
the largest classes of the core and the engine, and the figure ``bench/step_trace.py`` quotes.

The limits are the architecture issue's: a learner following one decode step of the reference model
(``LLM(fast_paths=False)``) opens at most 14 files and 60 functions of ``src/minicb`` (nano-vllm's
step, traced the same way: 14 files, 44 functions), and no class of ``core/`` or ``engine/`` is over
250 lines. The counts are exact and repeatable (a tracer, not a clock).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES, MAX_FUNCTIONS, MAX_CLASS_LINES = 14, 60, 250


@pytest.fixture(scope="module")
def step_trace():
    spec = importlib.util.spec_from_file_location("step_trace", ROOT / "bench" / "step_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_reference_decode_step_stays_within_its_limits(step_trace):
    seen = step_trace.decode_step("reference")
    files, functions = len(seen), sum(map(len, seen.values()))
    assert files <= MAX_FILES and functions <= MAX_FUNCTIONS, step_trace.__doc__
    # the reference step runs the reference model: no fast path in it
    assert not [f for f in seen if f.startswith("fastpaths/")], sorted(seen)
    assert {"model/llama.py", "model/attention.py", "core/scheduler.py", "engine/loop.py"} <= set(seen)
    # and the figure the script's docstring quotes is today's
    quoted = re.search(r"reference: one decode step crosses (\d+) files, (\d+) functions", step_trace.__doc__)
    assert quoted and (int(quoted[1]), int(quoted[2])) == (files, functions), \
        f"the docstring: {quoted and quoted[0]}; today: {files} files, {functions} functions"


def test_the_fast_step_runs_the_fast_paths(step_trace):
    seen = step_trace.decode_step("fast")
    assert any(f.startswith("fastpaths/") for f in seen), sorted(seen)


def test_no_class_of_the_core_or_the_engine_is_over_its_limit(step_trace):
    sizes = step_trace.class_sizes("core", "engine")
    assert sizes and all(n > 0 for n, _, _ in sizes)
    over = [(n, c, f) for n, c, f in sizes if n > MAX_CLASS_LINES]
    assert not over, over


def test_the_class_sizes_are_measured_from_class_to_last_line(step_trace, tmp_path, monkeypatch):
    pkg = tmp_path / "core"
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    x = 1\n\n    def f(self):\n        return 2\n\n\n"
                              "class B:\n    pass\n")
    monkeypatch.setattr(step_trace, "PACKAGE", tmp_path)
    assert step_trace.class_sizes("core") == [(5, "A", "core/a.py"), (2, "B", "core/a.py")]
