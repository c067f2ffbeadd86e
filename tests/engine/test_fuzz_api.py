"""A property-based fuzz of the public API and of the command line: whatever values and types a caller
passes, minicb answers with a result or one of its own errors (``MinicbError``: ``InvalidArgument``,
``RequestRejected``, ``ModelLoadError``), never another exception type and never a hang.

Hypothesis draws the arguments from ``ANY``: integers up to 10**400, every float including NaN, the
infinities and subnormals, bools, None, strings with lone surrogates, bytes, numpy and torch scalars
of every dtype (bool included), arrays and tensors with a shape, complex numbers, ``Decimal``,
``Fraction``, containers and plain objects. The targets:

* ``SamplingParams(**kwargs)``;
* ``LLM(tiny_model, **kwargs)`` and ``engine_for(tiny_model, SchedulerConfig(**kwargs))``;
* ``add_request`` / ``abort_request`` / ``step`` on a live engine (every request it accepts must then
  finish), ``generate`` with any prompts and parameters (text included, through a tiny tokenizer);
* ``minicb.entrypoints.cli.main(argv)`` in-process with argv lists built from every subcommand's flags
  and edge values (``nan``, ``1e-300``, ``1e23``, 400-digit numbers, non-UTF-8 bytes), plus random tokens. Its
  answer must be an exit code of the contract or argparse's ``SystemExit`` (2, or 0 for ``--help``).

Every call runs in a thread that must end within ``HANG_S`` (a hang fails the test instead of stalling
the suite), and the sizes that cost time (requests, tokens, slots) are only drawn small or invalid,
so the whole file stays within about a minute on two cores.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY, tiny_model
from hypothesis_profiles import examples as scaled
from minicb.core.config import SchedulerConfig
from minicb.core.errors import MinicbError
from minicb.core.sampling_params import SamplingParams
from minicb.engine.llm_engine import LLMEngine
from minicb.entrypoints.cli import main
from minicb.entrypoints.llm import LLM
from minicb.model.text.tokenizer import Tokenizer
from minicb.runtime.runner import engine_for
from robust_helpers import finishes as finishes_within
from tiny_files import write_gguf
from tokenizer_fixtures import tiny_gguf_tokenizer_metadata

HANG_S = 60.0
# A longer hunt than CI's, locally:
#   MINICB_FUZZ_SCALE=20 MINICB_FUZZ_RANDOM=1 pytest tests/engine/test_fuzz_api.py
SCALE = float(os.environ.get("MINICB_FUZZ_SCALE", "1"))
RANDOM = bool(os.environ.get("MINICB_FUZZ_RANDOM"))
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=not RANDOM)


def fuzz(examples: int) -> settings:
    """Deterministic by default (the same examples in every run: CI reproduces a failure), no
    per-example deadline (``finishes`` bounds each call instead)."""
    return settings(FUZZ, max_examples=max(1, int(scaled(examples) * SCALE)))

SCALARS = [np.int64(3), np.int32(-1), np.uint8(7), np.int64(2**62), np.float32(0.5), np.float64(math.nan),
           np.float16(2.0), np.bool_(True), np.array(3), np.array(0.5), np.array([1, 2]), torch.tensor(4),
           torch.tensor(0.25), torch.tensor(True), torch.tensor([1]), torch.tensor(2, dtype=torch.int8),
           1j, Decimal("1.5"), Fraction(1, 3), [], [1], (2,), {}, {"a": 1}, object(), b"\xff",
           bytearray(b"x")]
ANY = st.one_of(
    st.integers(-3, 40),                                    # small values: the ones that may be valid
    st.integers(-2**70, 2**70),
    st.sampled_from([10**400, -(10**400), 2**63, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([5e-324, 1e-320, 1e-300, 1e300, -0.0]),
    st.booleans(), st.none(),
    st.text(max_size=12), st.sampled_from(["caf\udce9", "\ud800", "", "0", "1e23", "nan"]),
    st.sampled_from(SCALARS),
)


def finishes(fn):
    """``fn()``'s result, or the exception it raised, from a thread that must end within ``HANG_S``."""
    return finishes_within(fn, HANG_S)


def only_minicb_errors(result) -> None:
    if isinstance(result, BaseException) and not isinstance(result, MinicbError):
        raise AssertionError(f"{type(result).__name__} escaped: {result!r}") from result


# --- SamplingParams ---------------------------------------------------------------------------------------
PARAM_NAMES = ["max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos"]


