"""A plain reference for the sampling knobs, from vLLM's documented rules (numpy, Python loops).

Shared by tests/runtime (fake logits) and tests/engine (a tiny model, recomputed from scratch every
step). It shares nothing with ``minicb.runtime.logits_processors`` or ``minicb.runtime.sampling``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from minicb.core.sampling_params import SamplingParams


class IdsTokenizer:
    """A stand-in tokenizer: ``"5 7"`` is the tokens [5, 7], with or without a leading space."""

    def encode(self, text, add_special_tokens=False):
        return [int(t) for t in text.split()]


# --- the rules ------------------------------------------------------------------------------
def ref_scores(logits, p: SamplingParams, prompt, out, eos, bad_ids) -> np.ndarray:
    """vLLM's order: bad words, min_tokens, logit_bias, repetition / frequency / presence penalties."""
    x = np.array(logits, dtype=np.float64)
    v = len(x)
    for w in bad_ids:
        prefix = list(w[:-1])
        if len(prefix) <= len(out) and (not prefix or list(out[len(out) - len(prefix):]) == prefix):
            x[w[-1]] = -math.inf
    if len(out) < p.min_tokens:
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos or eos is None else [eos])
        for t in stops:
            x[t] = -math.inf
    for t, b in p.logit_bias:
        x[t] += b
    for t in range(v):
        if t in prompt or t in out:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = out.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return x


def ref_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """temperature, min_p, top-k, top-p, as probabilities."""
    z = (x - x.max()) / p.temperature
    probs = np.exp(z) / np.exp(z).sum()
    keep = np.ones(len(x), dtype=bool)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    if p.top_k:
        kth = np.sort(np.where(keep, z, -np.inf))[::-1][min(p.top_k, len(x)) - 1]
        keep &= z >= kth
    q = np.where(keep, probs, 0.0)
    q /= q.sum()
    if p.top_p < 1.0:
        order = np.argsort(-q, kind="stable")
        before = 0.0
        for t in order:                  # keep tokens while the mass before them is below top_p
            if before >= p.top_p:
                q[t] = 0.0
            before += q[t] if q[t] else 0.0
        q /= q.sum()
    return q


def ref_generate(logit_rows, p: SamplingParams, prompt, eos, bad_ids) -> list[int]:
    """One request alone: a token per row of ``logit_rows`` (fake model outputs, one per step)."""
    g = None if p.greedy else torch.Generator().manual_seed(p.seed)
    out: list[int] = []
    for logits in logit_rows:
        x = ref_scores(logits, p, prompt, out, eos, bad_ids)
        if p.greedy:
            out.append(int(np.argmax(x)))
        else:
            out.append(int(torch.multinomial(torch.tensor(ref_probs(x, p)), 1, generator=g)))
    return out


