"""Mutation testing of the core and the sampler: break the code on purpose, one small change at a time,
and check that some test notices.

A *mutant* is the source with one small change: a flipped comparison (``<`` becomes ``<=``, ``==``
becomes ``!=``, ``is`` becomes ``is not``), an off-by-one constant in a comparison or arithmetic, a
dropped statement (a call, a store into an object, a ``+=``, a ``raise``), ``min`` swapped for
``max``, ``and`` for ``or``, a constant ``return`` (``False`` from a ``-> bool`` function, ``0``
from an ``-> int`` one). By default each line gets its first mutant only (a line's mutants nearly
always live or die together); ``--all`` takes every mutant of every line and adds a dropped
``not``, ``+``/``-`` and ``in``/``not in`` swaps and flipped ``True``/``False``.

A mutant is *killed* when a test fails on it (or runs past its timeout: an infinite loop is a
failure too) and *survives* when every test still passes: a survivor is a behaviour nothing checks.
Some mutants cannot be told apart from the original by any test, because they compute the same
thing (``x > 0`` and ``x >= 1`` on integers): those *equivalent* mutants are listed in
``EQUIVALENT`` below with one reason each, printed with the results and left out of the score::

    score = killed / (mutants - equivalent)

Not mutated: docstrings, f-strings (messages), annotations, decorators, ``assert`` statements and the
``check_integrity`` functions: those are the tests' referee, not behaviour.

How it stays fast on two busy cores:

* one unmutated, traced run of the modules' tests records which lines each test executes (and checks
  they pass); a mutant then runs only the tests that execute its lines, fastest first, ``-x``
  (first failure stops). A mutant that runs at import (a module constant, a default argument) runs
  its module's whole test set (``TESTS_FOR`` below);
* hypothesis is derandomized, does not shrink, and runs a quarter of each property test's examples;
  a survivor of that quick pass runs again with every example, so the quick pass never decides a
  survivor on its own;
* torch, pytest, hypothesis, the package and the test modules are imported once; each mutant runs
  in a ``fork`` of this process, two at a time, each with a timeout, and the mutant is put in by
  giving the functions of the imported module the mutated code objects (nothing is imported again);
* everything happens in a temporary copy of ``src/`` and ``tests/``: the working tree is never
  touched, whatever happens (Ctrl-C and ``kill`` included), and the copy is deleted at the end.

Usage::

    python bench/mutate.py                        # everything (``make mutate``)
    python bench/mutate.py --module planner       # the modules whose path contains "planner"
    python bench/mutate.py --list                 # only list the mutants
    python bench/mutate.py --max 40               # 40 mutants spread over the modules
    python bench/mutate.py --only survivors.txt   # the mutants listed in a file, as printed
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "minicb"

# The modules under test: every file of the torch-free core (whatever files it has when this runs), the
# sampler and its per-row logits processors.
def target_files() -> list[pathlib.Path]:
    core = sorted(p for p in (PACKAGE / "core").glob("*.py") if p.name != "__init__.py")
    return core + [PACKAGE / "runtime" / "sampling.py", PACKAGE / "runtime" / "logits_processors.py"]


MODULES = [p.relative_to(PACKAGE).as_posix() for p in target_files()]


# TESTS_FOR: which tests a mutant of which module may run (paths relative to the repository root). Every core
# module gets the whole of tests/core (new test files there join automatically); a few modules are
# also used, or only used, by the engine and model tests named here.
CORE_TESTS = ["tests/core"]
EXTRA_TESTS = {
    "core/config.py": ["tests/engine/test_robust_inputs.py"],
    "core/errors.py": ["tests/engine/test_robust_inputs.py"],
    "core/sampling_params.py": ["tests/engine/test_robust_inputs.py"],
    "core/memory.py": ["tests/model/test_kv_pool_memory.py", "tests/model/test_kv_cache.py",
                       "tests/engine/test_robust_inputs.py"],
    "core/kv_budget.py": ["tests/engine/test_kv_budget.py"],
}
SAMPLER_TESTS = ["tests/runtime", "tests/engine/test_robust_inputs.py", "tests/engine/test_knobs_engine.py"]


def tests_for(rel: str) -> list[str]:
    """The test paths for the module at ``rel`` (``core/planner.py``); only those that exist."""
    if rel in ("runtime/sampling.py", "runtime/logits_processors.py"):
        paths = SAMPLER_TESTS
    elif rel == "core/kv_budget.py":
        paths = EXTRA_TESTS[rel]
    else:
        paths = EXTRA_TESTS.get(rel, []) + CORE_TESTS
    return [p for p in paths if (ROOT / p).exists()]


# Equivalent mutants: (the function's name, "" at module or class level; the original line stripped;
# the mutation; why no test can kill it).
# Keyed by the line's text and its function rather than a line number or a module, so the list
# survives edits elsewhere and code moving between modules.
# A listed mutant that is killed after all is reported, so the list cannot go stale silently.
EQUIVALENT: list[tuple[str, str, str, str]] = [
    ("evict", "self.num_children.pop(block, None)", "statement dropped",
     "the evicted block has no cached children (asserted just above), and a Counter reads a missing "
     "key as 0: a zero entry left behind changes no lookup"),
    ("_same_step_hits", "if full <= k0 + len(best) or table[:k0] != hits:", "`<=` -> `<`",
     "only skips work: a row offering exactly as many blocks as the best so far cannot beat it "
     "(the loop below replaces the best only with a strictly longer run)"),
    ("as_real", "return math.inf if value > 0 else -math.inf", "`>` -> `>=`",
     "only an integer too large for a float overflows, and that is never 0"),
    ("format_bytes", 'raise AssertionError("unreachable")', "statement dropped",
     "the loop above returns at PiB at the latest: the line is never reached"),
    ("add", "s.status = SequenceStatus.WAITING", "statement dropped",
     "in add(): validate() just refused any sequence that is not WAITING already"),
    ("update",
     "if caching and seq.num_computed_tokens // bm.block_size > bm.num_hashed.get(s.request_id, 0):",
     "`>` -> `>=`",
     "the guard only skips work: with equal counts cache_full_blocks has no new block to offer"),
    ("_start_running",
     "seq.admitted_index, self._next_admission = self._next_admission, self._next_admission + 1",
     "`1` -> `2`", "admission numbers 0, 2, 4, ... keep their order, and only their order is ever used"),
    ("_row",
     "tokens = prompt[start:start + n] if start + n <= p else (prompt + seq.output_token_ids)[start:][:n]",
     "`<=` -> `<`",
     "a fast path: at equality the general branch gives the same slice (the prompt's tail, no outputs)"),
    ("", "admitted_index: int = -1             # order of the latest admission (the default "
     "preemption victim", "`1` -> `2`", "any negative value means never admitted; only `< 0` is ever asked"),
    ("filter_logits", "if params.min_p > 0.0:", "`>` -> `>=`",
     "a fast path: min_p == 0 masks nothing (no probability is below 0 x the top one)"),
    ("accept", "if self.longest > 1:", "`>` -> `>=`",
     "a word of one token matches no tail: with longest == 1 the kept tail is trimmed to nothing anyway"),
    ("process", "if self.counts and (self.frequency or self.presence):", "`and` -> `or`",
     "a fast path: no counts is an empty index, and zero penalties subtract 0"),
]


# --- the mutants ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mutant:
    rel: str                   # module path relative to src/minicb
    line: int                  # 1-based line of the change
    start: int                 # byte offsets of the replaced span in the file
    end: int
    replacement: str
    description: str           # "`<` -> `<=`"
    last_line: int = 0         # the span's last line
    at_runtime: bool = True    # inside a function body (else it runs at import, before any test)
    function: str = ""         # qualified name of the outermost function around it ("Scheduler.step")

    @property
    def where(self) -> str:
        return f"{self.rel}:{self.line}"

    def apply(self, source: bytes) -> bytes:
        return source[:self.start] + self.replacement.encode() + source[self.end:]


COMPARE_SWAPS = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
                 ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"),
                 ast.IsNot: ("is not", "is"), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}
BINOP_SWAPS = {ast.Add: ("+", "-"), ast.Sub: ("-", "+")}
# The integrity checks are the tests' referee, not behaviour: like ``assert`` statements they are not
# mutated (a weakened referee is not a wrong result).
REFEREE = {"check_integrity", "_check_cache", "_check_waiting", "_check_swapped", "_check_running",
           "_check_holders"}
NUMERIC_PARENTS = (ast.Compare, ast.BinOp, ast.UnaryOp)   # where an off-by-one constant means something


def droppable(stmt: ast.stmt) -> bool:
    """Statements whose loss is a silent change, not a NameError: calls, ``+=``, stores into an
    object (``self.x = ...``, ``d[k] = ...``) and ``raise`` (a guard)."""
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, ast.Call)
    if isinstance(stmt, (ast.AugAssign, ast.Raise, ast.Delete)):
        return True
    if isinstance(stmt, ast.Assign):
        return all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in stmt.targets)
    return False


class _Finder(ast.NodeVisitor):
    """Walks one module and records every mutant of it (see the module docstring for the kinds)."""

    def __init__(self, rel: str, source: bytes) -> None:
        self.rel, self.source = rel, source
        self.line_starts = [0]
        for line in source.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.mutants: list[Mutant] = []
        self.in_function = 0
        self.classes: list[str] = []
        self.function = ""
        self.parents: list[ast.AST] = []
        self.returns: list[str] = []      # the enclosing functions' return annotations

    def offset(self, line: int, col: int) -> int:
        return self.line_starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def add(self, line: int, start: int, end: int, replacement: str, description: str) -> None:
        last = max(i for i, o in enumerate(self.line_starts) if o <= max(start, end - 1)) + 1
        first = max(i for i, o in enumerate(self.line_starts) if o <= start) + 1
        self.mutants.append(Mutant(self.rel, first, start, end, replacement, description, last,
                                   self.in_function > 0, self.function))

    def add_operator(self, left: ast.AST, right: ast.AST, old: str, new: str) -> None:
        """Replace the operator ``old`` written between the nodes ``left`` and ``right``."""
        a, b = self.offset(left.end_lineno, left.end_col_offset), self.offset(right.lineno, right.col_offset)
        gap = self.source[a:b].decode()
        words = gap.replace("(", " ").replace(")", " ").split()
        if " ".join(words) != old:          # comments or odd spacing: leave this one alone
            return
        i = gap.index(old.split()[0])
        j = gap.index(old.split()[-1], i) + len(old.split()[-1])
        self.add(right.lineno, a + i, a + j, new, f"`{old}` -> `{new}`")

    # skipped: docstrings, f-strings (error messages), annotations
    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_arg(self, node: ast.arg) -> None:
        return

    def visit_Assert(self, node: ast.Assert) -> None:
        return                  # the integrity checks: the tests' own referee, not behaviour

    def _function(self, node) -> None:
        if node.name in REFEREE:
            return
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        if not self.in_function:
            self.function = ".".join(self.classes + [node.name])
        self.in_function += 1
        self.returns.append(ast.unparse(node.returns) if node.returns is not None else "")
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]                # the docstring
        for stmt in body:
            self.visit(stmt)
        self.in_function -= 1
        self.returns.pop()
        if not self.in_function:
            self.function = ""

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt) and self.in_function and droppable(node):
            start, end = self.span(node)
            self.add(node.lineno, start, end, "pass", "statement dropped")
        for child in ast.iter_child_nodes(node):
            self.parents.append(node)
            self.visit(child)
            self.parents.pop()

    def visit_Compare(self, node: ast.Compare) -> None:
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            old, new = COMPARE_SWAPS[type(op)]
            self.add_operator(left, right, old, new)
            left = right
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if type(node.op) in BINOP_SWAPS:
            old, new = BINOP_SWAPS[type(node.op)]
            self.add_operator(node.left, node.right, old, new)
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for left, right in zip(node.values, node.values[1:]):
            self.add_operator(left, right, old, new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            start, _ = self.span(node)
            inner, end = self.span(node.operand)
            self.add(node.lineno, start, end, "(" + self.source[inner:end].decode() + ")", "`not` dropped")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        start, end = self.span(node)
        if isinstance(node.value, bool) and isinstance(self.parents[-1] if self.parents else None,
                                                       (ast.Return, ast.Assign, ast.AnnAssign)):
            self.add(node.lineno, start, end, str(not node.value), f"`{node.value}` -> `{not node.value}`")
        elif isinstance(node.value, int) and self.numeric_context():
            self.add(node.lineno, start, end, str(node.value + 1), f"`{node.value}` -> `{node.value + 1}`")

    def numeric_context(self) -> bool:
        """An int in a comparison or arithmetic (``-1`` included), or a ``lo=`` / ``hi=`` bound."""
        parent = self.parents[-1] if self.parents else None
        if isinstance(parent, ast.UnaryOp) and len(self.parents) > 1:
            parent = self.parents[-2]
        return isinstance(parent, NUMERIC_PARENTS) or (
            isinstance(parent, ast.keyword) and parent.arg in ("lo", "hi"))

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            start, end = self.span(node.func)
            new = "max" if node.func.id == "min" else "min"
            self.add(node.lineno, start, end, new, f"`{node.func.id}` -> `{new}`")
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        constant = {"bool": "False", "int": "0"}.get(self.returns[-1] if self.returns else "")
        if constant and node.value is not None and not isinstance(node.value, ast.Constant):
            start, end = self.span(node)
            self.add(node.lineno, start, end, f"return {constant}", f"returns {constant}")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        for stmt in node.body:             # not the decorators (``@dataclass(frozen=True)``)
            self.visit(stmt)
        self.classes.pop()

    def visit_If(self, node: ast.If) -> None:
        if (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            return
        self.generic_visit(node)


def find_mutants(path: pathlib.Path) -> list[Mutant]:
    source = source_of(path.relative_to(PACKAGE).as_posix())
    finder = _Finder(path.relative_to(PACKAGE).as_posix(), source)
    tree = ast.parse(source)
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]                    # the module docstring
    for stmt in body:
        finder.visit(stmt)
    return sorted(finder.mutants, key=lambda m: (m.start, m.description))


_SOURCES: dict[str, bytes] = {}          # every module as it was when its mutants were made


def source_of(rel: str) -> bytes:
    """The module's text as the run found it (the tree may change while a run goes on)."""
    if rel not in _SOURCES:
        _SOURCES[rel] = (PACKAGE / rel).read_bytes()
    return _SOURCES[rel]


