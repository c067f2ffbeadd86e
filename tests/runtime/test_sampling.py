"""The sampler against a plain reference: which tokens top-k and top-p keep, and what the draw sees.

The reference below is written from the definitions, in plain Python on lists (no torch, no sorting
trick shared with the code): top-k keeps every token at least as large as the k-th largest score
(so ties at the boundary are all kept), top-p keeps the smallest most-likely-first prefix whose
probability mass reaches ``p`` (the most likely token always). And unseeded requests must draw from
fresh entropy: two engines, or two processes, started alike do not produce the same tokens.
"""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb.core.sampling_params import SamplingParams
from minicb.runtime.sampling import Sampler, filter_logits, greedy_tokens, sample_token


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def reference_kept(logits: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """The token ids top-k then top-p keep, from the definitions."""
    x = [v / temperature for v in logits]
    kept = set(range(len(x)))
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        kept = {i for i in kept if x[i] >= kth}
    if top_p < 1.0:
        ids = sorted(kept, key=lambda i: -x[i])
        probs = dict(zip(ids, softmax([x[i] for i in ids])))
        chosen, mass = set(), 0.0
        for i in ids:
            chosen.add(i)
            mass += probs[i]
            if mass >= top_p:
                break
        kept = chosen
    return kept


def kept_by_code(logits: list[float], params: SamplingParams) -> set[int]:
    out = filter_logits(torch.tensor(logits, dtype=torch.float64), params)
    return {i for i, v in enumerate(out.tolist()) if v != float("-inf")}


def params(temperature=1.0, top_k=0, top_p=1.0, seed=None) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


# --- top-k -----------------------------------------------------------------------------------------------
LOGITS = [0.5, 3.0, -1.0, 2.0, 2.0, 0.0, 1.0]        # 3.0 first, then a tie of two 2.0s


@pytest.mark.parametrize("k, kept", [
    (1, {1}),                                        # k=1 is the argmax alone
    (2, {1, 3, 4}),                                  # the 2nd largest is tied: both ties stay
    (3, {1, 3, 4}),
    (4, {1, 3, 4, 6}),
    (6, {0, 1, 3, 4, 5, 6}),
    (7, set(range(7))),                              # k == vocab: everything
    (8, set(range(7))),                              # k > vocab: everything, no error
    (100, set(range(7))),
    (0, set(range(7))),                              # 0 switches top-k off
])
def test_top_k_keeps_the_k_largest_and_every_tie_at_the_boundary(k, kept):
    assert kept_by_code(LOGITS, params(top_k=k)) == kept == reference_kept(LOGITS, 1.0, k, 1.0)


def test_top_k_1_always_draws_the_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor(LOGITS)
    assert {sample_token(logits, params(top_k=1), gen) for _ in range(50)} == {1}


# --- top-p -----------------------------------------------------------------------------------------------
def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    # probabilities 0.5, 0.25, 0.125, 0.125 (logits are their logs)
    logits = [math.log(p) for p in (0.125, 0.5, 0.125, 0.25)]
    assert kept_by_code(logits, params(top_p=0.5)) == {1}             # 0.5 reaches 0.5 exactly
    assert kept_by_code(logits, params(top_p=0.4)) == {1}             # the first token always stays
    assert kept_by_code(logits, params(top_p=0.6)) == {1, 3}          # 0.5 < 0.6 <= 0.75
    assert kept_by_code(logits, params(top_p=0.75)) == {1, 3}
    # 0.5 + 0.25 + 0.125 = 0.875 reaches 0.8 with one of the two tied 0.125 tokens (which one is the
    # sort's choice): three tokens, never four
    kept = kept_by_code(logits, params(top_p=0.8))
    assert len(kept) == 3 and {1, 3} <= kept
    assert kept_by_code(logits, params(top_p=0.9)) == {0, 1, 2, 3}


def test_top_p_with_three_distinct_tokens_keeps_exactly_the_prefix():
    logits = [math.log(p) for p in (0.2, 0.7, 0.1)]
    assert kept_by_code(logits, params(top_p=0.69)) == {1}
    assert kept_by_code(logits, params(top_p=0.71)) == {0, 1}
    assert kept_by_code(logits, params(top_p=0.85)) == {0, 1}
    assert kept_by_code(logits, params(top_p=0.95)) == {0, 1, 2}


def test_top_p_1_keeps_everything_even_a_vanishing_tail():
    logits = [0.0, -30.0, -60.0, 5.0]
    assert kept_by_code(logits, params(top_p=1.0)) == {0, 1, 2, 3}


def test_top_p_is_applied_after_top_k_and_temperature():
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    # top_k=2 renormalises {0: 4/7, 1: 3/7}: p = 0.5 is reached by token 0 alone
    assert kept_by_code(logits, params(top_k=2, top_p=0.5)) == {0}
    assert kept_by_code(logits, params(top_k=2, top_p=0.6)) == {0, 1}
    # without top-k, 0.4 < 0.5: two tokens
    assert kept_by_code(logits, params(top_p=0.5)) == {0, 1}
    # a high temperature flattens the distribution: more tokens needed to reach the same mass
    assert len(kept_by_code(logits, params(temperature=100.0, top_p=0.6))) == 3


distinct_logits = st.lists(st.integers(-40, 40), min_size=1, max_size=12, unique=True).map(
    lambda xs: [x / 4 for x in xs])


@settings(max_examples=200, deadline=None)
@given(logits=distinct_logits, temperature=st.sampled_from([0.5, 1.0, 2.0]),
       top_k=st.integers(0, 14), top_p=st.sampled_from([0.05, 0.3, 0.5, 0.77, 0.9, 0.999, 1.0]))
def test_filter_agrees_with_the_reference(logits, temperature, top_k, top_p):
    # a cumulative mass within rounding of p could go either way: such examples decide nothing
    x = [v / temperature for v in logits]
    ids = sorted(reference_kept(logits, temperature, top_k, 1.0), key=lambda i: -x[i])
    cums = [sum(softmax([x[j] for j in ids])[:n + 1]) for n in range(len(ids))]
    if any(abs(c - top_p) < 1e-9 for c in cums):
        return
    p = params(temperature=temperature, top_k=top_k, top_p=top_p)
    kept = reference_kept(logits, temperature, top_k, top_p)
    assert kept_by_code(logits, p) == kept
    # what is kept keeps its relative probabilities: the draw sees the renormalised distribution
    out = torch.softmax(filter_logits(torch.tensor(logits, dtype=torch.float64), p), dim=-1).tolist()
    ref = dict(zip(sorted(kept), softmax([x[i] for i in sorted(kept)])))
    for i, q in enumerate(out):
        assert q == pytest.approx(ref.get(i, 0.0), abs=1e-12)


def test_draws_follow_the_filtered_distribution():
    """Counts over many draws match the kept tokens' renormalised probabilities."""
    logits = torch.tensor([math.log(p) for p in (0.1, 0.6, 0.3)])
    gen = torch.Generator().manual_seed(1)
    n = 3000
    draws = [sample_token(logits, params(top_p=0.8), gen) for _ in range(n)]
    assert set(draws) == {1, 2}
    assert draws.count(1) / n == pytest.approx(2 / 3, abs=0.04)


# --- seeds -------------------------------------------------------------------------------------------------
LOGITS_FLAT = torch.zeros(1, 1000)                 # uniform over 1000 tokens: a collision is rare


def draws(sampler: Sampler, request_id: str, p: SamplingParams, n: int = 8) -> list[int]:
    sampler.register(request_id, p)
    return [sampler.sample(LOGITS_FLAT, (request_id,), [p])[0] for _ in range(n)]


def test_a_seeded_request_draws_the_same_tokens_in_every_sampler():
    p = params(seed=1234)
    assert draws(Sampler(), "a", p) == draws(Sampler(), "b", p) == draws(Sampler(seed=9), "a", p)


def test_unseeded_requests_differ_across_samplers_and_within_one():
    s1, s2 = Sampler(), Sampler()
    a, b = draws(s1, "r", params()), draws(s2, "r", params())
    assert a != b                                  # two engines, same request id, no seed
    assert draws(s1, "r2", params()) != a          # two requests of one engine
    s3, s4 = Sampler(seed=5), Sampler(seed=5)      # an engine seed makes unseeded requests repeatable
    assert draws(s3, "x", params()) == draws(s4, "x", params())


def test_a_release_forgets_the_generator():
    s = Sampler(seed=5)
    first = draws(s, "r", params(seed=3))
    s.release("r")
    s.release("r")                                 # twice is harmless
    assert draws(s, "r", params(seed=3)) == first  # registered again: a fresh generator from its seed


UNSEEDED_IN_A_FRESH_PROCESS = """
import torch
from minicb.core.sampling_params import SamplingParams
from minicb.runtime.sampling import Sampler
s = Sampler()
p = SamplingParams(temperature=1.0)
s.register("r", p)
print([s.sample(torch.zeros(1, 1000), ("r",), [p])[0] for _ in range(8)])
"""


@pytest.mark.slow
def test_unseeded_requests_differ_across_processes():
    """Each process draws its engine's seed from the OS: a fresh process must not agree with this one
    (torch's default generator seed is a constant, so a sampler that forgot to reseed would draw the
    same tokens in every process)."""
    here = draws(Sampler(), "r", params())
    there = subprocess.run([sys.executable, "-c", UNSEEDED_IN_A_FRESH_PROCESS], capture_output=True,
                           text=True, check=True, timeout=300).stdout
    assert str(here) != there.strip()


def test_greedy_rows_take_the_argmax_and_register_nothing():
    s = Sampler()
    g = params(temperature=0.0)
    s.register("g", g)
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 1.0]])
    assert s.sample(logits, ("g", "h"), [g, g]) == [1, 0]
    t = params(top_k=1, seed=0)
    s.register("t", t)
    assert s.sample(logits, ("g", "t"), [g, t]) == [1, 0]      # a mixed batch: row by row