@fuzz(400)
@given(st.dictionaries(st.sampled_from(PARAM_NAMES), st.one_of(ANY, st.lists(ANY, max_size=3)), max_size=7))
def test_sampling_params_take_anything(kwargs):
    result = finishes(lambda: SamplingParams(**kwargs))
    only_minicb_errors(result)
    if isinstance(result, SamplingParams):       # what it holds is plain and in range
        assert type(result.max_tokens) is int and 1 <= result.max_tokens < 2**63
        assert type(result.temperature) is float and math.isfinite(result.temperature)
        assert type(result.top_p) is float and 0 < result.top_p <= 1
        assert all(type(t) is int for t in result.stop_token_ids)


# --- building an engine -----------------------------------------------------------------------------------
CONFIG_NAMES = ["max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk", "block_size", "num_blocks",
                "num_host_blocks", "max_model_len", "policy", "preemption_mode", "scheduling_policy",
                "enable_prefix_caching"]
LLM_NAMES = ["dtype", "device", "seed", "attn_backend"]
TEXT_VALUES = st.sampled_from(["continuous", "static", "dynamic", "swap", "recompute", "fcfs", "priority",
                               "float64", "float32", "bfloat16", "int8", "cpu", "cuda", "cuda:0", "tpu",
                               "auto", "reference", "flash9", "cpu\udce9"])
# tensor_parallel_size > 1 starts processes: only values that are invalid or 1 are drawn for it
TP_VALUES = st.sampled_from([1, 0, -1, 10**30, 1.5, "2", None, True, np.int64(1), torch.tensor(1)])


@fuzz(120)
@given(st.dictionaries(st.sampled_from(CONFIG_NAMES + LLM_NAMES), st.one_of(ANY, TEXT_VALUES), max_size=5),
       st.one_of(st.none(), TP_VALUES))
def test_an_llm_of_any_configuration_is_built_or_refused(kwargs, tp):
    extra = {} if tp is None else {"tensor_parallel_size": tp}
    result = finishes(lambda: LLM(tiny_model(), **kwargs, **extra))
    only_minicb_errors(result)
    if isinstance(result, LLM):
        result.shutdown()


@fuzz(80)
@given(st.dictionaries(st.sampled_from(CONFIG_NAMES), st.one_of(ANY, TEXT_VALUES), max_size=4), ANY)
def test_an_engine_of_any_configuration_is_built_or_refused(kwargs, seed):
    result = finishes(lambda: engine_for(tiny_model(), SchedulerConfig(**kwargs), seed=seed))
    only_minicb_errors(result)


# --- requests on a live engine ----------------------------------------------------------------------------
SMALL = dict(max_num_seqs=3, max_num_batched_tokens=32, block_size=4, num_blocks=24, max_model_len=64)


def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata())


def text_engine() -> LLMEngine:
    import dataclasses

    tok = tokenizer()
    cfg = SchedulerConfig(**SMALL)
    return engine_for(tiny_model(dataclasses.replace(TINY, vocab_size=tok.vocab_size)), cfg, tok)


PROMPTS = st.one_of(
    st.lists(st.one_of(st.integers(0, 60), ANY), max_size=6),                 # token ids, mostly valid
    st.text(max_size=40), st.sampled_from(["hello", "caf\udce9", "", " ", "a" * 3000, "<|im_start|>"]),
    ANY,
)
SMALL_PARAMS = st.builds(SamplingParams, max_tokens=st.integers(1, 4),
                         temperature=st.sampled_from([0.0, 1e-5, 0.7, 1e6]), seed=st.integers(0, 2**63 - 1),
                         top_p=st.sampled_from([1.0, 1e-9, 0.5]), top_k=st.sampled_from([0, 1, 10**18]))
PARAMS = st.one_of(st.none(), SMALL_PARAMS, ANY)
CALLS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.one_of(st.none(), st.sampled_from(["a", "b", "0", "1"]), ANY), PROMPTS,
              PARAMS, st.one_of(st.none(), ANY), st.one_of(st.just(0), ANY)),
    st.tuples(st.just("abort"), st.one_of(st.sampled_from(["a", "b", "0", "1"]), ANY)),
    st.tuples(st.just("step")),
), max_size=10)