def line_text(m: Mutant) -> str:
    return source_of(m.rel).splitlines()[m.line - 1].decode().strip()


def equivalence_reason(m: Mutant) -> str | None:
    text = line_text(m)
    for function, line, description, reason in EQUIVALENT:   # by function name: code moves between
        if line == text and description == m.description and m.function.split(".")[-1] == function:
            return reason                                         # modules and classes
    return None
    return None


# --- running one mutant ---------------------------------------------------------------------------------
def _patch(m: Mutant) -> bool:
    """Put mutant ``m`` into the already imported module, in place: run the mutated source as a fresh
    module, then give every function of the old module (methods and properties included) the new
    code object. Everything that holds a reference (``from x import f``, instances, subclasses) then
    runs the mutated code, without importing anything again. False if the mutated function could not
    be patched (a decorator in the way, a different closure): the caller then imports afresh."""
    import importlib
    import types

    name = "minicb." + m.rel[:-3].replace("/", ".")
    mod = importlib.import_module(name)
    path = mod.__file__
    ns = {"__name__": name, "__file__": path, "__package__": name.rpartition(".")[0]}
    exec(compile(m.apply(pathlib.Path(path).read_bytes()), path, "exec"), ns)
    patched: set[str] = set()
    seen: set[int] = set()

    def patch_function(old, new, qualname: str) -> None:
        if (isinstance(old, types.FunctionType) and isinstance(new, types.FunctionType)
                and old.__code__.co_filename == path):
            try:
                old.__code__ = new.__code__
            except ValueError:                # a different set of closure variables
                return
            old.__defaults__, old.__kwdefaults__ = new.__defaults__, new.__kwdefaults__
            patched.add(qualname)

    def walk(old_ns: dict, new_ns: dict, prefix: str) -> None:
        for key, old in list(old_ns.items()):
            new = new_ns.get(key)
            if new is None or id(old) in seen:
                continue
            seen.add(id(old))
            if isinstance(old, type) and isinstance(new, type) and old.__module__ == name:
                walk(dict(vars(old)), dict(vars(new)), prefix + key + ".")
            elif isinstance(old, property) and isinstance(new, property):
                for part in ("fget", "fset", "fdel"):
                    patch_function(getattr(old, part), getattr(new, part), prefix + key)
            elif isinstance(old, (staticmethod, classmethod)) and type(new) is type(old):
                patch_function(old.__func__, new.__func__, prefix + key)
            else:
                patch_function(old, new, prefix + key)

    walk(vars(mod), ns, "")
    return m.function in patched


