"""Request workloads from public traces: token lengths and arrival times, no text. Torch-free.

The traces ship with the package (``minicb/data``, attribution in ``minicb/data/SOURCES.md``)::

    sharegpt     first-turn ShareGPT prompt / response lengths (vLLM SOSP'23 artifact), no timestamps
    azure-conv   one hour of Azure's conversation service (2023-11-16): timestamps + lengths
    azure-code   the same for Azure's coding assistant (very bursty)

A benchmark request is a prompt of random token ids with the trace's length (the text is not public)
and an output length that the engine is told to produce exactly (``ignore_eos``), so every policy and
every system computes the same tokens. Lengths can be scaled down for a small machine the way
``bench/throughput.py`` does: ``prompt = clamp(p, 1, max_prompt)``, ``output = clamp(round(o /
output_div), 1, max_output)``.

Arrivals: ``poisson_arrivals(n, rate, seed)`` (exponential gaps, the usual serving benchmark), or
``replay`` the trace's own timestamps (Azure only), optionally sped up by ``time_scale``.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources

from minicb.core.errors import InvalidArgument, check_int

TRACES = {
    "sharegpt": ("sharegpt_vllm_sosp23_opt_lengths.csv", "num_prefill_tokens", "num_decode_tokens"),
    "azure-conv": ("AzureLLMInferenceTrace_conv.csv", "ContextTokens", "GeneratedTokens"),
    "azure-code": ("AzureLLMInferenceTrace_code.csv", "ContextTokens", "GeneratedTokens"),
}


def data_path(name: str):
    """A file under the package's ``data`` folder (a ``Traversable``; ``str()`` of it is a path)."""
    return resources.files("minicb").joinpath("data", *name.split("/"))


def _check_trace(trace: str) -> None:
    if trace not in TRACES:
        raise InvalidArgument(f"trace must be one of {tuple(TRACES)}, got {trace!r}")


@cache
def _rows(trace: str) -> tuple[tuple[tuple[int, int], ...], tuple[float, ...] | None]:
    name, pcol, ocol = TRACES[trace]
    with data_path(name).open(newline="") as f:
        rows = list(csv.DictReader(f))
    lengths = tuple((int(r[pcol]), int(r[ocol])) for r in rows)
    if "TIMESTAMP" not in rows[0]:
        return lengths, None
    stamps = [datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows]
    t0 = stamps[0]
    return lengths, tuple(t - t0 for t in stamps)


def trace_lengths(trace: str = "sharegpt") -> list[tuple[int, int]]:
    """Every (prompt, output) token-length pair of ``trace``, in file order."""
    _check_trace(trace)
    return list(_rows(trace)[0])


def trace_timestamps(trace: str) -> list[float]:
    """Arrival times (seconds from the first request) of an Azure trace; ShareGPT has none."""
    _check_trace(trace)
    stamps = _rows(trace)[1]
    if stamps is None:
        raise InvalidArgument(f"trace {trace!r} has no timestamps; use Poisson arrivals (--rate) instead")
    return list(stamps)


@dataclass(slots=True, frozen=True)
class Request:
    """One benchmark request: a prompt of ``prompt_len`` ids, exactly ``output_len`` new tokens, an
    arrival time in seconds from the start of the run."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival: float


def scale_lengths(p: int, o: int, max_prompt: int | None = None, output_div: float = 1.0,
                  max_output: int | None = None) -> tuple[int, int]:
    """The scaling of ``bench/throughput.py``: clip the prompt, divide and clip the output."""
    p = max(1, p if max_prompt is None else min(p, max_prompt))
    o = max(1, round(o / output_div))
    return p, o if max_output is None else min(o, max_output)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times of a Poisson process of ``rate`` requests/s starting at 0 (first at 0);
    ``rate == inf`` means everything arrives at once."""
    if not rate > 0:
        raise InvalidArgument(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    return out


def make_requests(trace: str = "sharegpt", num_requests: int = 100, *, rate: float | None = None,
                  replay: bool = False, time_scale: float = 1.0, seed: int = 0,
                  max_prompt: int | None = None, output_div: float = 1.0, max_output: int | None = None,
                  min_len: int = 1, max_total: int | None = None) -> list[Request]:
    """``num_requests`` requests drawn from ``trace`` (reproducible for ``seed``).

    Poisson (``rate``): lengths drawn at random from the trace's rows (after the filter ``prompt,
    output >= min_len``, ``prompt + output <= max_total`` on the raw lengths). Replay: the trace's first
    rows in order with their own timestamps divided by ``time_scale`` (2 = twice as fast).
    """
    _check_trace(trace)
    check_int("num_requests", num_requests, lo=1, hi=10_000_000)
    check_int("min_len", min_len, lo=1)
    if max_total is not None:
        check_int("max_total", max_total, lo=2)
    if (rate is None) == (not replay):
        raise InvalidArgument("give exactly one of rate (Poisson arrivals) or replay=True")
    if not time_scale > 0:
        raise InvalidArgument(f"time_scale must be > 0, got {time_scale}")
    if not output_div > 0:
        raise InvalidArgument(f"output_div must be > 0, got {output_div}")
    rows = trace_lengths(trace)
    if replay:
        stamps = trace_timestamps(trace)
        if num_requests > len(rows):
            raise InvalidArgument(f"num_requests={num_requests} exceeds the {len(rows)} rows of {trace!r}")
        picks, arrivals = rows[:num_requests], [t / time_scale for t in stamps[:num_requests]]
    else:
        keep = [(p, o) for p, o in rows
                if p >= min_len and o >= min_len and (max_total is None or p + o <= max_total)]
        if not keep:
            raise InvalidArgument(f"no row of {trace!r} passes min_len={min_len}, max_total={max_total}")
        rng = random.Random(seed)
        picks = [keep[rng.randrange(len(keep))] for _ in range(num_requests)]
        arrivals = poisson_arrivals(num_requests, rate, seed + 1)
    return [Request(f"r{i}", *scale_lengths(p, o, max_prompt, output_div, max_output), t)
            for i, ((p, o), t) in enumerate(zip(picks, arrivals))]


def random_prompt(rng: random.Random, n: int, vocab: int, low: int = 100) -> list[int]:
    """``n`` random token ids in ``[low, vocab)`` (SmolLM2's first ids are special tokens)."""
    low = min(low, max(vocab - 1, 0))
    return [rng.randrange(low, vocab) for _ in range(n)]


# Sixteen varied prompts for checks on the real model (tests against transformers, the GPU check):
# the first 12 are used as they are, the last 4 through the model's chat template.
SMOLLM2_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like apples. ->",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Les mathématiques sont",
    "A haiku about autumn:\n",
    "import numpy as np\n\n# compute the mean of an array\n",
    "The three primary colors are",
    "Water is made of hydrogen and",
    "In 1969, the first humans",
    "My favourite recipe for pancakes needs flour, eggs, milk and",
    "Hello!",
    "The quick brown fox jumps over the lazy dog. " * 6 + "Then the fox",
    ("Photosynthesis is the process by which green plants and some other organisms use sunlight to "
     "synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves the "
     "green pigment chlorophyll and generates oxygen as a byproduct. Summarize this in one sentence:"),
)


def smollm2_prompt_ids(tokenizer) -> list[list[int]]:
    """Token ids of ``SMOLLM2_PROMPTS``: 12 plain prompts, then 4 wrapped in the chat template."""
    plain = [tokenizer.encode(p) for p in SMOLLM2_PROMPTS[:12]]
    return plain + [tokenizer.encode(tokenizer.apply_chat_template(p)) for p in SMOLLM2_PROMPTS[12:]]
