"""Run pytest while every core it may use is kept busy by a spinning process (a "CPU hog").

    python tests/under_hog.py                      # the tests marked `timing`, twice, under the hog
    python tests/under_hog.py --times 1 -- -q tests/serve/test_serve.py
    make test-hog                                  # the same as the first line

A test must not depend on how loaded the machine is (CI shares its machines): this is how that is
checked. One ``python -c 'while True: pass'`` process per core pytest may run on (its CPU affinity),
each pinned to its core, so the tests get about half of every core; pytest and its subprocesses keep
the affinity of this process. The hogs are stopped (by their process ids) however pytest ends, and
the CPU time they burnt is printed, to show they competed. Exit code: the first failing run's, else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEFAULT_PYTEST_ARGS = ["-q", "-m", "timing", "tests"]


def start_hogs(cores: list[int]) -> list[subprocess.Popen]:
    hogs = []
    for core in cores:
        h = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(h.pid, {core})
        hogs.append(h)
    return hogs


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc (Linux), or 0 where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--times", type=int, default=2, help="run pytest this many times in a row (default 2)")
    ap.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --; default: "
                                                   + " ".join(DEFAULT_PYTEST_ARGS) + ")")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    hogs = start_hogs(cores)
    t0 = time.monotonic()
    print(f"under_hog: {len(hogs)} spinning process(es) pinned to core(s) {cores} (pids "
          f"{[h.pid for h in hogs]})", flush=True)
    rc = 0
    try:
        for k in range(args.times):
            pytest_args = args.pytest_args or DEFAULT_PYTEST_ARGS
            print(f"under_hog: run {k + 1} of {args.times}: pytest {' '.join(pytest_args)}", flush=True)
            rc = subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
            if rc:
                break
    finally:
        burnt = sum(cpu_seconds(h.pid) for h in hogs)
        for h in hogs:
            h.kill()
            h.wait()
    wall = time.monotonic() - t0
    print(f"under_hog: the hogs used {burnt:.0f} s of CPU in {wall:.0f} s on {len(hogs)} core(s); "
          f"pytest exit code {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