def play(eng: LLMEngine, calls) -> None:
    """Apply ``calls``; then every request the engine accepted must finish (bounded number of steps)."""
    accepted, ended = set(), set()
    for call in calls:
        if call[0] == "add":
            _, rid, prompt, params, arrival, priority = call
            accepted.add(eng.add_request(rid, prompt, params, arrival_time=arrival, priority=priority))
        elif call[0] == "abort":
            out = eng.abort_request(call[1])
            if out is not None:
                ended.add(out.request_id)
        else:
            ended |= {o.request_id for o in eng.step() if o.finished}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        ended |= {o.request_id for o in eng.step() if o.finished}
    assert not eng.has_unfinished_requests(), "requests still unfinished after 500 steps"
    assert accepted <= ended, f"accepted but never ended: {accepted - ended}"


@fuzz(200)
@given(CALLS)
def test_any_sequence_of_requests_and_aborts_ends_cleanly(calls):
    eng = text_engine()

    def run():
        for i in range(len(calls)):          # each call separately: a refused one must change nothing
            try:
                play(eng, calls[i:i + 1])
            except MinicbError:
                pass
        play(eng, [])

    only_minicb_errors(finishes(run))


@fuzz(200)
@given(st.one_of(PROMPTS, st.lists(PROMPTS, max_size=4)),
       st.one_of(PARAMS, st.lists(PARAMS, max_size=4)))
def test_generate_takes_anything(prompts, params):
    llm = _TEXT_LLM.get("llm")
    if llm is None:
        llm = _TEXT_LLM["llm"] = LLM(text_engine().runner.model, tokenizer=tokenizer(), **SMALL)
    result = finishes(lambda: llm.generate(prompts, params))
    only_minicb_errors(result)
    if isinstance(result, list):
        assert all(o.finished for o in result)
    assert not llm.engine.has_unfinished_requests()


_TEXT_LLM: dict = {}


# --- the command line -------------------------------------------------------------------------------------
INT_VALUES = ["0", "-1", "1", "2", "3", "1e23", str(10**30), "9" * 400, "nan", "abc", "", "caf\udce9", "0x10"]
FLOAT_VALUES = ["0", "-1", "0.5", "1", "2", "1000", "inf", "-inf", "nan", "1e-300", "1e300", "abc", "\udcff"]
COMMON = {"--seed": INT_VALUES, "--policy": ["continuous", "static", "dynamic", "fifo"],
          "--max-num-seqs": INT_VALUES, "--max-num-batched-tokens": INT_VALUES, "--block-size": INT_VALUES,
          "--num-blocks": INT_VALUES + ["10000000000"], "--long-prefill-chunk": INT_VALUES}
FLAGS = {
    "generate": {**COMMON, "--max-tokens": ["1", "2", "0", "-1", "abc", "99999"],
                 "--temperature": FLOAT_VALUES, "--top-k": INT_VALUES, "--top-p": FLOAT_VALUES,
                 "--chat": None,
                 "--dtype": ["float64", "int8"], "--device": ["cpu", "cuda", "tpu", "cuda:99"],
                 "--attn-backend": ["reference", "auto", "flash9"],
                 "--preemption-mode": ["swap", "recompute", "drop"], "--no-prefix-caching": None,
                 "--tp": ["1", "0", "-1", "abc"], "--file": ["FILE", "/dev/zero", "/nonexistent", "/tmp"],
                 "--model": ["MODEL", "/nonexistent.gguf", "/dev/null", "/tmp"]},
    "trace": {**COMMON, "--num-requests": ["1", "2", "0", "-1", "1e23"], "--arrival-gap": INT_VALUES,
              "--num-host-blocks": INT_VALUES, "--preemption-mode": ["swap", "recompute"],
              "--prompt-len": ["1 4", "0 3", "5 2", "1 " + str(10**12)],
              "--output-len": ["1 3", "2 1", "-1 2"],
              "--width": INT_VALUES + ["40"], "--color": ["never", "always", "sometimes"],
              "--out": ["/dev/null/x.png", "x.txt", "/nonexistent/dir/x.svg"]},
    "simulate": {**COMMON, "--num-requests": ["1", "2", "0", "-1"], "--rates": FLOAT_VALUES + ["1,2", "2,,3"],
                 "--step-overhead-ms": FLOAT_VALUES, "--seq-overhead-us": FLOAT_VALUES,
                 "--preset": ["llama-3-8b", "smollm2-135m", "gpt-5"], "--max-model-len": INT_VALUES,
                 "--output-div": FLOAT_VALUES, "--max-prompt": INT_VALUES, "--max-output": INT_VALUES,
                 "--min-len": INT_VALUES, "--max-total": INT_VALUES, "--plot-rate": FLOAT_VALUES,
                 "--calibration": ["/nonexistent", "/tmp", "/dev/null", "FILE"],
                 "--out": ["/dev/null/x", "OUT"],
                 "--trace": ["sharegpt", "azure-conv", "nope"], "--policy": ["all", "static", "fifo"]},
    "bench": {**COMMON, "--num-requests": ["1", "2", "0", "-1"], "--rate": FLOAT_VALUES, "--replay": None,
              "--time-scale": FLOAT_VALUES, "--threads": ["0", "1", "-1", "100000", "abc"],
              "--peak-gflops": FLOAT_VALUES, "--clock": ["wall", "cpu", "sun"], "--output-div": FLOAT_VALUES,
              "--max-prompt": INT_VALUES, "--trace": ["sharegpt", "azure-code", "nope"],
              "--out": ["/dev/null/x", "OUT"], "--policy": ["all", "continuous", "fifo"]},
}
# Appended last (argparse keeps the last value): the sizes that cost time stay small whatever came first.
SAFE_TAIL = {
    "generate": ["--model", "MODEL", "--max-tokens", "2"],
    "trace": ["--num-requests", "2", "--prompt-len", "1", "4", "--output-len", "1", "3"],
    "simulate": ["--num-requests", "2", "--max-output", "4", "--no-plots", "--no-progress"],
    "bench": ["--model", "tiny", "--num-requests", "2", "--max-prompt", "8", "--max-output", "2",
              "--no-plots", "--no-progress", "--peak-gflops", "1", "--max-total", "64"],
}
JUNK = st.sampled_from(["--", "-x", "--help", "--bogus", "caf\udce9", "-", "--max-tokens=3", "\x00",
                        "--rate=", "a b"])


