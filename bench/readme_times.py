"""How long the commands the README and ``minicb --help`` put a time on take here: wall clock and CPU.

    python bench/readme_times.py                  # every command below, once each
    python bench/readme_times.py --only demo      # the ones whose name contains "demo"

Each command runs as a child process from the repository's top, as a reader would type it (``minicb``
as ``python -m minicb``, progress lines off, output thrown away, ``--out`` into a temporary folder);
the CPU time is the child's user + system time (``os.wait4``), which a busy machine changes far less
than the wall clock. The README quotes what this prints, with the machine it printed it on.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, the command as the README or the help text shows it, where it is quoted)
COMMANDS = [
    ("demo --no-model", "minicb demo --no-model", "minicb demo --help"),
    ("demo", "minicb demo", "README, Quickstart (make demo after set-up)"),
    ("simulate", "minicb simulate", "README, Measuring it; minicb simulate --help"),
    ("tiny bench", "minicb bench --model tiny --num-requests 12 --rate 20 --out {tmp}/b",
     "README, Measuring it"),
]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(command: str, tmp: str) -> tuple[float, float, int]:
    """(wall s, CPU s, exit code) of one command."""
    argv = [sys.executable, "-m", "minicb", *command.format(tmp=tmp).split()[1:]]
    env = dict(os.environ, MINICB_PROGRESS="0", NO_COLOR="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile() as err:          # a file, not a pipe: nothing blocks the child
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        if rc:
            err.seek(0)
            sys.stderr.write(err.read().decode(errors="replace")[-2000:])
    return wall, usage.ru_utime + usage.ru_stime, rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the commands whose name contains this")
    args = ap.parse_args()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"{'command':<72} {'wall s':>7} {'CPU s':>7}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, command, _where in COMMANDS:
            if args.only not in name:
                continue
            wall, cpu, rc = run(command, tmp)
            failed += rc != 0
            print(f"{command:<72} {wall:7.1f} {cpu:7.1f}" + (f"  (exit {rc})" if rc else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