def test_a_released_request_no_longer_draws_from_its_generator():
    """After ``release`` the row has no generator of its own: it draws from torch's global one."""
    p = params(seed=77)
    s = Sampler(seed=1)
    s.register("r", p)
    s.release("r")
    torch.manual_seed(123)
    after = [s.sample(LOGITS_FLAT, ("r",), [p])[0] for _ in range(8)]
    torch.manual_seed(123)
    assert after == [sample_token(LOGITS_FLAT[0], p, None) for _ in range(8)]


def test_greedy_on_bfloat16_logits_is_the_first_maximum_of_each_row():
    """A bfloat16 model's logits are sampled as they are (``max``'s indices, not a widened copy): the
    token is the first maximum of the row, ties and NaN (the first NaN) included, as ``argmax`` on the
    values widened to float64 says."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g).to(torch.bfloat16)
    logits[1, 10] = logits[1, 700] = 30.0                  # a tie: the first one wins
    logits[2, :] = 0.0                                      # all equal: token 0
    logits[3, 5] = float("nan")
    logits[3, 9] = float("nan")                              # NaN counts as the largest, the first one
    logits[4, 999] = float("inf")
    logits[5, 0] = 100.0                                    # the last row: its first token
    params = [SamplingParams(max_tokens=4)] * 6
    want = torch.argmax(logits.double(), dim=-1).tolist()
    assert greedy_tokens(logits) == want
    # the sampler itself refuses to pick a token from the rows holding NaN or inf (a broken forward):
    # those requests fail, the others get the argmax
    got = Sampler(seed=0).sample(logits, tuple(f"r{i}" for i in range(6)), params)
    assert [t.error is not None and "not finite" in t.error for t in got[3:5]] == [True, True]
    assert got[:3] + got[5:] == want[:3] + want[5:]
    assert want[1:5] == [10, 0, 5, 999] and want[5] == 0