def _child(workdir: pathlib.Path, tests: list[str], fraction: float, log: pathlib.Path,
           trace: pathlib.Path | None, mutant: Mutant | None, fresh: bool) -> None:
    """In the forked child: run pytest; exit with pytest's status.

    Not ``fresh``: the modules are already imported (from the shared copy, by ``preload``) and the
    mutant is patched into them in memory. ``fresh``: forget every module of the copy and import
    them again from ``workdir``, where the mutant was written to disk (a mutant that runs at import).
    With ``trace``, also record which lines of the modules under test each test executes, and how
    long it takes, into that JSON file (the unmutated run that chooses every mutant's tests)."""
    os.setpgid(0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(workdir)
    src = str(workdir / "src")
    if fresh:
        shared = str(workdir.parent)
        for key, mod in list(sys.modules.items()):
            if str(getattr(mod, "__file__", None) or "").startswith(shared):
                del sys.modules[key]
        sys.path[:] = [p for p in sys.path if not p.startswith(shared)]
    sys.path[:] = [src] + [p for p in sys.path if not p.startswith(str(ROOT))]
    os.environ["PYTHONPATH"] = src                # for the tests' own subprocesses
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"    # finding entry points costs ~2 s a run
    sys.dont_write_bytecode = True
    if mutant is not None and not fresh:
        try:
            patched = _patch(mutant)
        except Exception:             # the mutated module cannot even be run (a module-level object
            os._exit(96)              # it builds now fails): nothing could import it, it is killed
        if not patched:
            os._exit(97)
    import json
    import threading

    import hypothesis
    import pytest

    package = os.path.join(src, "minicb") + os.sep
    targets = {os.path.join(package, m): m for m in MODULES}

    class Plugin:
        """Fewer examples for every property test (and state machine); optionally, the line tracer."""

        def __init__(self) -> None:
            self.record: dict[str, dict] = {}
            self.lines: set[tuple[str, int]] = set()

        def pytest_collection_modifyitems(self, items) -> None:
            def scaled(s):
                return hypothesis.settings(s, max_examples=max(2, int(s.max_examples * fraction)))

            for item in items:
                fn = getattr(item, "obj", None)
                inner = getattr(fn, "_hypothesis_internal_use_settings", None)
                if inner is not None:
                    fn._hypothesis_internal_use_settings = scaled(inner)
                cls = getattr(item, "cls", None)
                if cls is not None and isinstance(getattr(cls, "settings", None), hypothesis.settings):
                    if not getattr(cls, "_mutate_scaled", False):
                        cls.settings, cls._mutate_scaled = scaled(cls.settings), True

        def _global(self, frame, event, arg):
            rel = targets.get(frame.f_code.co_filename)
            if rel is None:
                return None
            lines = self.lines

            def local(frame, event, arg):
                if event == "line":
                    lines.add((rel, frame.f_lineno))
                return local

            lines.add((rel, frame.f_lineno))
            return local

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            if trace is None:
                yield
                return
            self.lines = set()
            sys.settrace(self._global)
            threading.settrace(self._global)
            t = time.perf_counter()
            yield
            sys.settrace(None)
            threading.settrace(None)
            lines: dict[str, list[int]] = {}
            for rel, n in self.lines:
                lines.setdefault(rel, []).append(n)
            self.record[item.nodeid] = {"seconds": time.perf_counter() - t, "lines": lines}

    plugin = Plugin()
    t0 = time.perf_counter()
    rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-p", "_hypothesis_pytestplugin", "--no-header",
                      "--assert=plain", "-o", "addopts=", *tests], plugins=[plugin])
    print(f"pytest.main took {time.perf_counter() - t0:.1f}s")
    loaded = sys.modules.get("minicb")
    if loaded is None or not str(getattr(loaded, "__file__", "")).startswith(src):
        rc = 99                                   # the copy was not what the tests imported: no verdict
    if trace is not None:
        trace.write_text(json.dumps(plugin.record))
    sys.stdout.flush()
    os._exit(int(rc))


