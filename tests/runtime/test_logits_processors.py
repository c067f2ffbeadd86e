"""The sampling knobs against a plain reference, row by row, alone and in mixed batches.

The reference below is written from vLLM's documented rules with numpy and Python loops over the
vocabulary; it shares nothing with ``minicb.runtime.logits_processors`` / ``sampling`` but the
random generator a sampled row draws with (``torch.multinomial`` over the reference's probabilities,
with a generator seeded from the request's seed, consumes the same single draw per token).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from knob_reference import IdsTokenizer, ref_generate, ref_probs, ref_scores
from minicb.core.sampling_params import SamplingParams
from minicb.runtime.logits_processors import (
    BadWords,
    LogitBias,
    MinTokens,
    Penalties,
    RowProcessor,
    bad_words_token_ids,
    build_processors,
)
from minicb.runtime.sampling import Sampler
from tokenizer_fixtures import tiny_tokenizer

EOS = 0


# --- workloads ----------------------------------------------------------------------------------
V = 24


@st.composite
def knob_params(draw, steps: int):
    greedy = draw(st.booleans())
    kw = {}
    if draw(st.booleans()):
        kw["presence_penalty"] = draw(st.floats(-2, 2))
    if draw(st.booleans()):
        kw["frequency_penalty"] = draw(st.floats(-2, 2))
    if draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.floats(0.3, 3.0))
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, V - 1), max_size=4, unique=True))
        kw["logit_bias"] = {t: draw(st.floats(-100, 100)) for t in ids}
    if draw(st.booleans()):
        kw["min_tokens"] = draw(st.integers(0, steps))
        kw["stop_token_ids"] = tuple(draw(st.lists(st.integers(0, V - 1), max_size=2)))
        kw["ignore_eos"] = draw(st.booleans())
    if draw(st.booleans()):
        words = draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=3), max_size=3))
        kw["bad_words"] = [" ".join(map(str, w)) for w in words]
    if not greedy:
        kw.update(temperature=draw(st.floats(0.2, 2.0)), seed=draw(st.integers(0, 2**32)))
        if draw(st.booleans()):
            kw["min_p"] = draw(st.floats(0.0, 0.5))
        if draw(st.booleans()):
            kw["top_k"] = draw(st.integers(0, V))
        if draw(st.booleans()):
            kw["top_p"] = draw(st.floats(0.3, 1.0))
    return SamplingParams(max_tokens=steps + 1, **kw)


def bad_ids_of(p: SamplingParams):
    return [[int(t) for t in w.split()] for w in p.bad_words if w.split()]


def run_batch(sampler: Sampler, rows: list, rids: list[str], plist: list[SamplingParams]) -> dict:
    """Step a batch: at step t row i of the logits is ``rows[i][t]``; requests leave when done."""
    out = {r: [] for r in rids}
    for t in range(max(len(r) for r in rows)):
        live = [i for i in range(len(rids)) if t < len(rows[i])]
        logits = torch.tensor(np.stack([rows[i][t] for i in live]))
        toks = sampler.sample(logits, tuple(rids[i] for i in live), [plist[i] for i in live])
        for i, tok in zip(live, toks):
            out[rids[i]].append(tok)
    return out


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_every_knob_matches_the_reference_alone_and_in_a_mixed_batch(data):
    n = data.draw(st.integers(1, 5))
    steps = data.draw(st.integers(1, 8))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    plist = [data.draw(knob_params(steps)) for _ in range(n)]
    prompts = [rng.integers(0, V, rng.integers(1, 6)).tolist() for _ in range(n)]
    rows = [list(rng.normal(0, 3, (rng.integers(1, steps + 1), V))) for _ in range(n)]
    rids = [f"r{i}" for i in range(n)]
    want = [ref_generate(rows[i], plist[i], prompts[i], EOS, bad_ids_of(plist[i])) for i in range(n)]

    together = Sampler(seed=1)
    for rid, p, prompt in zip(rids, plist, prompts):
        together.register(rid, p, prompt, vocab_size=V, eos_token_id=EOS, tokenizer=IdsTokenizer())
    got = run_batch(together, rows, rids, plist)
    for i, rid in enumerate(rids):
        alone = Sampler(seed=2)
        alone.register("x", plist[i], prompts[i], vocab_size=V, eos_token_id=EOS, tokenizer=IdsTokenizer())
        assert run_batch(alone, [rows[i]], ["x"], [plist[i]])["x"] == want[i]
        assert got[rid] == want[i], (plist[i], prompts[i])


# --- each knob by hand ---------------------------------------------------------------------------
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    proc = Penalties(2.0, 0.0, 0.0, prompt_token_ids=[0, 1])
    proc.accept(2)
    x = torch.tensor([4.0, -4.0, 1.0, 3.0])
    assert proc.process(x).tolist() == [2.0, -8.0, 0.5, 3.0]
    assert x.tolist() == [4.0, -4.0, 1.0, 3.0]                  # never in place


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    proc = Penalties(1.0, 0.5, 1.0, prompt_token_ids=[3])
    for t in (1, 1, 2):
        proc.accept(t)
    assert proc.process(torch.zeros(4)).tolist() == [0.0, -2.0, -1.5, 0.0]


def test_logit_bias_adds_and_min_tokens_bans_stop_ids_until_enough_tokens():
    assert LogitBias([(1, -100.0), (3, 2.5)]).process(torch.zeros(4)).tolist() == [0, -100, 0, 2.5]
    m = MinTokens(2, [0, 3])
    masked = [float("-inf"), 0.0, 0.0, float("-inf")]
    assert m.process(torch.zeros(4)).tolist() == masked
    m.accept(1)
    assert m.process(torch.zeros(4)).tolist() == masked
    m.accept(1)
    assert m.process(torch.zeros(4)).tolist() == [0.0] * 4


def test_bad_words_ban_the_last_token_after_the_prefix():
    b = BadWords([[5], [1, 2], [1, 2, 3]])
    inf = float("-inf")
    assert b.process(torch.zeros(6)).tolist() == [0, 0, 0, 0, 0, inf]
    b.accept(1)
    assert b.process(torch.zeros(6)).tolist() == [0, 0, inf, 0, 0, inf]
    b.accept(2)
    assert b.process(torch.zeros(6)).tolist() == [0, 0, 0, inf, 0, inf]
    b.accept(4)
    assert b.process(torch.zeros(6)).tolist() == [0, 0, 0, 0, 0, inf]


def test_bad_words_are_tokenized_at_the_start_and_after_a_space():
    """vLLM's rule: the word stripped of leading spaces, plus its spelling after a space when that is a
    different token sequence of the same length. The tiny BPE has merged tokens for "Ġa", "Ġthe" and
    "in" (so " a" is one other token, " the" one token instead of two, " in" two instead of one)."""
    tok = tiny_tokenizer()
    assert (tok.encode("a"), tok.encode(" a")) == ([100], [265])
    assert (tok.encode("the"), tok.encode(" the")) == ([119, 260], [261])
    assert (tok.encode("in"), tok.encode(" in")) == ([262], [35, 262])
    assert bad_words_token_ids(["the", "  in", "a", ""], tok) == [[119, 260], [262], [100], [265]]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    p = SamplingParams(temperature=1.0, min_p=0.3, seed=0)
    s = Sampler()
    s.register("r", p)
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.14, 0.16]]))      # 0.3 * 0.5 = 0.15: token 2 is out
    draws = {s.sample(logits, ("r",), [p])[0] for _ in range(400)}
    assert draws == {0, 1, 3}


def test_build_processors_is_empty_for_plain_params_and_ordered_like_vllm():
    assert build_processors(SamplingParams(), [1, 2], vocab_size=10, eos_token_id=0) == []
    p = SamplingParams(max_tokens=4, bad_words=("3",), min_tokens=2, logit_bias={1: 1.0},
                       repetition_penalty=1.2)
    procs = build_processors(p, [1], vocab_size=10, eos_token_id=0, tokenizer=IdsTokenizer())
    kinds = [type(x) for x in procs]
    assert kinds == [BadWords, MinTokens, LogitBias, Penalties]
    assert all(isinstance(x, RowProcessor) for x in build_processors(p, [1], vocab_size=10, eos_token_id=0))
    # min_tokens with nothing to ban (ignore_eos, no stop ids) needs no processor
    q = SamplingParams(max_tokens=4, min_tokens=2, ignore_eos=True)
    assert build_processors(q, [], vocab_size=10, eos_token_id=0) == []


def test_greedy_rows_without_processors_keep_the_matrix_argmax_and_others_go_row_by_row():
    s = Sampler()
    plain, biased = SamplingParams(), SamplingParams(logit_bias={2: 10.0})
    s.register("a", plain)
    s.register("b", biased, vocab_size=3)
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 1.0]])
    assert s.sample(logits, ("a", "b"), [plain, biased]) == [1, 2]
    s.release("b")
    assert s.sample(logits, ("a", "b"), [plain, biased]) == [1, 0]     # released: a plain row again


def test_a_row_that_fails_advances_no_processor():
    s = Sampler()
    p = SamplingParams(frequency_penalty=1.0)
    s.register("a", p, vocab_size=3)
    s.register("b", p, vocab_size=3)
    bad = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    with pytest.raises(IndexError):
        s.sample(bad, ("a", "b", "c"), [p, p, p])                       # row 2 does not exist
    assert all(proc.counts == {} for r in ("a", "b") for proc in s._processors[r])


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_processed_rows_and_filtered_distributions_equal_the_reference(data):
    """Not only the drawn token: the row every processor leaves, and the distribution drawn from."""
    from minicb.runtime.sampling import filter_logits

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    steps = data.draw(st.integers(0, 6))
    p = data.draw(knob_params(steps))
    prompt = rng.integers(0, V, rng.integers(1, 6)).tolist()
    history = rng.integers(0, V, steps).tolist()
    procs = build_processors(p, prompt, vocab_size=V, eos_token_id=EOS, tokenizer=IdsTokenizer())
    for t in history:
        for proc in procs:
            proc.accept(t)
    logits = rng.normal(0, 3, V)
    row = torch.tensor(logits)
    for proc in procs:
        row = proc.process(row)
    want = ref_scores(logits, p, prompt, history, EOS, bad_ids_of(p))
    np.testing.assert_allclose(row.numpy(), want, rtol=1e-12, atol=1e-12)
    if not p.greedy and np.isfinite(want).any():
        got = torch.softmax(filter_logits(row, p), dim=-1).numpy()
        np.testing.assert_allclose(got, ref_probs(want, p), rtol=1e-9, atol=1e-12)


def test_ids_beyond_the_vocabulary_are_left_out_and_min_p_one_keeps_every_top_token():
    """The engine refuses such ids first; the sampler still never indexes past a row."""
    s = Sampler()
    p = SamplingParams(logit_bias={3: 50.0, 2: 1.0}, repetition_penalty=2.0, min_tokens=2,
                       stop_token_ids=(3,), max_tokens=4)
    s.register("r", p, [1, 3, 4], vocab_size=3, eos_token_id=3)
    assert s.sample(torch.tensor([[0.0, 0.5, 0.0]]), ("r",), [p]) == [2]      # 0.5 / 2 < 0 + 1
    assert [type(x) for x in build_processors(p, [], vocab_size=3, eos_token_id=None)] == [LogitBias,
                                                                                          Penalties]
    q = SamplingParams(temperature=1.0, min_p=1.0, seed=0)                     # ties at the top stay
    s.register("q", q)
    assert {s.sample(torch.tensor([[1.0, 1.0, 0.0]]), ("q",), [q])[0] for _ in range(100)} == {0, 1}


def test_bad_words_keep_only_the_tail_they_can_match():
    b = BadWords([[1, 2, 3]])
    for t in range(50):
        b.accept(t)
    assert b.recent == [48, 49]
