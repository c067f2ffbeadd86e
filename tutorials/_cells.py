"""The chapters' cell format, and a runner that keeps each cell's output apart.

A chapter is a plain Python script: ``python tutorials/NN_name.py`` runs it top
to bottom. Comment markers cut it into cells, the "percent" format that
Jupytext, VS Code and Spyder also read::

    \"\"\"Chapter 06: chunked prefill.      <- the docstring: the title,

    Run: python tutorials/06_chunked_prefill.py      the run line,
    Prerequisites: chapter 05.                       the prerequisites,

    Introduction ...                                 the introduction
    \"\"\"

    # %% [markdown]
    # Prose in Markdown, one comment line per line.

    # %%
    plans = run_scheduler(...)         <- a code cell: its output follows it
    print(plans[0])

    # %% helpers to draw a step        <- a titled code cell: the page folds it
    def picture(plan): ...

The page generator (``docs/gen_pages.py``) turns a chapter into a literate
page: prose, then a short code cell, then that cell's own output, in order. A
code cell that is only ``EXERCISES = [...]`` becomes the "Try it" section.

``run(path, flags)`` executes a chapter cell by cell in a fresh interpreter the
way ``python path flags`` would (a ``__main__`` module with the script's
``__file__``, its ``sys.argv``, the tutorials folder first on ``sys.path``), and
returns each code cell's standard output, the chapter's constants (its
UPPER_CASE names, as JSON) and its run time.
"""

import ast
import contextlib
import dataclasses
import io
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass

MARKER = "# %%"


@dataclass(slots=True, frozen=True)
class Cell:
    kind: str            # "markdown" or "code"
    text: str            # markdown without the comment signs; code as written
    lineno: int          # the first line of ``text`` in the script (1-based)
    title: str = ""      # a code cell's title (``# %% title``): page folds it

    @property
    def is_exercises(self) -> bool:
        """Is this the ``EXERCISES = [...]`` cell (the "Try it" section)?"""
        if self.kind != "code":
            return False
        body = ast.parse(self.text).body
        return (len(body) == 1 and isinstance(body[0], ast.Assign)
                and [getattr(t, "id", None) for t in body[0].targets]
                == ["EXERCISES"])


@dataclass(slots=True)
class ChapterRun:
    outputs: list[str]   # the standard output of each code cell, in order
    constants: dict      # the chapter's UPPER_CASE names after the run (JSON)
    seconds: float       # wall time of the whole run

    @property
    def stdout(self) -> str:
        return "".join(self.outputs)


def docstring(source: str) -> str:
    doc = ast.get_docstring(ast.parse(source))
    if not doc:
        raise ValueError("a chapter opens with a docstring: its title, run "
                         "line, prerequisites and introduction")
    return doc


def split(source: str) -> list[Cell]:
    """The cells of a chapter, after its docstring. Blank lines around a cell
    are dropped; a script without markers is one code cell."""
    lines = source.splitlines()
    first = ast.parse(source).body[0]
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = first.end_lineno if doc else 0
    cells: list[Cell] = []
    kind, title, body, body_start = "code", "", [], start + 1

    def close() -> None:
        nonlocal body_start
        while body and not body[0].strip():
            body.pop(0)
            body_start += 1
        while body and not body[-1].strip():
            body.pop()
        if not body:
            return
        if kind == "markdown":
            text = "\n".join(_uncomment(line, body_start + i)
                             for i, line in enumerate(body))
        else:
            text = "\n".join(body)
        cells.append(Cell(kind, text, body_start, title))

    for number, line in enumerate(lines[start:], start + 1):
        if line.startswith(MARKER):
            close()
            rest = line[len(MARKER):].strip()
            kind = "markdown" if rest.endswith("[markdown]") else "code"
            title = "" if kind == "markdown" else rest
            body, body_start = [], number + 1
        else:
            body.append(line)
    close()
    return cells


def _uncomment(line: str, number: int) -> str:
    if line.strip() == "#":
        return ""
    if not line.startswith("# "):
        raise ValueError(f"line {number}: a markdown cell's lines start with "
                         f"'# ', got {line!r}")
    return line[2:]


# --- running ------------------------------------------------------------------
def run(path, flags: tuple[str, ...] = (), timeout: float = 300.0
        ) -> ChapterRun:
    """Run the chapter at ``path`` with ``flags`` in a fresh interpreter, cell
    by cell. A failing chapter raises ``RuntimeError`` with its traceback."""
    path = pathlib.Path(path).resolve()
    with tempfile.TemporaryDirectory(prefix="minicb-cells-") as tmp:
        result = pathlib.Path(tmp) / "run.json"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, str(path), str(result), *flags],
            capture_output=True, text=True, timeout=timeout,
            cwd=path.parents[1])
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"{path.name} {' '.join(flags)} failed (exit {proc.returncode})"
                f":\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        data = json.loads(result.read_text())
    return ChapterRun(data["outputs"], data["constants"], seconds)


def _execute(path: pathlib.Path, flags: list[str]) -> dict:
    """In the child: run every code cell in one ``__main__`` module, capturing
    each one's standard output."""
    source = path.read_text()
    module = types.ModuleType("__main__", docstring(source))
    module.__file__ = str(path)
    sys.modules["__main__"] = module
    sys.argv = [str(path), *flags]
    sys.path[0] = str(path.parent)
    outputs = []
    for cell in split(source):
        if cell.kind != "code":
            continue
        # padded with newlines: a traceback names the script's own lines
        code = compile("\n" * (cell.lineno - 1) + cell.text, str(path), "exec",
                       dont_inherit=True)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(code, module.__dict__)
        outputs.append(buf.getvalue())
    constants = {}
    for name, value in vars(module).items():
        if name.isupper() and not name.startswith("_"):
            with contextlib.suppress(TypeError, ValueError):
                constants[name] = json.loads(json.dumps(value, default=_plain))
    return {"outputs": outputs, "constants": constants}


def _plain(value):
    """JSON for the dataclasses among a chapter's constants (``Exercise``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


if __name__ == "__main__":
    # python tutorials/_cells.py CHAPTER OUT.json [FLAGS...]   (what run() does)
    chapter, out, flags = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
    out.write_text(json.dumps(_execute(pathlib.Path(chapter).resolve(), flags)))
