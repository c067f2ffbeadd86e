"""The architecture, checked: the public API, import directions, and who may touch scheduler internals.

DESIGN.md section 2b: the engine talks to the scheduler through ``schedule()`` / ``update()`` and to
everything else through its methods and step events; dependencies point one way (faces -> engine ->
runner -> packer -> model, scheduling beside them); the model side never imports plans. These tests
read the source with ``ast`` (not grep), so a comment or a string naming an attribute does not count
and an aliased import is still seen.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "minicb"

# attributes that are the scheduler's insides, seen from outside
INTERNALS = {"scheduler", "slot_table", "block_manager", "_scheduler"}
# the modules allowed to use them: the engine, the runner, and the scheduling side itself (a
# scheduler reads its own slot table and block manager; preemption is handed the block manager)
ALLOWED = {"engine.py", "runner.py", "scheduler.py", "preemption.py", "planner.py", "block_manager.py",
           "slot_table.py", "sequence.py", "plan.py"}
SCHEDULING = ("sequence", "slot_table", "block_manager", "planner", "preemption", "plan", "scheduler")


def _py_files(*roots: Path) -> list[Path]:
    return sorted(p for r in roots for p in r.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every minicb module ``path`` imports (at any depth of the file, lazily or not)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("minicb")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minicb"):
            out.add(node.module)
            for a in node.names:                              # from minicb.model import llama
                out.add(f"{node.module}.{a.name}")
    return out


def _internal_accesses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.name}:{n.lineno}: .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in INTERNALS]


def test_from_minicb_import_star_works_and_every_name_resolves():
    code = ("import minicb; ns = {}; exec('from minicb import *', ns); "
            "missing = [n for n in minicb.__all__ if n not in ns]; assert not missing, missing; "
            "print(sorted(minicb.__all__))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    import minicb

    for name in minicb.__all__:
        assert getattr(minicb, name) is not None
    assert {"LLM", "LLMEngine", "SamplingParams", "RequestOutput"} <= set(minicb.__all__)


def test_import_minicb_does_not_import_torch():
    code = ("import sys, minicb, minicb.engine.arrivals, minicb.engine.events; "
            "assert 'torch' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def test_nothing_outside_the_engine_and_the_runner_reaches_into_the_scheduler():
    """``engine.scheduler``, ``.slot_table``, ``.block_manager`` are read only by the engines (LLMEngine,
    the simulator's SimulatedEngine), the runner and the scheduling modules; tools, faces, benchmarks
    and tutorials use the engine's API and events."""
    # the simulator's SimulatedEngine is an LLMEngine (a clock for a runner): it reads nothing inside
    files = [p for p in _py_files(SRC) if not (p.parent == SRC and p.name in ALLOWED)]
    files += _py_files(ROOT / "bench", ROOT / "tutorials")
    offenders = [hit for p in files for hit in _internal_accesses(p)]
    assert not offenders, "\n".join(offenders)


def test_the_checker_sees_an_access(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(engine):\n    # engine.scheduler in a comment does not count\n"
                   "    return engine.scheduler.slot_table.held()\n")
    assert [h.split(": ")[1] for h in _internal_accesses(bad.resolve())] in ([".slot_table", ".scheduler"],
                                                                            [".scheduler", ".slot_table"])


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for p in _py_files(SRC)}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for imp in _imports(path):
            while imp and imp not in mods:        # "minicb.model.llama.X" -> the module it names
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        graph[name] = deps
    return graph


def test_no_import_cycle_in_src():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if d.endswith("__init__") or d == "minicb":
                continue                          # the package's lazy facade names everything
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m != "minicb" and m not in state:
            visit(m)


def test_the_model_side_imports_nothing_from_scheduling_or_above():
    graph = _graph()
    forbidden = {f"minicb.{m}" for m in SCHEDULING} | {
        "minicb.engine.llm_engine", "minicb.runtime.runner", "minicb.entrypoints.llm", "minicb.engine.events",
        "minicb.engine.arrivals", "minicb.runtime.packer"}
    bad = {m: sorted(graph[m] & forbidden) for m in graph if m.startswith("minicb.model")}
    assert not {m: d for m, d in bad.items() if d}, bad


