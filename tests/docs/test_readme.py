"""Every command block of README.md runs (issue 29). The blocks are read from the README when the tests
are collected, never copied here, so an edited README is tested as written.

How each line of a ``bash`` block runs (from the repository's top, ``minicb`` as ``python -m minicb``,
any ``--out X`` redirected into a temporary directory):

* ``minicb ...``: run; exit 0 (the real model's lines are ``slow``); ``--out`` and ``--replay`` files
  go to a temporary directory. A line with ``--device cuda`` on
  a machine without CUDA must exit 2 with one line saying CUDA is needed.
* ``minicb serve``: started on a free port (8000 may be taken on a shared machine) until it says where
  it listens; the ``curl`` line and the ``openai`` block after it run against it, 8000 replaced by
  that port; then Ctrl-C must stop it with exit 0.
* ``torchrun --nnodes 2 ...`` (two machines): run as two processes here, ``--nnodes 1
  --nproc-per-node 2`` on 127.0.0.1 and a free port.
* ``make T``: ``make -n T`` (the suite cannot run ``make test`` inside itself): the target exists and
  its commands are there. What ``make demo`` runs is tested in tests/entrypoints/test_cli_first_minutes.py.
* ``python tutorials/...``: run. ``python bench/X.py FLAGS``: its ``--help`` must list every flag the
  line uses (the benchmarks take minutes; bench/RESULTS.md is what running them gives).
* ``bash bench/gpu_check.sh``: without CUDA it must exit 2 (its documented "no CUDA").

A ``python`` block is written to a file and run (the tensor-parallel one needs that: its ranks import
the file, hence its ``__main__`` guard). The ``text`` blocks are pictures; the first one, the slot
diagrams, must be what ``minicb demo`` draws today.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SRC = str(ROOT / "src")
REAL_MODEL_COMMANDS = ("generate", "serve", "bench")     # load SmolLM2 unless --model tiny


def readme_blocks() -> list[tuple[str, str, int]]:
    """``(language, text, first line number)`` of every fenced block of the README."""
    text = README.read_text()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        out.append((m.group(1), m.group(2), text[: m.start()].count("\n") + 2))
    return out


def block_commands(block: str) -> list[list[str]]:
    """A bash block's commands as argument lists: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def bash_commands() -> list[tuple[list[str], int]]:
    return [(cmd, line) for lang, text, line in readme_blocks() if lang == "bash"
            for cmd in block_commands(text)]


def python_blocks() -> list[tuple[str, int]]:
    return [(text, line) for lang, text, line in readme_blocks() if lang == "python"]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), NO_COLOR="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def redirect_out(cmd: list[str], tmp: pathlib.Path) -> list[str]:
    cmd = list(cmd)
    for i, word in enumerate(cmd[:-1]):
        if word in ("--out", "--replay"):
            cmd[i + 1] = str(tmp / pathlib.Path(cmd[i + 1]).name)
    return cmd


def run(argv: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout, **kw)


# --- the parametrisation: one test per command, marked slow where it loads SmolLM2 or runs long -------
def _is_real_model(cmd: list[str]) -> bool:
    return (cmd[0] == "minicb" and len(cmd) > 1 and cmd[1] in REAL_MODEL_COMMANDS
            and "tiny" not in cmd and "cuda" not in cmd)


def _cases():
    for cmd, line in bash_commands():
        if cmd[0] == "curl" or cmd[:2] == ["minicb", "serve"]:
            continue                                   # test_the_serving_examples
        slow = (_is_real_model(cmd) or cmd[0] == "torchrun" or cmd[:2] in (["minicb", "simulate"],
                                                                            ["minicb", "bench"])
                or "tutorials/" in " ".join(cmd))
        marks = [pytest.mark.slow] if slow else []
        yield pytest.param(cmd, id=f"L{line}: {' '.join(cmd)[:70]}", marks=marks)


