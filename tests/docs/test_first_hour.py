"""A newcomer's first hour, as the README tells it (issue 45): on a fresh copy of the repository with
no venv, the Quickstart block runs as written, and then every command of the first block under
"Using it", as written, in the venv the Quickstart made (activated as the README says): all exit 0.

Two concessions to the test's running time (about 3 minutes instead of the half hour a truly fresh
run takes), both through the Makefile's own variables and the environment, none through the README's
text:

* the test makes ``.venv`` itself (``python -m venv .venv``, as the Makefile would) and adds this
  interpreter's site-packages to it (a ``.pth`` line), so PyTorch and the other dependencies already
  installed here are reused instead of installed again; the Makefile's set-up then runs every phase
  into that venv, and installs whatever is missing (minicb itself, from the copy, in editable mode);
* ``make test`` runs with ``PYTEST_ADDOPTS=--collect-only``: its set-up and the collection of the
  whole suite run, not the suite itself (which is this run).

The figures the README quotes from ``bench/readme_times.py`` are checked to come from it: each time
quoted beside a command is a command the script measures.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import site
import subprocess
import sys

import pytest

from preconditions import unavailable

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def first_bash_block(section: str) -> str:
    """The first ``bash`` block after the README heading ``section``."""
    start = README.index(f"\n## {section}\n")
    return re.search(r"^```bash\n(.*?)^```", README[start:], re.S | re.M).group(1)


def commands(block: str) -> list[str]:
    """A block's command lines (continuations joined), as written, comments and all."""
    return [ln for ln in re.sub(r"\\\n\s*", " ", block).splitlines() if ln.strip()]


def fresh_copy(dest: pathlib.Path) -> pathlib.Path:
    """What a clone of this working tree holds: the tracked and the untracked, not ignored files."""
    if shutil.which("git") is None:
        unavailable("git is needed to list the repository's files")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_the_blocks_are_found():
    assert [c.split("#")[0].strip() for c in commands(first_bash_block("Quickstart"))] == ["make demo",
                                                                                          "make test"]
    assert commands(first_bash_block("Using it"))[0].startswith("minicb ")


@pytest.mark.slow
@pytest.mark.model
def test_quickstart_then_using_it_on_a_fresh_copy(tmp_path, smollm2_path):
    if shutil.which("make") is None:
        unavailable("make is needed for the Quickstart")
    repo = fresh_copy(tmp_path / "minicb")
    assert not (repo / ".venv").exists() and not list(repo.glob(".setup*"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHON")}
    env.update(PYTEST_ADDOPTS="--collect-only -q", MINICB_PROGRESS="0")
    venv = repo / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    vsite = subprocess.run([venv / "bin" / "python", "-c", "import site; print(site.getsitepackages()[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(vsite, "zz_reuse.pth").write_text(site.getsitepackages()[0] + "\n")   # after minicb's

    def bash(line: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", line], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout)

    for line in commands(first_bash_block("Quickstart")):
        run = bash(line)
        assert run.returncode == 0, (line, run.stdout[-2000:], run.stderr[-2000:])
    assert (repo / ".venv" / "bin" / "python").exists()
    where = bash(". .venv/bin/activate && python -c 'import minicb; print(minicb.__file__)'").stdout
    assert where.startswith(str(repo / "src")), where        # the copy's minicb, from the venv
    for line in commands(first_bash_block("Using it")):     # activated as the README says
        run = bash(f". .venv/bin/activate && {line}")
        assert run.returncode == 0, (line, run.stderr[-2000:])
        assert run.stdout.strip(), (line, "printed nothing")


def test_each_cpu_time_the_readme_quotes_is_a_command_readme_times_measures():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import readme_times
    finally:
        sys.path.remove(str(ROOT / "bench"))
    measured = {c.split(" --out")[0] for _, c, _ in readme_times.COMMANDS}
    quoted = [ln.split("#")[0].strip() for ln in README.splitlines()
              if re.search(r"#.*\b\d+ s CPU", ln)]
    assert quoted and all(q.split(" --out")[0] in measured for q in quoted), (quoted, measured)


@pytest.mark.slow
def test_readme_times_measures_a_command():
    run = subprocess.run([sys.executable, "bench/readme_times.py", "--only", "demo --no-model"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    row = run.stdout.splitlines()[-1].split()
    assert row[:3] == ["minicb", "demo", "--no-model"] and float(row[3]) > 0 and float(row[4]) > 0