def preload(shared: pathlib.Path, test_files: list[str]) -> None:
    """Import, once and in this process, what every forked child would import again: torch, pytest,
    hypothesis (with the quick profile: derandomized, no shrinking), the package from the shared copy,
    and the test modules as pytest imports them (by their file name, their folder on ``sys.path``)."""
    import importlib
    import pkgutil

    import hypothesis
    import pytest  # noqa: F401
    import torch  # noqa: F401

    hypothesis.settings.register_profile(
        "mutate", derandomize=True, database=None, deadline=None, print_blob=False,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck))
    hypothesis.settings.load_profile("mutate")
    for extra in ("_hypothesis_pytestplugin",):
        try:
            importlib.import_module(extra)
        except Exception:
            pass
    sys.path.insert(0, str(shared / "src"))
    import minicb

    for info in pkgutil.walk_packages(minicb.__path__, "minicb."):
        try:
            importlib.import_module(info.name)
        except Exception:
            pass
    for folder in ("tests", "tests/core", "tests/model"):        # pyproject's pytest pythonpath
        sys.path.insert(0, str(shared / folder))
    for f in ["tests/conftest.py"] + test_files:
        path = shared / f
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        try:
            importlib.import_module(path.stem)
        except Exception:
            sys.modules.pop(path.stem, None)