@pytest.mark.parametrize("cmd", list(_cases()))
def test_a_readme_command_runs(cmd, tmp_path):
    cmd = redirect_out(cmd, tmp_path)
    head = cmd[0]
    if head == "make":
        p = run(["make", "-n", *cmd[1:]])
        assert p.returncode == 0 and "No rule" not in p.stderr, p.stderr
        assert p.stdout.strip(), f"make -n {cmd[1:]} shows no command"
    elif head == "minicb" and "cuda" in cmd and not cuda_available():
        p = run([sys.executable, "-m", "minicb", *cmd[1:]])
        assert p.returncode == 2 and p.stdout == "", p.stderr
        assert p.stderr.splitlines()[-1].startswith("minicb: error: device 'cuda' needs CUDA"), p.stderr
    elif head == "minicb":
        p = run([sys.executable, "-m", "minicb", *cmd[1:]])
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.strip(), "printed nothing"
        if cmd[1:2] == ["generate"] and len(_parsed(cmd).prompts) >= 2:
            labels = [ln[:3] for ln in p.stdout.splitlines() if re.match(r"\[\d+\] ", ln)]
            assert labels == sorted(labels) and labels[0] == "[1]", p.stdout    # in prompt order
    elif head == "python" and cmd[1].startswith("bench/"):
        p = run([sys.executable, cmd[1], "--help"], timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        for flag in (w for w in cmd[2:] if w.startswith("--")):
            assert flag in p.stdout, f"{cmd[1]} --help does not list {flag}"
    elif head == "python":
        p = run([sys.executable, *cmd[1:]])
        assert p.returncode == 0, p.stderr[-3000:]
    elif head == "bash" and cmd[1] == "bench/gpu_check.sh":
        if cuda_available():
            pytest.skip("a CUDA machine: bench/gpu_check.sh is run there by hand (its own check, 8 minutes)")
        p = run(cmd, timeout=300)
        assert p.returncode == 2, (p.returncode, p.stdout[-1000:], p.stderr[-1000:])
    elif head == "torchrun":
        argv = _two_ranks_here(cmd)
        p = run(argv)
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.strip(), "rank 0 printed nothing"
    else:
        pytest.fail(f"README line with no runner here: {' '.join(cmd)} (teach tests/docs/test_readme.py)")


def _parsed(cmd: list[str]):
    from minicb.entrypoints.cli import build_parser

    return build_parser().parse_args(cmd[1:])


def _two_ranks_here(cmd: list[str]) -> list[str]:
    """The two-machine torchrun line as two processes on this machine."""
    values = {"--nnodes": "1", "--node-rank": "0", "--master-addr": "127.0.0.1",
              "--master-port": str(free_port()), "--nproc-per-node": "2"}
    out, i = [sys.executable, "-m", "torch.distributed.run"], 1
    while i < len(cmd):
        if cmd[i] in values:
            out += [cmd[i], values[cmd[i]]]
            i += 2
        else:
            out.append(cmd[i])
            i += 1
    return out


def _standalone_python_blocks() -> list[tuple[str, int]]:
    """The python blocks that run on their own (the openai one needs a server:
    test_the_serving_examples runs it)."""
    return [(text, line) for text, line in python_blocks() if "OpenAI(" not in text]


@pytest.mark.slow
@pytest.mark.parametrize("block", _standalone_python_blocks(), ids=lambda b: f"L{b[1]}")
def test_a_readme_python_block_runs(block, tmp_path):
    text, line = block
    script = tmp_path / f"readme_block_{line}.py"
    script.write_text(text)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, f"README line {line}:\n{p.stderr[-3000:]}"
    assert p.stdout.strip(), f"README line {line} printed nothing"


@pytest.mark.slow
def test_the_serving_examples(tmp_path):
    """Each ``minicb serve`` line starts and says where it listens; against the first, the ``curl``
    line and the openai block get answers; Ctrl-C stops it with exit 0."""
    serves = [c for c, _ in bash_commands() if c[:2] == ["minicb", "serve"]]
    curls = [c for c, _ in bash_commands() if c[0] == "curl"]
    openai_blocks = [t for t, _ in python_blocks() if "OpenAI(" in t]
    assert serves and curls and openai_blocks
    for k, cmd in enumerate(serves):
        port = free_port()
        argv = list(cmd[2:])
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(port)
        else:
            argv += ["--port", str(port)]
        proc = subprocess.Popen([sys.executable, "-m", "minicb", "serve", *argv], cwd=ROOT, env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()              # blocks until it listens (or dies)
            if not first.startswith("minicb serve: "):         # it died: say why
                err = proc.communicate(timeout=120)[1]
                pytest.fail(f"minicb serve printed {first!r}; stderr: {err[-2000:]}")
            url = re.search(r"on (http://\S+)", first).group(1)
            _wait_until_healthy(url, proc)
            if k == 0:
                for curl in curls:
                    c = run([w.replace("localhost:8000", url.removeprefix("http://")) for w in curl],
                            timeout=300)
                    assert c.returncode == 0 and '"choices"' in c.stdout, (c.stdout, c.stderr)
                for block in openai_blocks:
                    script = tmp_path / "openai_block.py"
                    script.write_text(block.replace("http://127.0.0.1:8000", url))
                    o = subprocess.run([sys.executable, str(script)], env=env(), capture_output=True,
                                       text=True, timeout=300)
                    assert o.returncode == 0 and o.stdout.strip(), o.stderr[-2000:]
        finally:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]


def _wait_until_healthy(url: str, proc: subprocess.Popen) -> None:
    """/health answers 200 (the server's signal handlers are in place from then on). No time limit
    but the test's own: how long start-up takes on a busy machine is not what is tested."""
    import time
    import urllib.request

    while proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=30) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"minicb serve exited with {proc.returncode} before /health answered")


def test_the_readme_diagrams_are_what_the_demo_draws():
    from minicb.entrypoints.demo import TRACE, batching_traces, diagrams

    first_text = next(text for lang, text, _ in readme_blocks() if lang == "text")
    assert first_text.splitlines() == diagrams(batching_traces(**TRACE), colour=False)


def test_the_extraction_sees_every_block_and_command():
    """The parsing itself: every fence is found, continuation lines join, comments go."""
    fences = README.read_text().count("\n```")
    assert 2 * len(readme_blocks()) == fences
    cmds = [" ".join(c) for c, _ in bash_commands()]
    assert "make demo" in cmds and "make test" in cmds
    torchrun = next(c for c in cmds if c.startswith("torchrun"))
    assert "-m minicb.entrypoints.cli generate" in torchrun                 # the continued line
    assert not any("#" in c for c in cmds if not c.startswith("curl"))
    assert block_commands('a "b c" \\\n   d  # e\n# f\n') == [["a", "b c", "d"]]


def test_setup_changes_nothing_outside_the_python_environment_and_ci_installs_the_browser():
    """``make setup`` (which ``make demo`` and ``make test`` run) installs with pip into $(PYTHON)'s
    environment only; the system package (Chromium, for the docs' browser test) is ``make browser``'s,
    which says what it does, and CI runs it before ``make test`` so that test cannot skip there."""
    setup = run(["make", "-n", "-B", "setup"]).stdout
    assert "pip install" in setup and "apt-get" not in setup and "sudo" not in setup
    browser = run(["make", "-n", "browser"]).stdout
    assert "apt-get install" in browser and "echo \"make browser: installing" in browser
    ci = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()
          if ln.strip() and not ln.lstrip().startswith("#")]
    assert ci.index("make browser") < ci.index("make test")
