"""Prompt logprobs over HTTP equal transformers' float64 log-softmax to 1e-6 (the real model).

The request is the one lm-eval's ``local-completions`` sends for a loglikelihood task (its
``_create_payload(generate=False)``): a batch of token-id prompts (``--batch_size 4``), ``echo: true,
logprobs: 1, max_tokens: 1, temperature: 0, seed: 1234``. The answer is read the way lm-eval reads
it (``parse_logprobs``: choices sorted by ``index``, ``token_logprobs[ctxlen:-1]`` summed, greedy when
each of those is the largest of its ``top_logprobs``), so this is the loglikelihood lm-eval would
compute, without lm-eval. The oracle is transformers reading the same GGUF itself, in float64, on the
same token ids, with its SDPA attention: its eager attention takes the softmax in float32 even for a
float64 model (a 1e-5 difference in logprobs), SDPA keeps float64 and then agrees with minicb exactly
(both take RMSNorm statistics and rotary angles in float32, the same way). The server runs a small
step budget, so the prompts are prefilled in several chunks and batched with each other: the rows
still match one whole forward.
"""

from __future__ import annotations

import contextlib
from operator import itemgetter

import pytest
import torch

from serve_helpers import MODEL, http, running_server

pytestmark = [pytest.mark.slow, pytest.mark.model]

CONTEXTS = ["Question: What is the capital of France?\nAnswer:",
            "The quick brown fox jumps over the",
            "2 + 2 ="]
CONTINUATIONS = [" Paris", " Berlin", " lazy dog", " 4", " five"]


def lm_eval_payload(prompts: list[list[int]]) -> dict:
    """``LocalCompletionsAPI._create_payload(messages, generate=False)`` of lm-eval 0.4."""
    return {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}


def lm_eval_parse(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """``LocalCompletionsAPI.parse_logprobs`` of lm-eval 0.4."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))))
    return res


@contextlib.contextmanager
def sdpa(hf_model):
    """The shared transformers model with SDPA attention for a while (restored: the fixture is shared)."""
    before = hf_model.config._attn_implementation
    hf_model.config._attn_implementation = "sdpa"
    try:
        yield hf_model
    finally:
        hf_model.config._attn_implementation = before


@pytest.fixture(scope="module")
def url(smollm2_path):
    with running_server(smollm2_path, max_num_seqs=4, num_blocks=64, block_size=16, max_model_len=512,
                        max_num_batched_tokens=24) as (_server, url):
        yield url


def test_lm_eval_loglikelihood_request_equals_transformers_float64(url, hf_smollm2, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    pairs = [(c, k) for c in CONTEXTS for k in CONTINUATIONS][:8]
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        ctx = tok.encode(context, add_special_tokens=False)
        prompts.append(ctx + tok.encode(continuation, add_special_tokens=False))
        ctxlens.append(len(ctx))
    got_tokens, got = [], []
    for lo in range(0, len(prompts), 4):              # lm-eval --batch_size 4
        body = lm_eval_payload(prompts[lo:lo + 4])
        status, _, out = http("POST", url + "/v1/completions", body, timeout=300)
        assert status == 200, out
        got += lm_eval_parse(out, ctxlens[lo:lo + 4])
        choices = sorted(out["choices"], key=itemgetter("index"))
        got_tokens += [c["logprobs"]["token_logprobs"] for c in choices]
    worst = 0.0
    for ids, ctxlen, token_lps, (ll, greedy) in zip(prompts, ctxlens, got_tokens, got):
        with sdpa(hf_smollm2), torch.no_grad():
            logits = hf_smollm2(torch.tensor([ids])).logits[0].to(torch.float64)
        ref = torch.log_softmax(logits, dim=-1)
        want = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
        assert token_lps[0] is None and len(token_lps) == len(ids) + 1     # + the one generated token
        for a, b in zip(token_lps[1:len(ids)], want):
            worst = max(worst, abs(a - b))
        assert ll == pytest.approx(sum(want[ctxlen - 1:]), abs=1e-6)
        ref_greedy = all(int(ref[j - 1].argmax()) == ids[j] for j in range(ctxlen, len(ids)))
        assert greedy == ref_greedy
    assert worst < 1e-6, worst
