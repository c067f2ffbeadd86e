"""No silent loads (issue 45): ``LLM()`` and the commands name each phase of a model load on stderr
from the first second on, say which matrix-product path the model got in plain words (``-v``: the
detail), and refuse what they can before the load starts: an empty prompt, plots without matplotlib.

Nothing here times anything: the order of events is what is checked (the first progress line comes
before the loader is called; a refusal comes without the loader or torch ever being imported)."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest

from minicb.entrypoints import loading
from minicb.entrypoints.cli import main
from minicb.measure import progress
from tiny_files import write_gguf

SRC = str(pathlib.Path(__file__).resolve().parents[2] / "src")
PHASES = ["reading the weights", "building the model", "packing the weights for this CPU (and compiling "
          "its C kernels)", "allocating the KV cache"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("first-load") / "tiny.gguf")


@pytest.fixture
def shown(monkeypatch):
    """Every progress line from now on, in order, shown from the first instant (no thread, no 1 s
    wait: the lines, not their timing, are what the tests read); ``events`` also records when the
    loader was called, among the lines."""
    events: list[str] = []

    class Stream:
        def write(self, text):
            events.extend(ln.rsplit(" (", 1)[0] for ln in text.splitlines() if ln)   # less the time

        def flush(self):
            pass

    class Immediate(progress.Progress):
        def __init__(self, what, *a, **kw):
            kw.update(stream=Stream(), after=0.0, enabled=True, tty=False, thread=False)
            super().__init__(what, *a, **kw)

        def start(self):
            super().start()
            self.tick()                  # the first line at once
            return self

    monkeypatch.setattr(progress, "Progress", Immediate)
    from minicb.model.weights import loader

    real = loader.load_model
    monkeypatch.setattr(loader, "load_model",
                        lambda *a, **kw: events.append("LOADER CALLED") or real(*a, **kw))
    return events


def test_llm_names_each_load_phase_before_it_runs(tiny_gguf, shown):
    from minicb.entrypoints.llm import LLM

    LLM(str(tiny_gguf), max_num_seqs=2, num_blocks=16, block_size=4).shutdown()
    assert shown[:3] == ["loading tiny.gguf:", "loading tiny.gguf: reading the weights", "LOADER CALLED"]
    assert shown[3:-1] == [f"loading tiny.gguf: {p}" for p in PHASES[1:]]
    assert shown[-1].startswith("loading tiny.gguf: done in ")


def test_a_model_given_built_loads_silently(shown):
    from helpers import tiny_model
    from minicb.entrypoints.llm import LLM

    LLM(tiny_model(), max_num_seqs=2, num_blocks=16, block_size=4).shutdown()
    assert shown == []


def test_generate_shows_its_phases_on_one_line_then_the_plain_path_line(tiny_gguf, shown, capsys,
                                                                        monkeypatch):
    monkeypatch.setenv("MINICB_LINEAR", "mkl")
    assert main(["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2"]) == 0
    assert shown[:5] == ["loading tiny.gguf:", "loading tiny.gguf: importing torch",
                         "loading tiny.gguf: reading the tokenizer",
                         "loading tiny.gguf: reading the weights", "LOADER CALLED"]
    assert shown[5:-1] == [f"loading tiny.gguf: {p}" for p in PHASES[1:]]   # the CLI's line: no second one
    err = capsys.readouterr().err
    assert "minicb: linear layers on PyTorch's default matrix library (MKL) (-v: which path and why)" \
        in err.splitlines()


@pytest.mark.parametrize("path, kernel, says", [
    ("onednn-f32", "; steps of up to 4096 rows on the skinny kernel (its AVX-512 path)",
     "minicb: linear layers on oneDNN, their weights repacked once for this CPU; decode steps on a small C "
     "kernel that reads each weight once (-v: which path and why)"),
    ("mkl", "", "minicb: linear layers on PyTorch's default matrix library (MKL) (-v: which path and why)"),
    ("onednn-bf16", "; no skinny kernel (pinned off)",
     "minicb: linear layers on oneDNN in bfloat16, their weights repacked once for this CPU's bfloat16 "
     "instructions (-v: which path and why)"),
])
def test_the_load_record_in_plain_words(path, kernel, says):
    record = logging.LogRecord("minicb.load", logging.INFO, __file__, 1,
                               "minicb: %s linear layers on %s: %s%s",   # cpu_fast_paths' record
                               ("float32", path, "packed oneDNN 1.56x MKL on a 16x576x960 product", kernel),
                               None)
    assert loading.plain(record) == says


def test_a_record_of_another_shape_is_shown_as_it_is():
    record = logging.LogRecord("minicb.load", logging.INFO, __file__, 1, "minicb: something new %s", ("x",),
                               None)
    assert loading.plain(record) == "minicb: something new x"


def test_verbose_shows_the_record_as_it_is(tiny_gguf, capsys, monkeypatch):
    monkeypatch.setenv("MINICB_LINEAR", "mkl")
    assert main(["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2", "-v"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "minicb: float32 linear layers on mkl: MINICB_LINEAR=mkl" in err
    assert not any("(-v: which path and why)" in ln for ln in err)


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter; it prints whether torch was imported at the end."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code + "\nprint('torch' in sys.modules)"],
                          capture_output=True, text=True, env=env, timeout=300)


def test_an_empty_prompt_is_refused_before_torch_is_imported():
    run = _run_without_torch("import sys\nfrom minicb.entrypoints.cli import main\n"
                             "print(main(['generate', '']))")
    assert run.stdout.split() == ["2", "False"], run.stderr
    assert run.stderr.strip() == "minicb: error: prompt 1 is empty: a prompt needs at least one token"


def test_a_prompt_too_long_for_the_model_is_refused_before_the_weights_load(tiny_gguf, capsys, monkeypatch):
    """The header (tokenizer, context length) is read first; the prompt's tokens are counted there."""
    from minicb.model.weights import loader
    from minicb.model.weights.gguf_loader import config_from_gguf, read_gguf

    with read_gguf(tiny_gguf) as g:
        ctx = config_from_gguf(g).max_position_embeddings
    loads = []
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loads.append(a) or 1 / 0)
    prompt = "0 " * ctx                     # the tiny byte-level tokenizer: at least one token a character
    assert main(["generate", prompt, "--model", str(tiny_gguf), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("minicb: error: prompt 1 (") and f"more than max_model_len={ctx} " in err, err
    assert loads == []
    # one token fewer than the limit leaves room for the one new token: it gets to the load
    n = len(loader.read_header(tiny_gguf)[1].encode("0 " * (ctx // 4)))
    with pytest.raises(ZeroDivisionError):
        main(["generate", "0 " * (ctx // 4), "--model", str(tiny_gguf), "--max-tokens", str(ctx - n)])
    assert len(loads) == 1


def test_an_empty_prompt_is_fine_with_chat(tiny_gguf, capsys):
    """The chat template wraps it: the model gets tokens (an empty user message)."""
    assert main(["generate", "--chat", "", "--model", str(tiny_gguf), "--max-tokens", "2"]) == 0


@pytest.mark.parametrize("argv", [
    ["trace", "--num-requests", "2", "--out", "{tmp}/t.png"],
    ["bench", "--model", "tiny", "--num-requests", "2", "--out", "{tmp}/b"],
    ["simulate", "--out", "{tmp}/s"],
])
def test_plots_without_matplotlib_are_refused_before_the_run(argv, tmp_path):
    """matplotlib made unimportable; the command must refuse at once, before torch (the run) loads."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = ("import sys, importlib.util\nreal = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'matplotlib' else real(name, *a)\n"
            "from minicb.entrypoints.cli import main\n"
            f"print(main({argv!r}))")
    run = _run_without_torch(code)
    assert run.stdout.split() == ["2", "False"], run.stderr
    assert "--out draws plots with matplotlib, which is not installed: pip install 'minicb[plots]'" \
        in run.stderr


def test_under_a_running_progress_line_the_load_names_its_phases_there_then_gives_it_back(tiny_gguf,
                                                                                        shown):
    """A tutorial's heartbeat line (or a command's) carries the load's phases, and its own words after."""
    from minicb.entrypoints.llm import LLM

    with progress.Progress("tutorials/05_step_loop.py") as beat:
        beat.update(info="still running")
        LLM(str(tiny_gguf), max_num_seqs=2, num_blocks=16, block_size=4).shutdown()
        assert beat.info == "still running"
    assert shown[1:3] == ["tutorials/05_step_loop.py: reading the weights", "LOADER CALLED"]
    assert not any(line.startswith("loading ") for line in shown)          # no second line of its own


def test_the_bench_explains_dynamic_below_static_and_only_then():
    from types import SimpleNamespace as S

    from minicb.measure.bench_cli import padded_note

    def table(static_tps, dynamic_tps):
        return [S(label="static", output_tokens_per_s=static_tps, num_steps=600),
                S(label="dynamic", output_tokens_per_s=dynamic_tps, num_steps=1197),
                S(label="continuous", output_tokens_per_s=750.0, num_steps=500)]

    note = padded_note(table(356.0, 210.0))
    assert note.startswith("note: dynamic below static") and "dynamic took 1,197 steps, static 600" \
        in " ".join(note.split())
    assert max(map(len, note.splitlines())) <= 100                  # the tables' width
    assert padded_note(table(208.6, 226.3)) is None
    assert padded_note(table(356.0, 210.0)[2:]) is None             # one policy alone: nothing to compare
