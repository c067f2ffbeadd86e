"""What a new user meets first (issue 29): bare ``minicb`` lists the commands, ``--version``, help on
every flag, "did you mean" for a misspelt flag, command or choice, flag errors before torch is
imported and named by their flag, Hub ids told that minicb never downloads, several prompts printed
in prompt order, tables that fit 100 columns, and ``minicb demo``."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from minicb.entrypoints.cli import EXIT_USAGE, build_parser, main
from tiny_files import write_gguf

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
COMMANDS = ["demo", "generate", "trace", "bench", "simulate", "serve", "export-hf", "completion", "tutorials"]
NEVER_DOWNLOADS = "minicb never downloads: pass a .gguf file or a local Hugging Face directory"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("first") / "tiny.gguf")


def run_main(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_bare_minicb_lists_every_command_and_where_to_start(capsys):
    rc, out, err = run_main([], capsys)
    assert rc == 0 and err == ""
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("    ") and ln.split()]
    assert listed == COMMANDS
    assert "minicb demo" in out and "never downloads" in out


def test_version_is_the_package_version(capsys):
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    rc, out, err = run_main(["--version"], capsys)
    assert rc == 0 and out == f"minicb {version}\n"


def _all_parsers(parser, name="minicb"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_flag_and_argument_has_help_text():
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in _all_parsers(build_parser())
               for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert missing == []


@pytest.mark.parametrize("argv, meant", [
    (["generate", "hi", "--max_tokens", "3"], "--max-tokens"),          # underscores for dashes
    (["generate", "hi", "--max-tokns", "3"], "--max-tokens"),           # a typo
    (["generate", "hi", "--temprature=0.5"], "--temperature"),          # --flag=value
    (["trace", "--num_requests", "3"], "--num-requests"),               # every command's own flags
    (["bench", "--rates", "2"], "--rate"),
    (["generat", "hi"], "generate"),                                    # a command
    (["generate", "hi", "--policy", "contnuous"], "continuous"),        # a choice
])
def test_a_misspelt_flag_command_or_choice_gets_did_you_mean(argv, meant, capsys):
    rc, out, err = run_main(argv, capsys)
    assert rc == EXIT_USAGE and out == "" and len(err.splitlines()) == 1
    assert err.startswith("minicb: error: ") and err.rstrip().endswith(f"(did you mean {meant}?)"), err


def test_nothing_close_gets_no_suggestion(capsys):
    rc, out, err = run_main(["generate", "hi", "--zzzzzz"], capsys)
    assert rc == EXIT_USAGE and "did you mean" not in err and "unrecognized arguments: --zzzzzz" in err


@pytest.mark.parametrize("argv, line", [
    (["generate", "hi", "--max-tokens", "0"], "minicb: error: --max-tokens must be >= 1, got 0"),
    (["generate", "hi", "--top-k", "-1"], "minicb: error: --top-k must be >= 0, got -1"),
    (["generate", "hi", "--max-num-seqs", "0"], "minicb: error: --max-num-seqs must be >= 1, got 0"),
    (["generate", "hi", "--tp", "0"], "minicb: error: --tp must be >= 1, got 0"),
    (["demo", "--max-tokens", "0"], "minicb: error: --max-tokens must be >= 1, got 0"),
    (["generate", "hi", "--model", "HuggingFaceTB/SmolLM2-360M-Instruct"],
     "minicb: error: --model 'HuggingFaceTB/SmolLM2-360M-Instruct' does not exist here, and "
     + NEVER_DOWNLOADS),
])
def test_flag_errors_come_before_torch_is_imported(argv, line):
    """The real command, in a fresh interpreter: the error line, exit 2, and torch never imported (the
    wait for torch's import used to come first)."""
    code = ("import sys; from minicb.entrypoints.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert p.returncode == EXIT_USAGE and p.stdout == "False\n", (p.stdout, p.stderr)
    assert p.stderr == line + "\n" or (p.stderr.startswith(line) and p.stderr.count("\n") == 1), p.stderr


@pytest.mark.parametrize("text, hub", [
    ("HuggingFaceTB/SmolLM2-360M-Instruct", True), ("meta-llama/Llama-3.1-8B", True),
    ("/abs/model", False), ("./x/y", False), ("out/model.gguf", False), ("model.gguf", False),
    ("a/b/c", False), ("owner/weights.safetensors", False),
])
def test_what_looks_like_a_hub_id(text, hub):
    from minicb.model.weights.paths import looks_like_hub_id

    assert looks_like_hub_id(text) is hub


def test_the_library_says_never_downloads_too():
    from minicb.core.errors import ModelLoadError
    from minicb.entrypoints.llm import LLM

    with pytest.raises(ModelLoadError, match=NEVER_DOWNLOADS):
        LLM("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_a_missing_local_path_is_not_called_a_hub_id(tmp_path, capsys):
    rc, out, err = run_main(["generate", "hi", "--model", str(tmp_path / "no.gguf")], capsys)
    assert rc == EXIT_USAGE and "does not exist" in err and "never downloads" not in err


def test_several_prompts_print_in_prompt_order_when_they_finish_out_of_order(tiny_gguf, capsys, monkeypatch):
    """Request 3 finishes first and request 1 last: [1] [2] [3] all the same, each as soon as every
    earlier one is out."""
    import minicb.engine.arrivals

    printed_before = []

    def fake_drive(engine, arrivals, on_step=None, **kw):
        def out(i, text):
            return types.SimpleNamespace(request_id=str(i), finished=True, text=text, new_text=text,
                                         error=None)
        on_step([out(2, "third")])
        printed_before.append(capsys.readouterr().out)       # [3] waits for [1] and [2]
        on_step([out(1, "second")])
        on_step([out(0, "first")])
        return []

    monkeypatch.setattr(minicb.engine.arrivals, "drive", fake_drive)
    rc, out, err = run_main(["generate", "a", "b", "c", "--model", str(tiny_gguf)], capsys)
    assert rc == 0 and printed_before == [""]
    assert out == "[1] first\n[2] second\n[3] third\n"


def test_a_real_run_of_several_prompts_is_in_prompt_order(tiny_gguf, capsys):
    """Prompts of different lengths and ``--max-num-seqs 1``: whatever the schedule, [1] comes first."""
    rc, out, err = run_main(["generate", "x " * 30, "y", "z " * 5, "--model", str(tiny_gguf),
                             "--max-tokens", "3", "--max-num-seqs", "2"], capsys)
    assert rc == 0, err
    assert [ln[:3] for ln in out.splitlines()] == ["[1]", "[2]", "[3]"]


def test_result_tables_fit_100_columns_and_wide_keeps_one(capsys):
    base = ["simulate", "--preset", "llama-3-8b", "--num-requests", "12", "--rates", "4", "--no-progress"]
    rc, narrow, _ = run_main(base, capsys)
    assert rc == 0
    rc, wide, _ = run_main(base + ["--wide"], capsys)
    assert rc == 0
    table = [ln for ln in narrow.splitlines() if not ln.startswith(("preset ", "simulated "))]
    assert table and max(map(len, table)) <= 100
    wide_rows = [ln for ln in wide.splitlines()
                 if ln.startswith(("policy", "static", "dynamic", "continuous"))]
    assert max(map(len, wide_rows)) > 100 and len(wide_rows) == 4
    # the same cells either way: every value of the wide table is in the narrow one, row by row
    for row in wide_rows[1:]:
        label, *cells = row.split()
        narrow_cells = " ".join(ln for ln in table if ln.startswith(label + " ")).split()
        assert [c for c in cells if c not in narrow_cells] == [], label


def test_format_table_splits_columns_into_tables_that_fit():
    from minicb.measure.metrics import COLUMNS, format_table

    rows = [types.SimpleNamespace(label=f"policy {i}", **{f: 1234.5 * (i + 1) for _, f, _, _ in COLUMNS})
            for i in range(3)]
    for width in (60, 80, 100):
        text = format_table(rows, width=width)
        assert max(map(len, text.splitlines())) <= width
        headers = " ".join(text.split("\n"))
        for name, _, _, _ in COLUMNS:                      # every column is somewhere, its header intact
            top, _, bottom = name.rpartition(" ")
            assert bottom in headers and (not top or top in headers), name
    one = format_table(rows)
    assert len(one.splitlines()) == 4


# --- minicb demo ---------------------------------------------------------------------------------------
def test_the_demo_draws_both_policies_side_by_side_and_says_what_next(capsys):
    rc, out, err = run_main(["demo", "--no-model", "--color", "never"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100
    head = next(ln for ln in lines if "STATIC batching" in ln)
    assert "CONTINUOUS batching" in head and head.index("STATIC") < head.index("CONTINUOUS")
    split = head.index("CONTINUOUS")
    rows = [ln for ln in lines if ln.strip().startswith("slot ")]
    static = [ln[:split].split("|")[1] for ln in rows]
    continuous = [ln[split:].split("|")[1] for ln in rows]
    assert len(rows) == 3
    # static pads, continuous never does; continuous takes fewer steps for the same requests
    assert any("." in r for r in static) and not any("." in r for r in continuous)
    assert len(continuous[0]) < len(static[0])
    counts = [ln for ln in lines if "steps," in ln and "slot-steps padding" in ln][0]
    assert f"{len(static[0])} steps" in counts and f"{len(continuous[0])} steps" in counts
    # every request's letters, the same set on both sides
    letters = sorted({c.upper() for r in static for c in r if c.isalpha()})
    assert letters == sorted({c.upper() for r in continuous for c in r if c.isalpha()}) == list("ABCDEF")
    tail = lines[-3:]
    assert tail[0].startswith("What just happened:") or lines[-4].startswith("What just happened:")
    assert tail[-2].startswith("Next: minicb ") and tail[-1].startswith("Tutorials: python tutorials/")


def test_the_demos_next_command_runs(capsys):
    rc, out, _ = run_main(["demo", "--no-model", "--color", "never"], capsys)
    next_line = next(ln for ln in out.splitlines() if ln.startswith("Next: "))
    command = next_line.removeprefix("Next: ").split("   (")[0].split()
    assert command[0] == "minicb"
    rc, out, err = run_main(command[1:] + ["--color", "never"], capsys)
    assert rc == 0 and "slot 0" in out, err
    tutorial = next(ln for ln in run_main(["demo", "--no-model"], capsys)[1].splitlines()
                    if ln.startswith("Tutorials: ")).split()[2].rstrip(",")
    assert (ROOT / tutorial).is_file()


@pytest.mark.slow
def test_the_demo_with_smollm2_refills_the_first_free_slot(smollm2_path, capsys):
    """Part 2: four prompts on three slots; the fourth (D) starts in the slot of the first answer to end,
    at the step after it ended, and every answer is printed under its prompt."""
    from minicb.entrypoints.demo import DEMO_PROMPTS

    rc, out, err = run_main(["demo", "--color", "never", "--max-tokens", "12"], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    for letter, prompt in zip("ABCD", DEMO_PROMPTS, strict=True):
        at = lines.index(f"   {letter}: {prompt}")
        assert lines[at + 1].startswith("      -> ") and len(lines[at + 1]) > len("      -> ")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("   the slots of this run"))
    rows = [ln.split("|")[1] for ln in lines[start:] if ln.strip().startswith("slot ")][:3]
    ends = {slot: max(t for t, c in enumerate(r) if c.isalpha() and c.upper() != "D")
            for slot, r in enumerate(rows)}
    d_slot = next(s for s, r in enumerate(rows) if "D" in r)
    assert ends[d_slot] == min(ends.values()) and rows[d_slot].index("D") == ends[d_slot] + 1


def test_simulate_is_small_by_default_and_full_is_the_15000_request_run():
    from minicb.simulate.cli import build

    def simulated(*argv) -> int:
        args = build_parser().parse_args(["simulate", *argv])
        _, _, rates, policies = build(args)
        return args.num_requests * len(rates) * len(policies)

    assert simulated() == 200 * 3 * 3                  # 24 s of CPU (bench/readme_times.py)
    assert simulated("--full") == 15_000
    assert simulated("--full", "--rates", "12", "--policy", "continuous") == 1000
    assert simulated("--num-requests", "50") == 50 * 3 * 3