class Worker:
    """One copy of src/ and tests/, and at most one forked pytest on it."""

    def __init__(self, root: pathlib.Path, index: int) -> None:
        self.dir = root / f"w{index}"
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
        for name in ("src", "tests"):
            shutil.copytree(ROOT / name, self.dir / name, ignore=ignore)
        shutil.copy(ROOT / "pyproject.toml", self.dir / "pyproject.toml")
        self.log = root / f"w{index}.log"
        self.pid: int | None = None
        self.job = None
        self.mutated: str | None = None          # the module this copy holds mutated

    def start(self, job: Job, fraction: float, shared: pathlib.Path) -> None:
        if self.mutated is not None:                  # undo the previous mutant first
            (self.dir / "src" / "minicb" / self.mutated).write_bytes(source_of(self.mutated))
            self.mutated = None
        m = job.mutant
        if m is not None and job.fresh:
            (self.dir / "src" / "minicb" / m.rel).write_bytes(m.apply(source_of(m.rel)))
            self.mutated = m.rel
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(self.dir if job.fresh else shared, job.tests, fraction, self.log, job.trace,
                       job.mutant, job.fresh)
            finally:
                os._exit(98)
        self.pid, self.job = pid, job
        self.started = time.monotonic()
        self.deadline = self.started + job.timeout

    def poll(self) -> tuple[Job, str, float] | None:
        """``(job, verdict, seconds)`` once the child ended (or was killed at its timeout), else None."""
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            if time.monotonic() < self.deadline:
                return None
            self.kill()
            os.waitpid(self.pid, 0)
            verdict = "timeout"
        else:
            rc = os.waitstatus_to_exitcode(status)
            # 96: the mutated module raises when run (killed); 97: the mutant could not be patched in,
            # 98: the child failed otherwise: both are tried again by a fresh import of the mutated file
            verdict = {0: "survived", 1: "killed", 2: "killed", 96: "killed", 97: "unpatched",
                       98: "unpatched", 99: "not-loaded"}.get(rc, f"pytest exit {rc}")
        job, self.pid, self.job = self.job, None, None
        return job, verdict, time.monotonic() - self.started

    def kill(self) -> None:
        if self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclasses.dataclass