def test_the_scheduling_side_imports_no_torch_and_nothing_above_it():
    graph = _graph()
    above = {"minicb.engine.llm_engine", "minicb.runtime.runner", "minicb.entrypoints.llm",
             "minicb.runtime.packer", "minicb.model.kv_cache", "minicb.runtime.sampling",
             "minicb.distributed.runner", "minicb.distributed.launch", "minicb.entrypoints.cli"}
    for m in SCHEDULING:
        name = f"minicb.{m}"
        assert not graph[name] & above, (name, graph[name] & above)
        assert not any(m.startswith("minicb.model") for m in graph[name]), name
        text = (SRC / f"{m}.py").read_text()
        assert "import torch" not in text, name


def test_the_engine_imports_no_runner_model_or_torch():
    """The engine is handed a runner (``minicb.engine.interface.Runner``): no module of ``minicb.engine``
    imports the runtime, the model, the distributed runtime or the entry points, lazily or not, and
    importing all of them loads no torch."""
    graph = _graph()
    below = ("minicb.runtime", "minicb.model", "minicb.distributed", "minicb.entrypoints", "minicb.simulate")
    engine = [m for m in graph if m == "minicb.engine" or m.startswith("minicb.engine.")]
    assert len(engine) >= 5, engine
    bad = {m: sorted(d for d in graph[m] if d.startswith(below)) for m in engine}
    assert not {m: d for m, d in bad.items() if d}, bad
    for m in engine:
        path = SRC.joinpath(*m.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(path.read_text())
        torch_imports = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                         and any(a.name.split(".")[0] == "torch" for a in n.names)
                         or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch"]
        assert not torch_imports, (m, torch_imports)
    code = f"import sys; import {', '.join(engine)}; assert 'torch' not in sys.modules, 'torch'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def test_engine_and_distributed_do_not_import_each_other_and_workers_hold_a_runner():
    graph = _graph()
    assert not [d for d in graph["minicb.engine.llm_engine"] if d.startswith("minicb.distributed")]
    assert "minicb.entrypoints.llm" not in graph["minicb.engine.llm_engine"]
    tree = ast.parse((SRC / "distributed" / "runner.py").read_text())
    serve = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "serve")
    calls = [n.func.attr for n in ast.walk(serve)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert "run" in calls, "the worker loop calls ModelRunner.run"
    assert not any(isinstance(n, ast.Name) and n.id == "LLMEngine" for n in ast.walk(serve))


def test_core_classes_have_a_docstring():
    from minicb.core.block_manager import BlockManager, BlockPool
    from minicb.core.plan import ScheduledSeq, StepPlan
    from minicb.core.scheduler import Scheduler
    from minicb.core.sequence import Sequence
    from minicb.core.slot_table import SlotTable
    from minicb.engine.llm_engine import LLMEngine
    from minicb.entrypoints.llm import LLM
    from minicb.model.kv_cache import KVCache
    from minicb.runtime.runner import ModelRunner

    for cls in (BlockManager, BlockPool, LLMEngine, KVCache, LLM, ScheduledSeq, StepPlan, ModelRunner,
                Scheduler, Sequence, SlotTable):
        doc = cls.__doc__ or ""
        assert doc.strip() and not doc.startswith(cls.__name__ + "("), cls.__name__


def test_only_the_runner_calls_the_model_during_a_step():
    """The step's tensor work is in one method: ``ModelRunner.run``. The engine and the TP worker
    loop call it; neither packs or runs the model itself."""
    for name in ("engine/llm_engine.py", "distributed/runner.py"):
        tree = ast.parse((SRC / name).read_text())
        called = {n.func.id for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "pack" not in called, name
