"""The shape of the core, measured: its longest class and function, and how long the continuous
policy's schedule is. For keeping the heart readable in one sitting.

    python bench/core_shape.py [SRC_DIR]        # default: src/minicb/core of this checkout

Counts lines of source (``end_lineno - lineno + 1``, docstrings included) with ``ast``; the schedule
is every function whose name says it plans the continuous policy's step (``schedule`` of a
continuous policy class, or ``_schedule_continuous`` and the ``_schedule_*`` steps it calls).
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def shapes(folder: pathlib.Path):
    classes, funcs = [], []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            n = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            where = f"{path.relative_to(folder)}:{getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef):
                classes.append((n, where, sum(isinstance(b, ast.FunctionDef) for b in node.body)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((n, where))
    return sorted(classes, reverse=True), sorted(funcs, reverse=True)


def main() -> None:
    folder = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "src" / "minicb" / "core"
    classes, funcs = shapes(folder)
    print(f"core: {folder}")
    print("longest classes:", ", ".join(f"{w} {n} lines ({m} methods)" for n, w, m in classes[:3]))
    print("longest functions:", ", ".join(f"{w} {n} lines" for n, w in funcs[:3]))
    sched = [(n, w) for n, w in funcs if w.split(":")[1] in
             ("_schedule_continuous", "_schedule_running", "_make_room", "_schedule_swapped",
              "_schedule_waiting")
             or (w.split(":")[1] == "schedule" and "continuous" in w)]
    total = sum(n for n, _ in sched)
    print("continuous schedule:", ", ".join(f"{w} {n}" for n, w in sched), f"= {total} lines")


if __name__ == "__main__":
    main()