class Job:
    mutant: Mutant | None
    tests: list[str]
    timeout: float
    trace: pathlib.Path | None = None
    fresh: bool = False                # import everything afresh (the mutant runs at import)


def run_jobs(workers: list[Worker], jobs: list[Job], fraction: float, report, shared) -> None:
    """Run ``jobs`` on the workers, two (or ``--workers``) at a time; ``report(job, verdict, seconds)``."""
    pending = list(jobs)
    while pending or any(w.pid is not None for w in workers):
        for w in workers:
            if w.pid is not None:
                done = w.poll()
                if done:
                    report(*done)
            if w.pid is None and pending:
                job = pending.pop(0)
                w.start(job, fraction, shared)
        time.sleep(0.02)


def choose_tests(m: Mutant, trace: dict[str, dict]) -> list[str]:
    """The tests that execute the mutated lines, fastest first; for a mutant that runs at import (a
    module constant, a default argument) or that no traced test reaches (a test in a subprocess),
    every test of its module."""
    suite = [t for t in trace if any(t == p or t.startswith(p.rstrip("/") + "/") or t.startswith(p + "::")
                                     for p in tests_for(m.rel))]
    span = set(range(m.line, (m.last_line or m.line) + 1))
    covering = [t for t in suite if span & set(trace[t]["lines"].get(m.rel, ()))] if m.at_runtime else []
    return sorted(covering or suite, key=lambda t: trace[t]["seconds"])


