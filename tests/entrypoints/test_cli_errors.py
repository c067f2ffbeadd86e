"""The command line's error contract (docs/errors.md): a user's mistake (an unknown flag, a bad value,
a missing or broken model, an empty or unreadable ``--file``) exits with code 2 and exactly one line on
stderr, ``minicb: error: ...``, never a traceback; Ctrl-C during generation exits with 130. The last
test checks that a flag with no error path of its own, ``--no-prefix-caching``, reaches the engine.

Most rows call ``minicb.entrypoints.cli.main`` in-process (an uncaught exception would fail the test just
as a traceback would); a few run ``python -m minicb`` for real, and the Ctrl-C test sends SIGINT to a
process generating from a tiny GGUF whose model never emits EOS.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from minicb.entrypoints.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from tiny_files import tiny_weights, write_gguf

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf")


def run_main(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:          # argparse's own error path exits
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def without_load_line(err: str) -> str:
    """stderr less the line every model load prints: which GEMM path, and why (``test_load_line.py``)."""
    return "".join(ln for ln in err.splitlines(keepends=True) if " linear layers on " not in ln)


def assert_one_line(err: str, *needles) -> None:
    """One error line on stderr (a model that loaded first also said which GEMM path it got)."""
    err = without_load_line(err)
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith("minicb: error: "), lines[0]
    assert "Traceback" not in err and "usage:" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("argv, needles", [
    (["generate", "hi", "--foo"], ["unrecognized arguments: --foo"]),
    (["generate", "hi", "--max-tokens"], ["--max-tokens", "expected one argument"]),
    (["generate", "hi", "--max-tokens", "abc"], ["--max-tokens", "invalid int value: 'abc'"]),
    (["generate", "hi", "--dtype", "int8"], ["--dtype", "invalid choice: 'int8'", "float32"]),
    (["generate", "hi", "--policy", "fifo"], ["--policy", "invalid choice: 'fifo'"]),
    (["generate", "hi", "--preemption-mode", "drop"], ["--preemption-mode", "invalid choice"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    (["generate", "hi", "--max_tokens", "4"],
     ["unrecognized arguments: --max_tokens", "did you mean --max-tokens?"]),
])
def test_argparse_errors_are_one_line_exit_2(argv, needles, capsys):
    rc, out, err = run_main(argv, capsys)
    assert rc == EXIT_USAGE and out == ""
    assert_one_line(err, *needles)


@pytest.mark.parametrize("extra, needles", [
    (["--max-tokens", "0"], ["--max-tokens must be >= 1, got 0"]),
    (["--temperature", "-1"], ["--temperature", "[0, inf]"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--top-k", "-2"], ["--top-k must be >= 0, got -2"]),
    (["--seed", "-1"], ["--seed", "[0,"]),
    (["--block-size", "0"], ["--block-size must be >= 1"]),
    (["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens must be >= 1"]),
    (["--max-prefill-tokens-while-decoding", "-1"], ["--max-prefill-tokens-while-decoding must be >= 0"]),
    (["--max-num-seqs", "8", "--num-blocks", "4"], ["num_blocks must be at least max_num_seqs"]),
    (["--max-tokens", "9000"], ["max_model_len=4096"]),
])
def test_bad_values_are_one_line_exit_2(extra, needles, tiny_gguf, capsys):
    rc, out, err = run_main(["generate", "hi", "--model", str(tiny_gguf), *extra], capsys)
    assert rc == EXIT_USAGE and out == ""
    assert_one_line(err, *needles)


def test_model_errors_are_one_line_exit_2(tmp_path, tiny_gguf, capsys):
    (tmp_path / "empty_dir").mkdir()
    cases = {
        str(tmp_path / "nonexistent"): ["does not exist"],
        str(tmp_path / "empty_dir"): ["neither a Hugging Face model directory", "nor a directory holding"],
    }
    (tmp_path / "junk.gguf").write_bytes(b"not a model at all")
    cases[str(tmp_path / "junk.gguf")] = ["not a GGUF file"]
    data = tiny_gguf.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    cases[str(tmp_path / "cut.gguf")] = ["cut.gguf", "past the end"]
    for model, needles in cases.items():
        rc, out, err = run_main(["generate", "hi", "--model", model], capsys)
        assert rc == EXIT_USAGE and out == "", model
        assert_one_line(err, *needles)


def test_prompt_file_errors_are_one_line_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    for argv, needles in [
        (["generate", "--file", str(empty)], ["--file", "contains no prompts"]),
        (["generate", "--file", str(tmp_path / "missing.txt")], ["cannot read --file", "No such file"]),
        (["generate", "--file", str(tmp_path)], ["cannot read --file", "directory"]),
        (["generate", "--file", str(binary)], ["cannot read --file", "not UTF-8"]),
        (["generate"], ["give at least one prompt"]),
    ]:
        rc, out, err = run_main(argv, capsys)
        assert rc == EXIT_USAGE and out == "", argv
        assert_one_line(err, *needles)


def cli(*args, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "minicb", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, **kwargs)


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
])
def test_the_real_command_exits_2_with_one_line(args, needle):
    p = cli(*args)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_USAGE and out == b""
    assert_one_line(err.decode(), needle)


@pytest.mark.timing
def test_ctrl_c_during_generation_exits_130_without_a_traceback(tmp_path):
    model = write_gguf(tmp_path / "never_eos.gguf", tiny_weights(never_eos=True), quantize=False)
    p = cli("generate", "hello", "--model", str(model), "--max-tokens", "2000")
    try:
        ready, _, _ = select.select([p.stdout], [], [], 120)
        # load-independent: a 120 s hang guard on a first token
        assert ready, "nothing was printed within 120 s"
        first = os.read(p.stdout.fileno(), 64)
        assert first.strip(), first                  # generation has started and is streaming
        time.sleep(0.2)
        # load-independent: load slows the child's 2,000 steps as well
        assert p.poll() is None, "generation finished before it could be interrupted"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == EXIT_INTERRUPTED, (p.returncode, err)
    assert without_load_line(err.decode()) == "minicb: interrupted\n"
    assert len(first + out) < 2000, "it was interrupted, not finished"


def test_no_prefix_caching_flag_reaches_the_engine_and_changes_no_output(tiny_gguf, capsys, monkeypatch):
    """``--no-prefix-caching`` turns sharing off (no prompt token is served from the cache) and the
    generated text is the same with and without it. Two prompts share a long prefix; ``--max-num-seqs 1``
    admits them one after the other, so with caching on the second one finds the first one's blocks."""
    import minicb.entrypoints.llm

    built = []

    class Recording(minicb.entrypoints.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(minicb.entrypoints.llm, "LLM", Recording)
    prompt = "the cat sat on the mat and looked at the dog " * 3
    argv = ["generate", prompt + "once", prompt + "twice", "--model", str(tiny_gguf), "--max-tokens", "3",
            "--block-size", "2", "--max-num-seqs", "1"]
    outputs = {}
    for flag in ([], ["--no-prefix-caching"]):
        rc, out, err = run_main(argv + flag, capsys)
        assert rc == 0 and without_load_line(err) == "", err
        outputs[bool(flag)] = out
    with_cache, without = (llm.engine.scheduler for llm in built)
    assert with_cache.config.prefix_caching and not without.config.prefix_caching
    assert with_cache.stats.num_cached_prompt_tokens > 0
    assert without.stats.num_cached_prompt_tokens == 0
    assert without.stats.num_prompt_tokens == with_cache.stats.num_prompt_tokens
    assert outputs[True] == outputs[False] and outputs[True].count("\n") == 2


def test_the_stall_free_flag_reaches_the_engine_of_generate_and_serve(tiny_gguf, capsys, monkeypatch):
    """``--max-prefill-tokens-while-decoding``: generate's unset is LLM()'s default (no cap: offline,
    throughput); 0, no cap; N, N (+ 4 per sequence held). ``serve`` hands it to the same ``LLM()``
    (recorded here, then stopped before the server); unset, serve's own cap (4 + 4 per sequence held)
    for continuous."""
    import minicb.entrypoints.llm
    from minicb.core.errors import MinicbError

    built, asked = [], []

    class Recording(minicb.entrypoints.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(minicb.entrypoints.llm, "LLM", Recording)
    flag = "--max-prefill-tokens-while-decoding"
    for extra in ([], [flag, "0"], [flag, "3"]):
        rc, _, err = run_main(["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2", *extra],
                              capsys)
        assert rc == 0, err
    got = [(llm.engine.config.max_prefill_tokens_while_decoding, llm.engine.config.prefill_tokens_per_seq)
           for llm in built]
    assert got == [(None, 4), (None, 4), (3, 4)]

    class Stop:
        def __init__(self, *args, **kwargs):
            asked.append(kwargs)
            raise MinicbError("stopped before loading")

    monkeypatch.setattr(minicb.entrypoints.llm, "LLM", Stop)
    for extra in ([flag, "5"], [], ["--policy", "static"]):
        rc, _, err = run_main(["serve", "--port", "0", "--model", str(tiny_gguf), *extra], capsys)
        assert rc == EXIT_USAGE and "stopped before loading" in err
    assert [a["max_prefill_tokens_while_decoding"] for a in asked] == [5, 4, None]


def test_the_stall_free_flags_help_states_the_defaults_the_code_has(capsys):
    """The help is written torch-free (the CLI must not import ``llm.py`` to print it), so its numbers are
    literals: they must be serve's cap and ``LLM()``'s share per sequence held as the code has them."""
    from minicb.entrypoints.llm import FAST_DEFAULTS, SERVE_STALL_CAP

    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"(plus {FAST_DEFAULTS['prefill_tokens_per_seq']} per sequence held)" in text
        assert f"(default: serve {SERVE_STALL_CAP} for continuous" in text


# --- issue 17: the contract everywhere ------------------------------------------------------------------
def test_a_prompt_file_is_read_up_to_a_limit(tmp_path, capsys, monkeypatch):
    """``--file /dev/zero`` used to read without end; now at most ``MAX_PROMPT_FILE_BYTES`` are read."""
    import minicb.entrypoints.cli

    monkeypatch.setattr(minicb.entrypoints.cli, "MAX_PROMPT_FILE_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_text("a prompt\n" * 200)                        # 1,800 bytes
    for path in (str(big), "/dev/zero"):
        rc, out, err = run_main(["generate", "--file", path], capsys)
        assert rc == EXIT_USAGE and out == ""
        assert_one_line(err, f"--file {path} is larger than", "MiB")
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\r\n\r\n")  # still one prompt per line
    assert minicb.entrypoints.cli._read_prompt_file(str(tmp_path / "crlf.txt")) == ["one", "two"]


def test_dev_zero_as_the_prompt_file_of_the_real_command():
    p = cli("generate", "--file", "/dev/zero")
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_USAGE and out == b""
    assert_one_line(err.decode(), "--file /dev/zero is larger than 64 MiB")


@pytest.mark.parametrize("arg, byte", [(b"caf\xe9", "0xe9"), (b"\xff\xfe", "0xff"), (b"ok \xc3", "0xc3")])
def test_argument_bytes_that_are_not_utf8_are_one_line_exit_2(arg, byte, tiny_gguf):
    """``minicb generate $'caf\\xe9'`` used to end in a TypeError traceback inside the tokenizer."""
    p = subprocess.Popen([sys.executable.encode(), b"-m", b"minicb", b"generate", arg, b"--model",
                          bytes(tiny_gguf)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, PYTHONPATH=SRC))
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_USAGE and out == b""
    assert_one_line(err.decode(), "prompt 1 is not valid UTF-8 text", f"byte {byte}")


def test_a_lone_surrogate_in_argv_is_one_line_exit_2(tiny_gguf, capsys):
    rc, out, err = run_main(["generate", "caf\udce9", "--model", str(tiny_gguf)], capsys)
    assert rc == EXIT_USAGE and out == ""
    assert_one_line(err, "prompt 1 is not valid UTF-8 text: byte 0xe9 at character 3")


def test_a_failed_request_makes_the_command_exit_1(tiny_gguf, capsys, monkeypatch):
    """Every request of a step fails when the forward raises; the command prints each failure on one
    line and exits 1 (it used to exit 0)."""
    from minicb.runtime.runner import ModelRunner

    def broken(self, plan, params=None):
        raise RuntimeError("the device fell over\nsecond line")

    monkeypatch.setattr(ModelRunner, "run", broken)
    argv = ["generate", "one", "two", "--model", str(tiny_gguf), "--max-tokens", "3"]
    rc, out, err = run_main(argv, capsys)
    assert rc == 1
    lines = without_load_line(err).splitlines()
    assert sorted(lines) == [f"minicb: request {i} failed: RuntimeError: the device fell over second line"
                             for i in (1, 2)]
    assert "Traceback" not in err


class _Failing:
    """A stdout whose writes fail as a closed pipe or a full disk makes them fail."""

    def __init__(self, error: OSError, after: int = 0) -> None:
        self.error, self.left = error, after

    def write(self, text: str) -> int:
        self.left -= len(text)
        if self.left < 0:
            raise self.error
        return len(text)

    def flush(self) -> None:
        if self.left < 0:
            raise self.error

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("error, line", [(BrokenPipeError(32, "Broken pipe"), None),
                                         (OSError(28, "No space left on device"), "No space left on device")])
def test_a_broken_stdout_ends_quietly_with_141(error, line, tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Failing(error, after=3))
    try:
        rc = main(["generate", "hello", "--model", str(tiny_gguf), "--max-tokens", "40"])
    finally:
        monkeypatch.undo()
    err = capsys.readouterr().err
    assert rc == 141
    if line is None:
        assert without_load_line(err) == ""      # the reader left on purpose (head): nothing to say
    else:
        assert_one_line(err, "cannot write to stdout", line)


def test_an_other_os_error_is_not_mistaken_for_a_broken_stdout(tiny_gguf, capsys, monkeypatch):
    """Only stdout's own failures mean 141: a BrokenPipeError from elsewhere (a rank's pipe) is no
    quiet exit."""
    from minicb.runtime.runner import ModelRunner

    def broken(self, plan, params=None):
        raise BrokenPipeError(32, "Broken pipe (a worker)")

    monkeypatch.setattr(ModelRunner, "run", broken)
    rc, out, err = run_main(["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2"], capsys)
    assert rc == 1 and "request 1 failed: BrokenPipeError" in err


def test_the_real_command_under_head_and_a_closed_or_full_stdout(tiny_gguf):
    model = write_gguf(tiny_gguf.parent / "never_eos_pipe.gguf", tiny_weights(never_eos=True), quantize=False)
    args = [sys.executable, "-m", "minicb", "generate", "hello", "--model", str(model), "--max-tokens",
            "400"]
    env = dict(os.environ, PYTHONPATH=SRC)
    # | head -c 10: the reader leaves after 10 bytes
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read()
    p.wait(timeout=120)
    assert len(first) == 10 and p.returncode == 141, (p.returncode, err)
    assert without_load_line(err.decode()) == "", err
    # >&- : no stdout at all: the command runs, quietly
    p = subprocess.run(args[:-1] + ["5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                       timeout=120, preexec_fn=lambda: os.close(1))
    assert p.returncode == 0 and without_load_line(p.stderr.decode()) == "", p.stderr
    # > /dev/full: every write fails with ENOSPC
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            p = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, env=env, timeout=120)
        assert p.returncode == 141
        assert_one_line(p.stderr.decode(), "cannot write to stdout", "No space left on device")


# Each child is the real program: it sends itself a real SIGINT at one moment of its life.
_INTERRUPT_AT_IMPORT = """
import builtins, os, signal, sys
sys.argv = ["minicb"] + sys.argv[1:]
real = builtins.__import__
def hooked(name, *a, **k):
    if name == {module!r}:
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *a, **k)
builtins.__import__ = hooked
import minicb.entrypoints.cli
sys.exit(minicb.entrypoints.cli.main())
"""

_INTERRUPT_AT_TEARDOWN = """
import os, signal, sys, time
sys.argv = ["minicb"] + sys.argv[1:]
import minicb.entrypoints.cli
rc = minicb.entrypoints.cli.main()
os.kill(os.getpid(), signal.SIGINT)      # after the work: the interpreter is winding down
time.sleep(5)
sys.exit(rc)
"""


@pytest.mark.parametrize("moment", ["argparse", "minicb.measure", "torch", "minicb.entrypoints.llm",
                                    "teardown"])
@pytest.mark.timing
def test_ctrl_c_at_any_moment_exits_130_with_one_line(moment, tiny_gguf):
    """A Ctrl-C during the command line's own imports, the parser's, the engine's (torch), or after the
    work is done used to print a KeyboardInterrupt traceback or kill the process by the signal (-2)."""
    code = _INTERRUPT_AT_TEARDOWN if moment == "teardown" else _INTERRUPT_AT_IMPORT.format(module=moment)
    argv = ["generate", "hi", "--model", str(tiny_gguf), "--max-tokens", "2"]
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                       env=dict(os.environ, PYTHONPATH=SRC), timeout=120)
    assert p.returncode == EXIT_INTERRUPTED, (p.returncode, p.stderr.decode()[-500:])
    assert without_load_line(p.stderr.decode()) == "minicb: interrupted\n"


# --- numeric flags of bench / simulate / trace: finite, positive, bounded, checked before any work -------
FLAG_ROWS = [
    (["simulate", "--step-overhead-ms", "inf"], ["--step-overhead-ms", "finite", "got inf"]),
    (["simulate", "--step-overhead-ms", "-1"], ["--step-overhead-ms", "[0.0,", "got -1.0"]),
    (["simulate", "--seq-overhead-us", "nan"], ["--seq-overhead-us", "finite", "got nan"]),
    (["simulate", "--rates", "1e-300"], ["--rates", "[0.001, 1000000.0]", "1e-300"]),
    (["simulate", "--rates", "2,inf"], ["--rates", "finite", "inf"]),
    (["simulate", "--rates", "2,nan"], ["--rates", "nan"]),
    (["simulate", "--plot-rate", "3", "--rates", "2,4"], ["--plot-rate 3.0 is not one of --rates"]),
    (["simulate", "--seed", str(10**23)], ["--seed", "[0, 9223372036854775807]"]),
    (["simulate", "--output-div", "0"], ["--output-div", "finite"]),
    (["simulate", "--num-requests", "0"], ["--num-requests", "[1, 1000000]"]),
    (["simulate", "--max-total", str(10**12)], ["--max-total", "[0, 1048576]"]),
    (["bench", "--model", "tiny", "--rate", "1e-300"], ["--rate", "[0.001, 1000000.0]"]),
    (["bench", "--model", "tiny", "--rate", "inf"], ["--rate", "finite"]),
    (["bench", "--model", "tiny", "--seed", str(10**23)], ["--seed", "[0, 9223372036854775807]"]),
    (["bench", "--model", "tiny", "--threads", "100000"], ["--threads", f"[0, {os.cpu_count()}]", "100000"]),
    (["bench", "--model", "tiny", "--threads", "-1"], ["--threads"]),
    (["bench", "--model", "tiny", "--time-scale", "nan"], ["--time-scale", "finite"]),
    (["bench", "--model", "tiny", "--peak-gflops", "inf"], ["--peak-gflops", "finite"]),
    (["bench", "--model", "tiny", "--peak-gflops", "0"], ["--peak-gflops"]),
    (["trace", "--arrival-gap", str(10**9)], ["arrival_gap", "[0, 10000]"]),
    (["trace", "--prompt-len", "1", str(10**12)], ["prompt_len high", "[1, 1048576]"]),
    (["trace", "--num-requests", "100000", "--prompt-len", "4", "1000"], ["at most 10,000,000"]),
    (["trace", "--width", str(10**12)], ["--width", "[20, 100000]"]),
    (["trace", "--seed", str(10**23)], ["--seed"]),
]


@pytest.mark.parametrize("argv, needles", FLAG_ROWS, ids=[" ".join(a)[:60] for a, _ in FLAG_ROWS])
def test_measuring_flags_are_checked_before_any_work(argv, needles, capsys):
    rc, out, err = run_main(argv, capsys)
    assert rc == EXIT_USAGE and out == "", out          # nothing ran: no preset / machine line printed
    assert_one_line(err, *needles)


@pytest.mark.parametrize("argv, needles", [
    (["--num-blocks", "10000000000"], ["num_blocks=10,000,000,000", "more than the", "available"]),
    (["--max-num-seqs", str(10**11), "--num-blocks", str(10**11)], ["max_num_seqs=100,000,000,000"]),
])
def test_a_simulated_pool_larger_than_the_machine_is_refused(argv, needles, capsys):
    """The simulator has no KV tensors, but its block and slot tables are Python lists: 10**10 entries
    used to be allocated (or swapped) for minutes; now refused before the tables are built."""
    rc, out, err = run_main(["simulate", "--num-requests", "2", "--rates", "1", "--no-plots", *argv], capsys)
    assert rc == EXIT_USAGE and "simulated" not in out
    assert_one_line(err, *needles)


def test_a_nan_step_overhead_is_refused_instead_of_looping_forever():
    """``--step-overhead-ms nan`` made the simulated clock NaN and the run loop forever."""
    p = cli("simulate", "--step-overhead-ms", "nan", "--num-requests", "4", "--rates", "1", "--no-plots")
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == EXIT_USAGE and out == b""
    assert_one_line(err.decode(), "--step-overhead-ms must be a finite number", "got nan")


@pytest.mark.parametrize("out_flag", [["simulate", "--out"], ["bench", "--model", "tiny", "--out"],
                                      ["trace", "--out"]])
def test_an_unwritable_out_is_refused_before_the_run(out_flag, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    target = {"trace": "x.png"}.get(out_flag[0], "x")
    for bad, needle in ((f"/dev/null/{target}", "/dev/null"), (str(tmp_path / "a_file" / target), "a_file")):
        rc, out, err = run_main([*out_flag, bad], capsys)
        assert rc == EXIT_USAGE and out == ""
        assert_one_line(err, "--out", needle)


@pytest.mark.parametrize("content, needles", [
    (None, ["cannot read the calibration file", "No such file"]),
    ("dir", ["cannot read the calibration file", "Is a directory"]),
    ("", ["is not JSON"]),
    ("{not json", ["is not JSON"]),
    ("[1, 2]", ["must be a JSON object", "list"]),
    ('{"ceiling_gflops": 90}', ["lacks", "mem_bw_gbs"]),
    ('{"ceiling_gflops": "fast", "mem_bw_gbs": 1, "compute_eff": 1, "memory_eff": 1, "attn_eff": 1, '
     '"step_overhead_s": 0, "seq_overhead_s": 0}', ["ceiling_gflops must be a number", "fast"]),
    ('{"ceiling_gflops": 90, "mem_bw_gbs": 1, "compute_eff": 1, "memory_eff": 1, "attn_eff": 1, '
     '"step_overhead_s": NaN, "seq_overhead_s": 0}', ["step_overhead_s", "finite"]),
    ('{"ceiling_gflops": 0, "mem_bw_gbs": 1, "compute_eff": 1, "memory_eff": 1, "attn_eff": 1, '
     '"step_overhead_s": 0, "seq_overhead_s": 0}', ["peak_flops", "(0.0, inf]"]),
])
def test_a_bad_calibration_file_is_one_line(content, needles, tmp_path, capsys):
    path = tmp_path / "cal.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    rc, out, err = run_main(["simulate", "--preset", "smollm2-135m", "--calibration", str(path)], capsys)
    assert rc == EXIT_USAGE and out == ""
    assert_one_line(err, *needles)


@pytest.mark.parametrize("extra, needles", [
    (["--num-blocks", "10000000000"], ["KV cache", "10,000,000,000 device", "more than the", "available"]),
    (["--block-size", "1000000000000", "--max-num-seqs", "1", "--num-blocks", "1"],
     ["KV cache", "1,000,000,000,000 tokens", "lower num_blocks or block_size"]),
])
def test_a_kv_pool_larger_than_the_machine_is_one_line_exit_2(extra, needles, tiny_gguf, capsys):
    rc, out, err = run_main(["generate", "hi", "--model", str(tiny_gguf), *extra], capsys)
    assert rc == EXIT_USAGE and out == ""
    assert_one_line(err, *needles)
