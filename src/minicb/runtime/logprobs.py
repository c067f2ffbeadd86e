"""Logprobs from logits rows: a token's log-probability, its rank, and the top-k of its row.

Two callers, one function (``row_logprobs``):

* the sampler, for a generated token (``SamplingParams.logprobs = k``): the row it sampled from;
* the runner, for prompt tokens (``SamplingParams.prompt_logprobs = k``): the rows of a prompt chunk,
  row ``p`` scoring the prompt token at position ``p + 1``. Those rows come out of the prefill forward
  that runs anyway (the packer asks the model for their logits too), so no second pass is made.

**Which distribution.** ``log_softmax`` of the row *after* the request's per-row logits processors
(penalties, ``logit_bias``, a grammar's mask: what changes which tokens may come) and *before*
temperature, top-k and top-p (what changes how boldly one is drawn). That is vLLM V1's default,
``logprobs_mode="raw_logprobs"`` ("before applying any logit post-processing such as temperature
scaling or penalty adjustments"), moved past the processors because a masked token really has
probability 0 (logprob ``-inf``) for this request. Why not after temperature, as vLLM V0 did (and
V1's ``processed_logprobs``)? Greedy rows have no temperature to apply, so their logprobs would need
a special case anyway; the figures would change with a sampling knob the client may set for other
reasons, so the same text would score differently at temperature 0.7 and 1; top-k/top-p would turn
most of the vocabulary into ``-inf`` and make ``top_logprobs`` meaningless. What a client scoring
text (lm-eval, a reranker) wants is the model's own distribution, which this is; at temperature 1
without top-k/top-p it is exactly the distribution the token was drawn from. Prompt rows have no
processors: their logprobs are the model's raw distribution.

Numbers: ``log_softmax`` of the row in the logits' own precision when that is float32 or float64
(float64 for a float64 model: the 1e-6 comparison with transformers is on those), float32 for half
types. The rank is vLLM's: 1 + the number of tokens with a strictly larger logprob (counted on the
logits, whose order is the logprobs' without the ties float32 rounding makes). Prompt rows are
done ``CHUNK_ROWS`` at a time, and nothing wider than the chunk is copied: the float64 copy (and its
NaN-masked copy) that every row used to get made an 8,000-row prompt with ``prompt_logprobs: 20``
cost several times its own prefill (``python bench/logprob_memory.py`` prints the cost now).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Sequence

import torch

from minicb.engine.logprobs import TokenLogprobs

CHUNK_ROWS = 64       # prompt rows scored at once (64 x 49,152 x 4 B = 12.6 MB of float32 logprobs)


def row_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprobs]:
    """For each row ``i`` of ``logits`` (``[R, V]``): ``targets[i]``'s logprob and rank, and the
    ``k`` most likely tokens (best first) with theirs. NaN logits count as ``-inf``."""
    out: list[TokenLogprobs] = []
    for lo in range(0, logits.shape[0], CHUNK_ROWS):
        x = logits[lo:lo + CHUNK_ROWS]
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        lp = torch.log_softmax(x, dim=-1)
        if bool(torch.isnan(lp[:, 0]).any()):          # rare: a NaN logit makes its whole row NaN here
            x = x.masked_fill(torch.isnan(x), float("-inf"))
            lp = torch.log_softmax(x, dim=-1)
        tgt = torch.tensor(targets[lo:lo + CHUNK_ROWS], dtype=torch.long, device=x.device)
        # the rank on the logits themselves: the same order as the logprobs', without float32's ties
        ranks = (torch.count_nonzero(x > x.gather(1, tgt[:, None]), dim=1) + 1).tolist()
        mine = lp.gather(1, tgt[:, None])[:, 0].tolist()
        if k:
            top = torch.topk(lp, min(k, lp.shape[1]), dim=1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        else:
            top_ids = top_lps = [[] for _ in mine]
        out += [TokenLogprobs(int(t), m, r, tuple(i), tuple(v))
                for t, m, r, i, v in zip(tgt.tolist(), mine, ranks, top_ids, top_lps)]
    return out


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library is not glibc (musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_heap() -> None:
    """Hand the C heap's free pages back to the system after a step that scored prompt rows.

    Scoring a chunk allocates tensors of ``CHUNK_ROWS x V`` (12.6 MB for SmolLM2) again and again. glibc
    serves allocations of that size from its heap once a freed one has raised its mmap threshold, and a
    heap keeps freed memory resident: without this, resident memory stayed tens of MB higher (up to
    ~100 MB, varying from request to request) after prompt-logprob requests had ended, all of it free
    memory that ``malloc_trim`` returns (``python bench/logprob_memory.py`` with and without
    ``--keep-heap``). A few milliseconds, in steps that score prompt rows only."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
