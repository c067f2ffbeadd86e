"""The simulator's speed against another checkout's: CPU seconds of ``minicb simulate``, alternately.

    python bench/sim_speed.py /tmp/turn3                 # 3 rounds of old, new on issue 47's run
    python bench/sim_speed.py /tmp/turn3 --rounds 5 --args "--num-requests 100 --rates 4"

``OLD`` is a checkout of minicb (a git worktree of an older commit, say ``git worktree add /tmp/turn3
6d050e2``); "new" is the checkout this script sits in. Each round runs the old code, then the new, each
as a child process with that checkout's ``src`` first on ``PYTHONPATH``; the figure is the child's
user + system CPU time (``os.wait4``), which a busy machine changes far less than the wall clock, and
alternating spreads what load there is over both. Same results or it does not count: the numbers of
every row of the printed tables must be the same for both (the table's layout may differ between
versions; the line that gives the wall time is left out).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_times import cpu_name  # noqa: E402  (the CPU's model name, torch-free)

ROOT = Path(__file__).resolve().parents[1]
ARGS = "--num-requests 400 --rates 4 --policy all"      # issue 47's figure: 3 policies x 400 requests
# the command-line entry point moved (minicb.cli -> minicb.entrypoints.cli): take whichever exists
CHILD = """import sys
try:
    from minicb.entrypoints.cli import main
except ImportError:
    from minicb.cli import main
sys.exit(main(['simulate', *sys.argv[1:], '--no-progress']))
"""


def run(tree: Path, args: list[str]) -> tuple[float, str]:
    """(CPU seconds, stdout) of one ``minicb simulate`` with ``tree``'s code."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), NO_COLOR="1")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # files: nothing blocks
        proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=tree, env=env, stdout=out,
                                stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if rc:
            sys.exit(f"{tree}: exit {rc}\n{err.read().decode(errors='replace')[-2000:]}")
        return usage.ru_utime + usage.ru_stime, out.read().decode()


def table_numbers(text: str) -> dict[str, list[str]]:
    """Each policy row's numbers, in column order, from a printed table (one wide table, or one
    wrapped into several: a row's numbers are joined across them)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"(\S+ @ \S+)\s+(.*)", line)
        if m:
            rows.setdefault(m.group(1), []).extend(m.group(2).split())
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, help="the other checkout (its src/ holds minicb)")
    ap.add_argument("--rounds", type=int, default=3, help="old, new pairs (default 3)")
    ap.add_argument("--args", default=ARGS, help=f"minicb simulate's arguments (default {ARGS!r})")
    a = ap.parse_args()
    if not (a.old / "src" / "minicb").is_dir():
        sys.exit(f"{a.old} is not a minicb checkout (no src/minicb)")
    args = shlex.split(a.args)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; minicb simulate {a.args}")
    print(f"{'round':>5} {'old CPU s':>10} {'new CPU s':>10}")
    old_t, new_t, tables = [], [], set()
    for k in range(1, a.rounds + 1):
        t_old, out_old = run(a.old.resolve(), args)
        t_new, out_new = run(ROOT, args)
        old_t.append(t_old)
        new_t.append(t_new)
        print(f"{k:>5} {t_old:10.2f} {t_new:10.2f}", flush=True)
        same = table_numbers(out_old) == table_numbers(out_new) != {}
        tables.add(same)
        if not same:
            print(f"the results differ:\n--- old\n{out_old}\n--- new\n{out_new}")
    mo, mn = statistics.median(old_t), statistics.median(new_t)
    print(f"median: old {mo:.2f} s, new {mn:.2f} s CPU: new is {mo / mn:.2f}x as fast; "
          f"results {'identical' if tables == {True} else 'DIFFERENT'}")
    return 0 if tables == {True} else 1


if __name__ == "__main__":
    sys.exit(main())
