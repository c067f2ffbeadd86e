"""The architecture, checked: which package may import which, the torch-free core and engine, the
public API, and who may touch the scheduler's insides.

``docs/design.md`` draws the layers; this file is that drawing as a test. Every rule is on *folders*
(packages), not on lists of module names, so a new module is covered the moment it exists. The source
is read with ``ast`` (not grep): a comment or a string naming an import does not count, and an
aliased or lazy (in-function) import is still seen.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "minicb"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}     # this checkout's minicb, in subprocesses

# package -> the packages it may import (itself always). The top-level facade (minicb/__init__.py,
# __main__.py) names everything lazily and is left out.
MAY_IMPORT = {
    "core": set(),
    "engine": {"core"},
    "model": {"core"},
    "runtime": {"core", "engine", "model"},     # a runner serves the engine's interface; engine_for
    "distributed": {"core", "engine", "model", "runtime"},
    "fastpaths": {"core", "model"},             # the CPU speed machinery, fenced off from the reference
    "measure": {"core", "engine", "model", "runtime", "fastpaths"},
    "simulate": {"core", "engine", "measure"},
    "entrypoints": {"core", "engine", "model", "runtime", "distributed", "measure", "simulate", "fastpaths"},
}
# what a learner reads; none of it may import the fast paths (they are handed in: runner_kwargs)
REFERENCE = ("core", "engine", "model", "runtime", "distributed")
# the modules that may read the environment, and why: the fast paths' switches are read in one place
READS_ENVIRONMENT = {
    "fastpaths/settings.py": "every MINICB_* switch of the fast paths",
    "distributed/launch.py": "torchrun's RANK / WORLD_SIZE / LOCAL_RANK",
    "entrypoints/serve/cli.py": "MINICB_API_KEY, the default of --api-key",
    "measure/progress.py": "MINICB_PROGRESS, progress lines off",
    "measure/trace.py": "NO_COLOR, the terminal convention",
}
TORCH_FREE = ("core", "engine")
# attributes that are the scheduler's insides, seen from outside; only the engine and the core use them
INTERNALS = {"scheduler", "slot_table", "block_manager", "_scheduler"}


def _py_files(*roots: Path) -> list[Path]:
    return sorted(p for r in roots for p in r.rglob("*.py") if "__pycache__" not in p.parts)


def _package(path: Path) -> str | None:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else None


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, at any depth of the file (lazily or not)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}     # from minicb.model import llama
    return out


def _minicb_packages(names: set[str]) -> set[str]:
    return {n.split(".")[1] for n in names if n.startswith("minicb.") and (SRC / n.split(".")[1]).is_dir()}


def test_every_package_is_in_the_layer_table():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(MAY_IMPORT), f"packages not in MAY_IMPORT (or gone): {packages ^ set(MAY_IMPORT)}"


def test_each_package_imports_only_the_layers_below_it():
    bad = []
    for path in _py_files(SRC):
        pkg = _package(path)
        if pkg is None:
            continue
        for other in sorted(_minicb_packages(_imports(path)) - MAY_IMPORT[pkg] - {pkg}):
            bad.append(f"{path.relative_to(SRC)} ({pkg}) imports minicb.{other}")
    assert not bad, "\n".join(bad)


def test_the_reference_imports_nothing_from_the_fast_paths():
    """The fence: ``minicb.model`` and everything a decode step runs through (core, engine, runtime,
    distributed) never import ``minicb.fastpaths``, lazily or not; the fast paths are handed to the
    runner by the entry points (``LLM``, the CLI, benchmarks)."""
    bad = [f"{p.relative_to(SRC)} imports {n}" for p in _py_files(*(SRC / r for r in REFERENCE))
           for n in sorted(_imports(p)) if n == "minicb.fastpaths" or n.startswith("minicb.fastpaths.")]
    assert not bad, "\n".join(bad)


def _reads_environment(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any((isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "environb")) or
               (isinstance(n, ast.Name) and n.id in ("environ", "getenv"))
               for n in ast.walk(tree))


def test_one_module_reads_the_fast_paths_switches():
    """Only the modules in ``READS_ENVIRONMENT`` touch ``os.environ`` / ``os.getenv``; of the fast
    paths, only ``settings.py`` (which reads every switch at once)."""
    readers = {str(p.relative_to(SRC)) for p in _py_files(SRC) if _reads_environment(p)}
    assert readers == set(READS_ENVIRONMENT), readers ^ set(READS_ENVIRONMENT)


QUEUES = {"waiting", "running", "swapped"}
MUTATORS = {"append", "appendleft", "extend", "extendleft", "pop", "popleft", "popitem", "remove", "clear",
            "insert", "setdefault", "update", "rotate"}


def _queue_writes(path: Path) -> list[str]:
    """Every place ``path`` changes a ``.waiting`` / ``.running`` / ``.swapped`` queue: a mutating
    call on it, an item assigned or deleted, the attribute assigned (other than ``self.x = y.x``, an
    alias for reading)."""
    tree = ast.parse(path.read_text(), str(path))
    hits = []

    def is_queue(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in QUEUES

    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS \
                and is_queue(n.func.value):
            hits.append(f"{path.name}:{n.lineno}: .{n.func.value.attr}.{n.func.attr}()")
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else \
            [n.target] if isinstance(n, ast.AugAssign) else []
        for tgt in targets:
            if isinstance(tgt, ast.Subscript) and is_queue(tgt.value):
                hits.append(f"{path.name}:{n.lineno}: .{tgt.value.attr}[...]")
            elif is_queue(tgt) and not (isinstance(n, ast.Assign) and is_queue(n.value)
                                        and n.value.attr == tgt.attr):
                hits.append(f"{path.name}:{n.lineno}: .{tgt.attr} =")
    return hits


def test_the_scheduler_is_the_one_writer_of_its_queues():
    """Only ``core/scheduler.py`` changes the waiting / running / swapped queues; the policies read
    them and ask the scheduler to move a request (``admit``, ``resume``, ``preempt``, ``free``)."""
    # core and engine: nothing else can reach the scheduler (test_nothing_outside_the_engine_reads...)
    writers = [hit for p in _py_files(SRC / "core", SRC / "engine") if p != SRC / "core" / "scheduler.py"
               for hit in _queue_writes(p)]
    assert not writers, "\n".join(writers)
    assert _queue_writes(SRC / "core" / "scheduler.py"), "the checker sees the scheduler's own writes"


def test_the_queue_checker_sees_every_kind_of_write(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self, s):\n    self.waiting.appendleft(s)\n    del self.running[s]\n"
                   "    s.swapped = []\n    self.running = s.running\n    n = len(self.waiting)\n")
    assert sorted(h.split(": ")[1] for h in _queue_writes(bad)) == [".running[...]", ".swapped =",
                                                                   ".waiting.appendleft()"]


def test_the_layer_table_has_no_circle():
    state: dict[str, int] = {}

    def visit(p: str, stack: list[str]) -> None:
        state[p] = 1
        for q in sorted(MAY_IMPORT[p]):
            if state.get(q) == 1:
                pytest.fail("import circle: " + " -> ".join(stack + [q]))
            if q not in state:
                visit(q, stack + [q])
        state[p] = 2

    for p in MAY_IMPORT:
        if p not in state:
            visit(p, [p])


def _module_graph() -> dict[str, set[str]]:
    mods = {}
    for p in _py_files(SRC):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    graph = {}
    for name, path in mods.items():
        deps = set()
        for imp in _imports(path):
            while imp and imp not in mods:        # "minicb.model.llama.X" -> the module it names
                imp = imp.rpartition(".")[0]
            if imp and imp != name and imp != "minicb":
                deps.add(imp)
        graph[name] = deps
    return graph


def test_no_import_circle_between_modules():
    graph = _module_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m != "minicb" and m not in state:
            visit(m)


@pytest.mark.parametrize("package", TORCH_FREE)
def test_the_core_and_the_engine_import_no_torch(package):
    """No ``import torch`` anywhere in the package's source, and importing every module of it (in a
    fresh interpreter) loads no torch, not even through another minicb module."""
    files = _py_files(SRC / package)
    assert not [p for p in files if {"torch", "numpy"} & {n.split(".")[0] for n in _imports(p)}]
    mods = [".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
            for p in files]
    code = (f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('minicb'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert p.returncode == 0, p.stderr


def test_import_minicb_does_not_import_torch():
    code = "import sys, minicb; assert 'torch' not in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert p.returncode == 0, p.stderr


def test_from_minicb_import_star_works_and_every_name_resolves():
    code = ("import minicb; ns = {}; exec('from minicb import *', ns); "
            "missing = [n for n in minicb.__all__ if n not in ns]; assert not missing, missing")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert p.returncode == 0, p.stderr
    import minicb

    assert {"LLM", "LLMEngine", "SamplingParams", "RequestOutput"} <= set(minicb.__all__)


def _internal_accesses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path}:{n.lineno}: .{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in INTERNALS]


def test_nothing_outside_the_engine_reads_scheduler_internals():
    """``engine.scheduler``, ``.slot_table``, ``.block_manager`` are read by the engine and the core
    only; runners, tools, entry points, benchmarks and tutorials use the engine's API and events."""
    files = [p for p in _py_files(SRC) if _package(p) not in ("core", "engine")]
    files += _py_files(ROOT / "bench", ROOT / "tutorials")
    offenders = [hit for p in files for hit in _internal_accesses(p)]
    assert not offenders, "\n".join(offenders)