# --- the driver -------------------------------------------------------------------------------------------
# Operators only ``--all`` uses: ``not`` dropped, ``+``/``-`` swapped, ``in``/``not in``, a flipped
# ``True``/``False`` (their mutants die with the others of their line; the default leaves them out).
EXTRA_OPERATORS = {"`not`", "`+`", "`-`", "`in`", "`True`", "`False`"}


def one_per_line(mutants: list[Mutant]) -> list[Mutant]:
    """The first mutant of every line (a dropped statement, else the leftmost operator): a line's
    mutants nearly always live or die together, and a run of all of them takes twice as long."""
    seen: set[tuple[str, int]] = set()
    kept = []
    for m in mutants:
        if (m.rel, m.line) not in seen:
            seen.add((m.rel, m.line))
            kept.append(m)
    return kept


def spread(items: list, n: int) -> list:
    if n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", action="append", default=[],
                    help="only the modules whose path (as core/planner.py) contains this; repeatable")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    ap.add_argument("--max", type=int, default=None, metavar="N", help="at most N mutants, spread evenly")
    ap.add_argument("--only", metavar="FILE", help="only the mutants listed in FILE, one per line as the "
                    "survivors are printed (`core/planner.py:61 statement dropped ...`), or as "
                    "`mutation line-text`")
    ap.add_argument("--all", action="store_true",
                    help="every mutant of every line, with the extra operators (about 1.6x the mutants)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--verbose", "-v", action="store_true", help="one line per mutant run, with its time")
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="share of each property test's examples in the quick pass (default 0.25)")
    args = ap.parse_args(argv)

    files = [p for p in target_files()
             if not args.module or any(s in p.relative_to(PACKAGE).as_posix() for s in args.module)]
    mutants = [m for p in files for m in find_mutants(p)]
    if not args.all:
        mutants = one_per_line([m for m in mutants if m.description.split()[0] not in EXTRA_OPERATORS])
    if args.only:                   # lines as printed: "module:line  mutation  the line's text"
        wanted = [" ".join(line.split()) for line in pathlib.Path(args.only).read_text().splitlines()]
        mutants = [m for m in mutants
                   if " ".join(f"{m.where} {m.description} {line_text(m)}".split()) in wanted
                   or " ".join(f"{m.description} {line_text(m)}".split()) in wanted
                   or any(w.startswith(" ".join(f"{m.where} {m.description} ".split()) + " ")
                          for w in wanted)]
    if args.max is not None:
        mutants = spread(mutants, args.max)
    equivalent = {m: r for m in mutants if (r := equivalence_reason(m)) is not None}
    if args.list:
        for m in mutants:
            tag = "  [equivalent]" if m in equivalent else ""
            print(f"{m.where:32} {m.description:28} {line_text(m)}{tag}")
        print(f"{len(mutants)} mutants in {len(files)} modules")
        for p in files:
            rel = p.relative_to(PACKAGE).as_posix()
            count = sum(m.rel == rel for m in mutants)
            print(f"  {rel:28} {count:4} mutants  tests: {' '.join(tests_for(rel))}")
        return 0

    rels = sorted({m.rel for m in mutants})
    print(f"{len(mutants)} mutants in {len(rels)} modules, {len(equivalent)} listed as equivalent; "
          f"{args.workers} workers", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):      # a kill cleans up like Ctrl-C (even run in background)
        signal.signal(sig, signal.default_int_handler)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="minicb-mutate-"))
    workers: list[Worker] = []
    t0 = time.monotonic()
    verdicts: dict[Mutant, str] = {}
    chosen: dict[Mutant, list[str]] = {}
    try:
        shared = Worker(tmp, "shared").dir
        workers = [Worker(tmp, i) for i in range(args.workers)]
        paths = sorted({p for rel in rels for p in tests_for(rel)})
        files = sorted({str(f.relative_to(ROOT)) for p in paths
                        for f in ([ROOT / p] if p.endswith(".py") else (ROOT / p).rglob("test_*.py"))})
        preload(shared, files)
        # 1. the unmutated code, traced: it must pass, and it tells which tests execute which lines
        groups = [files[i::args.workers] for i in range(args.workers)]
        jobs = [Job(None, g, 1800, tmp / f"trace{i}.json") for i, g in enumerate(groups) if g]
        failed: list[str] = []

        def on_trace(job, verdict, seconds):
            if verdict != "survived":
                failed.append(f"{' '.join(job.tests)}: {verdict}")

        run_jobs(workers, jobs, args.fraction, on_trace, shared)
        if failed:
            print("the unmutated code fails its tests, no verdict possible:\n  " + "\n  ".join(failed))
            return 2
        import json

        trace: dict[str, dict] = {}
        for job in jobs:
            trace.update(json.loads(job.trace.read_text()))
        print(f"traced {len(trace)} tests in {time.monotonic() - t0:.0f}s", flush=True)

        def job_for(m: Mutant, scale: float) -> Job:
            tests = chosen[m] = choose_tests(m, trace)
            return Job(m, tests, 30 + 3 * scale * sum(trace[t]["seconds"] for t in tests),
                       fresh=not m.at_runtime)

        done = [0]

        def on_result(job, verdict, seconds):
            verdicts[job.mutant] = verdict
            done[0] += 1
            if args.verbose:
                print(f"  {job.mutant.where:32} {job.mutant.description:24} {verdict:10} {seconds:5.1f}s "
                      f"{len(job.tests)} tests", flush=True)
            elif done[0] % 50 == 0 or done[0] == len(todo):
                print(f"  {done[0]}/{len(todo)} run, {time.monotonic() - t0:.0f}s", flush=True)

        # 2. the quick pass, then 3. every survivor again with all the examples
        todo = [job_for(m, 1.0) for m in mutants]
        run_jobs(workers, todo, args.fraction, on_result, shared)
        todo = [dataclasses.replace(job_for(m, 1.0), fresh=True)
                for m in mutants if verdicts[m] == "unpatched"]
        if todo:
            print(f"{len(todo)} mutants could not be patched in memory: importing afresh", flush=True)
            done[0] = 0
            run_jobs(workers, todo, args.fraction, on_result, shared)
        todo = [job_for(m, 1.0 / args.fraction) for m in mutants if verdicts[m] == "survived"]
        if todo and args.fraction < 1.0:
            print(f"rerunning {len(todo)} survivors with every example", flush=True)
            done[0] = 0
            run_jobs(workers, todo, 1.0, on_result, shared)
    except KeyboardInterrupt:
        print("\ninterrupted: the working tree was never modified; removing the copies")
        return 130
    finally:
        for w in workers:
            w.kill()
        if os.environ.get("MINICB_MUTATE_KEEP"):
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    return summarize(mutants, verdicts, equivalent, time.monotonic() - t0)


