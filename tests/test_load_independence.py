"""No test may depend on how loaded the machine is: every assert that reads a clock says why it cannot.

CI runs on shared, busy machines, so a test that asserts "this took less than 2 s" or "these chunks came
less than 0.1 s apart" passes on a quiet machine and fails on a loaded one: a flake, which teaches people
to ignore red runs. Timing behaviour is asserted in steps, on a fake clock, or as a ratio against a
reference measured in the same test; a *lower* bound on a wait ("the deadline, not a dead socket, ended
it") is safe too, because load only makes waits longer.

This test does not trust a hand-kept list of "the timing tests". It reads every Python file under
``tests/`` and finds, by the syntax tree, every ``assert`` whose expression uses a value derived from a
clock (``time.monotonic``/``perf_counter``/``time.time``/``process_time``, a process's CPU seconds), directly
or through assignments in the same function, or a name that says it holds a time (``took``, ``elapsed``,
``gap``, ``latency``, ...). Each such assert must carry a ``# load-independent: <why>`` comment on one
of its lines (or in the comment lines right above it); the reasons are read by a person, the
enumeration is done here. The tests that really run against the wall clock are also marked ``timing``
and run under a CPU hog by ``make test-hog``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "process_time", "thread_time",
          "cpu_seconds"}
TIME_WORDS = re.compile(r"^(took|elapsed|wall|gaps?|durations?|seconds|latenc(y|ies)|ttft|itls?|tpot|"
                        r"delay|waited|spent)(_.*)?$|_(took|elapsed|seconds|latency|gap)$")
MARK = "load-independent:"


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name in CLOCKS:
        return True
    # time.time() (the attribute "time" of a name "time"), not any ".time()" method
    return (name == "time" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            and f.value.id == "time")


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _attrs(node: ast.AST) -> set[str]:
    """Attribute names and subscript keys: ``r.took``, ``r["seconds"]``."""
    return ({n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            | {n.slice.value for n in ast.walk(node) if isinstance(n, ast.Subscript)
               and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)})


def _says_time(node: ast.AST) -> bool:
    return any(TIME_WORDS.search(n) for n in _names(node) | _attrs(node))


def _reads_clock(node: ast.AST, tainted: set[str]) -> bool:
    return (any(_is_clock_call(n) for n in ast.walk(node)) or bool(_names(node) & tainted)
            or _says_time(node))


def _targets(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _tainted_names(func: ast.AST) -> set[str]:
    """Names assigned (anywhere in ``func``) from a clock or from other such names, to a fixed point."""
    tainted: set[str] = set()
    assigns = [n for n in ast.walk(func) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               and n.value is not None]
    # xs.append(clock-derived) / xs.extend(...) taints the list xs
    appends = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("append", "extend", "add", "insert")
               and isinstance(n.func.value, ast.Name)]
    changed = True
    while changed:
        changed = False
        for call in appends:
            if call.func.value.id not in tainted and any(_reads_clock(a, tainted) for a in call.args):
                tainted.add(call.func.value.id)
                changed = True
        for a in assigns:
            targets = set().union(*(_targets(t) for t in (a.targets if isinstance(a, ast.Assign)
                                                            else [a.target])))
            if targets - tainted and _reads_clock(a.value, tainted):
                tainted |= targets
                changed = True
    return tainted


def clock_asserts(path: Path) -> list[tuple[int, int, str]]:
    """``(first line, last line, source)`` of every assert in ``path`` that reads a clock or a time."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    found = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        tainted = _tainted_names(scope)
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assert):
                continue
            if _reads_clock(node.test, tainted):
                found.append((node.lineno, node.end_lineno or node.lineno,
                              ast.get_source_segment(text, node)))
    return sorted(set(found))


def test_every_clock_reading_assert_says_why_load_cannot_break_it():
    lines_of: dict[Path, list[str]] = {}
    missing, seen = [], 0
    for path in sorted(TESTS.rglob("*.py")):
        for first, last, src in clock_asserts(path):
            seen += 1
            lines = lines_of.setdefault(path, path.read_text(encoding="utf-8").splitlines())
            above, i = [], first - 1          # the block of comment lines right above the assert
            while i >= 1 and lines[i - 1].strip().startswith("#"):
                above.append(lines[i - 1])
                i -= 1
            if not any(MARK in x for x in lines[first - 1:last] + above):
                missing.append(f"{path.relative_to(TESTS)}:{first}: {src.splitlines()[0][:100]}")
    print(f"{seen} asserts read a clock or a time; {len(missing)} without a reason")
    assert seen > 0, "the scan found no timing assert at all: it is broken (this file has examples)"
    assert not missing, ("asserts on times with no '# load-independent: <why>' comment (measure in "
                         "steps, a fake clock, or a same-test ratio, then say so):\n  "
                         + "\n  ".join(missing))


def test_the_scan_finds_what_it_must_and_only_that(tmp_path):
    """The scanner itself, on code written to be caught and code written not to be."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import time\n"
        "def test_a():\n"
        "    t0 = time.monotonic()\n"
        "    work()\n"
        "    dt = time.monotonic() - t0\n"
        "    x = dt * 2\n"
        "    assert x < 3\n"                       # 7: through two assignments
        "def test_b():\n"
        "    assert time.perf_counter() > 0\n"     # 9: a clock call in the assert
        "def test_c(r):\n"
        "    assert r.took >= 1.5\n"               # 11: a name that says it is a time
        "def test_d(p):\n"
        "    assert p.cpu_seconds() < 1\n"         # 13: CPU seconds
        "def test_e(q):\n"
        "    n = q.time()\n"                       # a method called time is not the clock
        "    assert n == 3 and len(q) == 2\n"
        "def test_f(results):\n"
        "    gaps = []\n"
        "    for r in results:\n"
        "        gaps.append(time.monotonic() - r)\n"
        "    ratio = max(gaps) / 2\n"
        "    assert ratio < 15\n"                 # 22: through a list's append
        "    assert all(r['seconds'] < 9 for r in results)\n")   # 23: a key that says it is a time
    assert [first for first, _, _ in clock_asserts(sample)] == [7, 9, 11, 13, 22, 23]


def test_no_hypothesis_profile_has_a_deadline_or_a_speed_health_check():
    """Hypothesis times every example (200 ms by default) and the generation of its data: a wall clock."""
    from hypothesis import HealthCheck, settings

    import hypothesis_profiles  # noqa: F401  (conftest loads it; imported here to be explicit)

    for name in ("thorough", "quick"):
        profile = settings.get_profile(name)
        assert profile.deadline is None, name
        assert HealthCheck.too_slow in profile.suppress_health_check, name
