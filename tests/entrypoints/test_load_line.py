"""The commands say which GEMM path the model got, and why: one ``minicb: <dtype> linear layers on
<path>: <why>`` line on stderr per load (``minicb.fastpaths.install.show_load_lines``), for ``bench``,
and for ``generate`` and ``serve`` with ``-v`` (without it, in plain words:
``minicb.entrypoints.loading``); the library's INFO line stays out of a caller's stderr unless asked for."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from minicb.entrypoints.cli import main
from minicb.fastpaths import cpu_linear, skinny_gemm
from tiny_files import write_gguf

SRC = str(pathlib.Path(__file__).resolve().parents[2] / "src")
PINNED = "minicb: float32 linear layers on mkl: MINICB_LINEAR=mkl"          # with -v
PLAIN = "minicb: linear layers on PyTorch's default matrix library (MKL) (-v: which path and why)"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("load-line") / "tiny.gguf")


@pytest.fixture(autouse=True)
def pinned(monkeypatch):
    monkeypatch.setenv("MINICB_LINEAR", "mkl")        # the same line on every CPU: the reason is the pin


def load_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if " linear layers on " in ln]


def test_generate_says_which_path_once_per_load(tiny_gguf, capsys):
    for _ in range(2):                                # a second load in the same process says it again
        assert main(["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2", "-v"]) == 0
        out, err = capsys.readouterr()
        assert load_lines(err) == [PINNED] and " linear layers on " not in out
        assert main(["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2"]) == 0
        out, err = capsys.readouterr()                # without -v: in plain words (test_first_load.py)
        assert load_lines(err) == [PLAIN] and " linear layers on " not in out


def test_generate_names_the_path_and_reason_choose_path_gives(tiny_gguf, capsys, monkeypatch):
    import torch

    monkeypatch.delenv("MINICB_LINEAR")
    path, why = cpu_linear.choose_path(torch.float32, 32, 64)  # the tiny q/k/v: 32 -> (2 + 2 x 1) x 16
    rows, rows_why = skinny_gemm.choose_rows(torch.float32)
    if path.startswith("onednn"):                  # the packed paths say whether few-row steps use the kernel
        why += f"; steps of up to {rows} rows on the skinny kernel ({rows_why})" if rows else \
            f"; no skinny kernel ({rows_why})"
    assert main(["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "1", "--verbose"]) == 0
    assert load_lines(capsys.readouterr().err) == [f"minicb: float32 linear layers on {path}: {why}"]


def test_bench_says_which_path_and_runs_it(tmp_path, capsys):
    rc = main(["bench", "--model", "tiny", "--num-requests", "2", "--policy", "continuous", "--rate", "1000",
               "--max-output", "3", "--max-prompt", "8", "--no-plots", "--no-progress",
               "--peak-gflops", "1", "--out", str(tmp_path)])
    assert rc == 0
    assert load_lines(capsys.readouterr().err) == [PINNED]


def test_the_library_alone_prints_nothing():
    """Without the commands' ``show_load_lines`` the line is an INFO record: not on stderr."""
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from helpers import TINY; "
            "from minicb.fastpaths.install import cpu_fast_paths; "
            "from minicb.model.llama import LlamaForCausalLM; "
            "print(cpu_fast_paths(LlamaForCausalLM.random(TINY, dtype=torch.float32), 'cpu'))")
    env = dict(os.environ, PYTHONPATH=SRC, MINICB_LINEAR="mkl")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(SRC).parent, env=env)
    assert run.returncode == 0, run.stderr
    assert "packed-lm-head" in run.stdout and load_lines(run.stderr) == []


@pytest.mark.slow
def test_serve_says_which_path_before_it_listens(tiny_gguf):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MINICB_LINEAR="mkl")
    p = subprocess.Popen([sys.executable, "-m", "minicb", "serve", "--model", str(tiny_gguf), "--port", "0",
                          "--threads", "1", "-v"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        line = p.stdout.readline()                    # "minicb serve: tiny on http://127.0.0.1:PORT"
        assert " on http://" in line, line
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=300)       # a bound on a hang: a loaded machine stops it slowly
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert load_lines(err) == [PINNED], err