@st.composite
def argvs(draw):
    command = draw(st.sampled_from(sorted(FLAGS) * 4 + ["export-hf", "serve", "frobnicate", ""]))
    argv = [command] if command else []
    flags = FLAGS.get(command, {})
    if command == "generate":
        argv.append(draw(st.sampled_from(["hi", "hi", "caf\udce9", "", "a b"])))
    for _ in range(draw(st.integers(0, 4))):
        if flags and draw(st.integers(0, 7)):      # mostly real flags; now and then a stray token
            flag = draw(st.sampled_from(sorted(flags)))
            argv.append(flag)
            if flags[flag] is not None:
                argv += draw(st.sampled_from(flags[flag])).split(" ")
        else:
            argv.append(draw(JUNK))
    if command in ("export-hf", "serve"):
        argv.append("--help")         # they write a directory or start a server: only their parsers
    return argv + SAFE_TAIL.get(command, [])


@pytest.fixture(scope="module")
def cli_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_cli")
    (d / "prompts.txt").write_text("one\ntwo\n")
    return {"MODEL": str(write_gguf(d / "tiny.gguf")), "FILE": str(d / "prompts.txt"), "OUT": str(d / "out")}


EXIT_CODES = {0, 1, 2, 130, 141}


def test_the_command_line_takes_any_argv(cli_paths):
    threads = torch.get_num_threads()

    @fuzz(100)
    @given(argvs())
    def run(argv):
        argv = [cli_paths.get(a, a) for a in argv]
        sink_out, sink_err = io.StringIO(), io.StringIO()

        def call():
            try:
                with contextlib.redirect_stdout(sink_out), contextlib.redirect_stderr(sink_err):
                    return main(argv)
            except SystemExit as e:        # argparse: 2 for a usage error, 0 for --help
                return ("exit", e.code)

        try:
            result = finishes(call)
        finally:
            torch.set_num_threads(threads)  # --threads changes this process's setting
        err = sink_err.getvalue()
        assert not isinstance(result, BaseException), (argv, result, err[-300:])
        if isinstance(result, tuple):
            assert result[1] in (0, 2), (argv, result)
        else:
            assert result in EXIT_CODES, (argv, result, err[-300:])
        assert "Traceback" not in err, (argv, err[-600:])
        if result in (2, ("exit", 2)):
            # one line, not counting the model's load line
            said = [ln for ln in err.strip().splitlines() if " linear layers on " not in ln]
            assert len(said) == 1, (argv, err)

    run()
    assert os.getcwd()                        # nothing above changed the working directory