def summarize(mutants, verdicts, equivalent, seconds) -> int:
    odd = [m for m in mutants if verdicts[m] not in ("killed", "survived", "timeout")]
    if odd:
        print("mutants without a verdict (counted as survivors):")
        for m in odd:
            print(f"  {m.where:32} {m.description:28} {verdicts[m]}")
    killed = {m for m in mutants if verdicts[m] in ("killed", "timeout")}
    stale = [m for m in equivalent if m in killed]
    survivors = [m for m in mutants if m not in killed and m not in equivalent]
    scored = len(mutants) - len(equivalent) + len(stale)
    print(f"\nequivalent mutants ({len(equivalent) - len(stale)}, not scored):")
    for m, reason in equivalent.items():
        if m not in killed:
            print(f"  {m.where:32} {m.description:24} {reason}")
    if stale:
        print("listed as equivalent but killed (remove them from EQUIVALENT; scored as killed):")
        for m in stale:
            print(f"  {m.where:32} {m.description}")
    print(f"\nsurvivors ({len(survivors)}):")
    for m in survivors:
        print(f"  {m.where:32} {m.description:24} {line_text(m)}")
    timeouts = sum(verdicts[m] == "timeout" for m in mutants)
    score = 100.0 * (scored - len(survivors)) / scored if scored else 100.0
    print(f"\nscore: {score:.1f}%  ({scored - len(survivors)} of {scored} killed, {timeouts} of them by "
          f"timeout; {len(mutants)} mutants, {len(equivalent) - len(stale)} equivalent) in {seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