def test_the_checkers_see_what_they_look_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(engine):\n    # engine.scheduler in a comment does not count\n"
                   "    import torch as t\n    from minicb.engine import llm_engine\n"
                   "    return engine.scheduler.slot_table.held()\n")
    assert sorted(h.split(": ")[1] for h in _internal_accesses(bad)) == [".scheduler", ".slot_table"]
    assert {"torch", "minicb.engine", "minicb.engine.llm_engine"} <= _imports(bad)
    assert _minicb_packages(_imports(bad)) == {"engine"}
    env = tmp_path / "env.py"
    env.write_text("import os\n# os.environ in a comment does not count\nx = os.environ.get('A')\n")
    assert _reads_environment(env) and not _reads_environment(bad)


def test_core_classes_have_a_docstring():
    from minicb.core.block_manager import BlockManager
    from minicb.core.plan import ScheduledSeq, StepPlan
    from minicb.core.scheduler import Scheduler
    from minicb.core.sequence import Sequence
    from minicb.core.slot_table import SlotTable
    from minicb.engine.llm_engine import LLMEngine
    from minicb.entrypoints.llm import LLM
    from minicb.model.kv_cache import KVCache
    from minicb.runtime.runner import ModelRunner

    for cls in (BlockManager, LLMEngine, KVCache, LLM, ScheduledSeq, StepPlan, ModelRunner,
                Scheduler, Sequence, SlotTable):
        doc = cls.__doc__ or ""
        assert doc.strip() and not doc.startswith(cls.__name__ + "("), cls.__name__


def test_only_a_runner_packs_or_runs_the_model():
    """The step's tensor work is behind the runner interface: nothing in the engine or the
    distributed package packs a plan or calls the model itself."""
    for path in _py_files(SRC / "engine", SRC / "distributed"):
        tree = ast.parse(path.read_text())
        called = {n.func.id for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "pack" not in called, path


def test_the_tensor_parallel_workers_run_the_same_runner_method():
    """Ranks 1..N-1 (``minicb.distributed.runner.serve``) call ``ModelRunner.run`` on every plan rank 0
    sends, and build no engine: rank 0's loop is the engine's, its runner a ``TPRunner``."""
    tree = ast.parse((SRC / "distributed" / "runner.py").read_text())
    serve = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "serve")
    calls = [n.func.attr for n in ast.walk(serve)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert "run" in calls, "the worker loop calls ModelRunner.run"
    assert not any(isinstance(n, ast.Name) and n.id == "LLMEngine" for n in ast.walk(serve))
