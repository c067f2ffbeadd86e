"""The benchmark workloads, built the same way by every benchmark so their numbers can be compared.

* W1: 32 prompts of random token ids (seed 0, lengths uniform in 16..128), 64 new tokens each.
* W2: 64 requests whose (prompt, output) lengths are drawn (seed 0) from the ShareGPT lengths of the
  vLLM SOSP'23 artifact (shipped in the package: ``src/minicb/data/sharegpt_vllm_sosp23_opt_lengths.csv``,
  see SOURCES.md there; ``minicb.measure.workloads`` reads it);
  prompt = ``min(p, 256)`` random ids, output = ``clamp(round(o / 4), 1, 128)``.
* LP (long prompts): 48 requests whose lengths are drawn (seed 0) from the arXiv-summarisation trace
  (``bench/data/arxiv_summarization_lengths.csv``, see SOURCES.md there), both scaled by 1/4:
  prompt = ``max(round(p / 4), 1)`` random ids (at most 1,014), output = ``max(round(o / 4), 1)``.
  Seed 0: 30,617 prompt and 3,662 output tokens, prefill-heavy where W2 is decode-heavy.

EOS is ignored everywhere (``ignore_eos``), so every system produces exactly the same number of tokens.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np

from minicb.measure import workloads as _pkg
from minicb.measure.workloads import TRACES  # noqa: F401  (re-exported: the traces live in the package)

ARXIV = pathlib.Path(__file__).resolve().parent / "data" / "arxiv_summarization_lengths.csv"


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def trace_lengths(trace: str = "sharegpt") -> np.ndarray:
    """``[n, 2]`` array of (prompt, output) token lengths of a trace shipped in ``minicb/data``."""
    return np.array(_pkg.trace_lengths(trace), dtype=np.int64)


def random_ids(rng: np.random.Generator, n: int, vocab: int = 49152) -> list[int]:
    # skip the first ids (special tokens of SmolLM2) so prompts are ordinary text tokens
    return rng.integers(100, vocab, size=n).tolist()


def w1(num: int = 32, new_tokens: int = 64, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    lens = rng.integers(16, 129, size=num)
    return Workload("W1", [random_ids(rng, int(n)) for n in lens], [new_tokens] * num)


def w2(num: int = 64, seed: int = 0, max_prompt: int = 256, out_div: int = 4, max_out: int = 128,
       trace: str = "sharegpt") -> Workload:
    rng = np.random.default_rng(seed)
    lengths = trace_lengths(trace)
    picks = lengths[rng.integers(0, len(lengths), size=num)]
    prompts = [random_ids(rng, max(1, min(int(p), max_prompt))) for p, _ in picks]
    outs = [int(min(max(round(o / out_div), 1), max_out)) for _, o in picks]
    return Workload("W2", prompts, outs)


def lp(num: int = 48, seed: int = 0, div: int = 4) -> Workload:
    """Long prompts: ``num`` rows of the arXiv-summarisation trace, lengths divided by ``div``."""
    rng = np.random.default_rng(seed)
    lengths = np.loadtxt(ARXIV, delimiter=",", skiprows=1, dtype=np.int64)
    picks = lengths[rng.integers(0, len(lengths), size=num)]
    prompts = [random_ids(rng, max(round(int(p) / div), 1)) for p, _ in picks]
    return Workload("LP", prompts, [max(round(int(o) / div), 1) for _, o in picks])


WORKLOADS = {"W1": w1, "W2": w2, "LP": lp}
