"""``greedy_head``: the greedy tokens of a step from an estimate, its bound and the few panels that could
hold the argmax, against ``argmax`` of the whole LM head (the skinny kernel's bfloat16 product).

What could make it wrong, and the case that would show it: a bound too tight (a row whose estimate
ranks another output first by more than the rounding of small activations can explain; a mutant
that drops the bound's first term picks the wrong token there); a tie in bfloat16 (two identical
weight rows, and rows one bfloat16 step apart: the first index must win, as argmax's); a vocabulary
that is not a multiple of the panels; the plain C estimate and 1, 2 or 3 threads; a row that is not
finite (no tokens: the caller takes every logit). The engine's tokens with the head and without it
are the same, and it is asked only in steps where every row is plain greedy.
"""
from __future__ import annotations

import pytest
import torch

from minicb import LLM, SamplingParams
from minicb.fastpaths import greedy_head, skinny_gemm
from minicb.fastpaths.settings import Settings
from preconditions import unavailable

BUILDS = [(), ("-mno-avx512f",)]          # the vpdpbusd estimate (where the CPU has it), the plain C one


@pytest.fixture(autouse=True)
def built():
    for flags in BUILDS:
        if greedy_head.ckernels.why_not(lambda flags=flags: greedy_head.load(flags)):
            unavailable("no C compiler here: the greedy head is not built")
    if skinny_gemm.unavailable_reason():
        unavailable("no C compiler here: the skinny kernel is not built")


def head_of(weight: torch.Tensor, flags=()) -> tuple[greedy_head.GreedyHead, torch.Tensor]:
    panels = skinny_gemm.pack(weight)
    return greedy_head.GreedyHead(weight, panels, flags), panels


def argmax_of_the_product(x, panels, vocab) -> list[int]:
    """What a greedy step takes without the head: the first largest of the bfloat16 logits."""
    logits = skinny_gemm.matmul(x, panels, x.shape[1], vocab)
    return torch.max(logits.float(), dim=-1).indices.tolist()


def tricky_case(vocab: int = 1000, n_in: int = 96, rows: int = 40, seed: int = 0):
    """Random weights with ties and near-ties, and rows aimed at them."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, n_in, generator=g) * 0.05).to(torch.bfloat16)
    w[700] = w[10]                                                     # an exact tie: 10 must win
    w[701] = w[10]
    w[701, 0] = (w[10, 0].float() * (1 + 2 ** -7)).to(torch.bfloat16)   # a near-tie: one bfloat16 step
    x = torch.randn(rows, n_in, generator=g)
    x[:8] = w[10].float() * 40 + torch.randn(8, n_in, generator=g) * 0.05   # rows whose best is 10/700/701
    x[8:12] = w[999].float() * 40                                      # the last, partial, panel
    return w, x.to(torch.bfloat16)


@pytest.mark.parametrize("flags", BUILDS, ids=["default", "plain-c"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_tokens_are_argmax_of_the_whole_product(flags, threads):
    w, x = tricky_case()
    head, panels = head_of(w, flags)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = head.tokens(x)
    finally:
        torch.set_num_threads(old)
    want = argmax_of_the_product(x, panels, w.shape[0])
    assert got == want
    assert {10, 999} <= set(want) and 700 not in want           # the ties went to the first index
    assert 0 < head.recomputed < x.shape[0] * 16                 # some panels, far from all 16 a row


@pytest.mark.parametrize("flags", BUILDS, ids=["default", "plain-c"])
def test_a_row_whose_estimate_ranks_the_wrong_output_first(flags):
    """Block 0 of the row: one outlier (100) and 31 values of 0.3, which round to 0 beside it (s =
    100 / 127). Output 5 weighs the outlier 1.0, output 900 weighs it 0.95 and the small values 1.0:
    the estimate says 5 (100 against 95), the logits say 900 (104.3 against 100). Only a bound that
    counts the rounded-away activations keeps 900 in the running."""
    w = torch.zeros(1000, 64)
    w[5, 0] = 1.0
    w[900, 0], w[900, 1:32] = 0.95, 1.0
    w[11:20, 40] = 0.5                                           # others, far below
    x = torch.zeros(3, 64)
    x[:, 0], x[:, 1:32], x[:, 32:] = 100.0, 0.3, 0.01
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    head, panels = head_of(w, flags)
    assert argmax_of_the_product(x, panels, 1000) == [900] * 3
    assert head.tokens(x) == [900] * 3


@pytest.mark.parametrize("flags", BUILDS, ids=["default", "plain-c"])
def test_a_row_whose_weights_rounding_ranks_the_wrong_output_first(flags):
    """The row is 127 and zeros (rounded exactly: s = 1). Output 3 weighs it 1.03125, the largest of
    its block (rounded exactly); output 800 weighs it 1.0625 beside a 31.75 of its block, whose bytes
    are quarters: 1.0 in the estimate. The estimate says 3 (131.0 against 127.0), the logits say 800
    (134.9 against 131.0). Only a bound that counts the weights' rounding keeps 800."""
    w = torch.zeros(1000, 64)
    w[3, 0] = 1.03125
    w[800, 0], w[800, 1] = 1.0625, 31.75
    x = torch.zeros(2, 64)
    x[:, 0] = 127.0
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    head, panels = head_of(w, flags)
    assert argmax_of_the_product(x, panels, 1000) == [800] * 2
    assert head.tokens(x) == [800] * 2


def test_real_rows_of_smollm2_give_the_whole_heads_tokens(smollm2_path):
    """The model's own LM head (SmolLM2's tied embedding, 49,152 x 576) on hidden states of real
    prompts, as the engine hands them over: the same tokens, from a few panels a row."""
    llm = LLM(str(smollm2_path), dtype="bfloat16", max_num_seqs=16)
    runner = llm.engine.runner
    if runner.greedy_head is None:     # no AVX-512 VNNI: every logit, so hand it the plain C head
        assert not greedy_head.load().minicb_greedy_vnni()
        runner.greedy_head = greedy_head.GreedyHead.of(runner.model.lm_head, BUILDS[1])
    seen = []
    tokens = runner.greedy_head.tokens
    runner.greedy_head.tokens = lambda x: seen.append(x.clone()) or tokens(x)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3, 4,"] * 4
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    x = torch.cat(seen)
    head = llm.engine.runner.model.lm_head
    runner.greedy_head.recomputed = 0
    assert tokens(x) == torch.max(head(x).float(), dim=-1).indices.tolist()
    assert runner.greedy_head.recomputed < x.shape[0] * 768 / 10      # under a tenth of the panels


def test_a_row_that_is_not_finite_gets_no_tokens():
    w, x = tricky_case(rows=12)
    head, _ = head_of(w)
    x[2, 5] = float("nan")
    assert head.tokens(x) is None
    x[2, 5] = float("inf")
    assert head.tokens(x) is None


@pytest.fixture
def tiny_bf16(monkeypatch):
    """A tiny bfloat16 model on the fast paths, the layer stack and the skinny kernel for every step
    (``test_layer_stack``'s)."""
    from test_layer_stack import stacked

    monkeypatch.setenv("MINICB_SKINNY_ROWS", "4096")
    monkeypatch.setenv("MINICB_LINEAR", "onednn-f32")
    monkeypatch.delenv("MINICB_LAYER_STACK", raising=False)
    return stacked


def test_the_engine_gives_the_same_tokens_with_and_without_it(tiny_bf16):
    """A tiny bfloat16 model on the fast paths: the greedy steps go through the head (when this CPU
    has it), a step with a sampled, a logprobs or a processor's row does not, and every token is the
    one the whole LM head gives."""
    model = tiny_bf16(torch.bfloat16)
    llm = LLM(model, dtype=torch.bfloat16, max_num_seqs=6, block_size=4, num_blocks=128)
    runner = llm.engine.runner
    head = greedy_head.for_model(model)
    if head is None:                   # no AVX-512 VNNI: none of its own; the plain C estimate instead
        assert runner.greedy_head is None and not greedy_head.load().minicb_greedy_vnni()
        head = runner.greedy_head = greedy_head.GreedyHead.of(model.lm_head, BUILDS[1])
    prompts = [[5 + i, 9, 11 + 2 * i, 7] * (i + 1) for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    calls = []
    tokens = runner.greedy_head.tokens
    runner.greedy_head.tokens = lambda x: calls.append(x.shape[0]) or tokens(x)
    with_head = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls and max(calls) > 1
    runner.greedy_head = None
    without = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert with_head == without
    runner.greedy_head = head
    head.tokens = lambda x: calls.append(-1) and None       # a row it cannot bound: every logit instead
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == without
    assert -1 in calls
    del head.tokens                           # panels replaced after it was made: it stands aside
    x = torch.randn(3, model.lm_head.in_features).to(torch.bfloat16)
    assert head.tokens(x) is not None
    model.lm_head.weight_panels = model.lm_head.weight_panels.clone()
    assert head.tokens(x) is None
    model.lm_head.weight_panels = head.panels
    head.tokens = lambda x: pytest.fail("the greedy head was asked for a step it must not take")
    mixed = [greedy] * 4 + [SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
                            SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)]
    out = llm.generate(prompts, mixed, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out[:4]] == without[:4]


def test_it_is_off_where_asked_and_for_other_dtypes(tiny_bf16):
    model = tiny_bf16(torch.bfloat16)
    assert greedy_head.for_model(model, Settings(greedy_head=False)) is None
    assert greedy_head.for_model(tiny_bf16(torch.float32)) is None
    with pytest.raises(ValueError, match="bfloat16"):
        greedy_head.GreedyHead(torch.zeros(64, 96), skinny_gemm.pack(torch.zeros(64, 96)))


@pytest.mark.parametrize("flags", BUILDS, ids=["default", "plain-c"])
def test_an_output_pruned_by_its_estimate_alone_would_lose_a_bfloat16_tie(flags):
    """Output 2's logit is 192 and output 600's 192.375: 600 is larger, by less than the bounds of
    either estimate are apart, but both round to the bfloat16 192, where argmax takes the first (2).
    A cut at the best lower bound itself would drop 2 and answer 600; the cut two bfloat16 steps
    lower keeps it."""
    w = torch.zeros(1000, 64)
    w[2, 0] = 1.0
    w[600, 0], w[600, 1] = 1.0, 0.125
    x = torch.zeros(2, 64)
    x[:, 0], x[:, 1] = 192.0, 3.0
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    head, panels = head_of(w, flags)
    logits = skinny_gemm.matmul(x, panels, 64, 1000).float()
    assert logits[0, 2] == logits[0, 600] == 192 and argmax_of_the_product(x, panels, 1000) == [2] * 2
    assert head.tokens(x) == [2] * 2
