"""Logprobs of generated and prompt tokens, through the engine, against one plain forward.

The reference is the simplest computation there is: the whole sequence (prompt + generated tokens) in
one forward with no KV cache (``pack_prompts``: logits for every row), ``log_softmax`` in float64, row
``p`` scoring token ``p + 1``. The engine gets the same numbers out of chunked prefills, prefix-cache
sharing (which a prompt-logprobs request must refuse), recompute preemption (which must neither lose
nor duplicate a prompt row) and a batch of other requests; and a step nobody asked logprobs of asks
the LM head for the sampled rows only, as before.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import TINY, random_prompts, run_engine, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.model.attention import ReferenceAttention
from minicb.runtime.packer import pack_prompts
from minicb.runtime.runner import engine_for

MODEL = tiny_model()
V = TINY.vocab_size


def reference_logprobs(tokens: list[int]) -> torch.Tensor:
    """float64 log-softmax of every row of one cache-free forward over ``tokens``: ``[len, V]``."""
    b = pack_prompts([tokens])
    logits = MODEL(b.input_ids, b.positions, ReferenceAttention(None), b.attn, b.logits_indices)
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def check_entry(entry: dict, token: int, ref_row: torch.Tensor, k: int) -> None:
    """vLLM's ``{token_id: Logprob}``: ``token`` first with its logprob and rank, then the top-k."""
    ids = list(entry)
    assert ids[0] == token
    assert entry[token].logprob == pytest.approx(float(ref_row[token]), abs=1e-9)
    assert entry[token].rank == int((ref_row > ref_row[token]).sum()) + 1
    top = torch.topk(ref_row, k)
    want = [t for t in top.indices.tolist() if t != token]
    got = [t for t in ids[1:]]
    assert got == want[:len(got)] and len(got) in (k, k - 1)      # the token itself is not repeated
    for t in got:
        assert entry[t].logprob == pytest.approx(float(ref_row[t]), abs=1e-9)


def check_prompt(out, k: int) -> None:
    prompt = out.prompt_token_ids
    ref = reference_logprobs(prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        check_entry(out.prompt_logprobs[j], prompt[j], ref[j - 1], k)


CONFIGS = {
    "one step": SchedulerConfig(max_num_seqs=4, block_size=4, num_blocks=256),
    "chunked prefill": SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5, block_size=4,
                                       num_blocks=256),
    "recompute preemption": SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7, block_size=2,
                                            num_blocks=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_and_sampled_logprobs_equal_one_plain_forward(name):
    config = CONFIGS[name]
    prompts = random_prompts(4, 3, 11, V, seed=5)
    plist = [SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2),
             SamplingParams(max_tokens=5, ignore_eos=True),                       # a neighbour asking nothing
             SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0),
             SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, seed=3, logprobs=1)]
    outs, eng = run_engine(MODEL, config, prompts, plist)
    if name == "recompute preemption":
        assert eng.stats.num_recomputes > 0          # the case this config exists for did happen
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    assert outs[3].prompt_logprobs is None
    check_prompt(outs[0], 2)
    check_prompt(outs[2], 0)
    for i in (0, 3):
        out, k = outs[i], plist[i].logprobs
        ref = reference_logprobs(out.prompt_token_ids + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for n, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            # the token drawn at temperature 0.7 is scored by the model's own distribution (no temperature)
            check_entry(entry, tok, ref[len(out.prompt_token_ids) + n - 1], k)
    assert all(next(iter(e.values())).rank == 1 for e in outs[0].logprobs)      # greedy: the top token


def test_a_prompt_logprobs_request_takes_no_cached_prefix_but_others_still_do():
    config = SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=64)
    prompt = random_prompts(1, 13, 13, V, seed=9)[0]
    eng = engine_for(MODEL, config)
    eng.add_request("warm", prompt, SamplingParams(max_tokens=1))
    eng.run_until_done()
    eng.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    eng.add_request("plain", prompt, SamplingParams(max_tokens=1))
    outs = {o.request_id: o for o in eng.run_until_done()}
    assert outs["plain"].num_cached_tokens == 12          # 3 full blocks found in the cache
    assert outs["scored"].num_cached_tokens == 0          # computed in full: every row's logits exist
    check_prompt(outs["scored"], 1)


def lm_head_rows(config: SchedulerConfig, prompts, plist):
    """Per step: rows the LM head computed, and rows that sampled (a hook on the LM head); and the
    final outputs by request id."""
    seen: list[int] = []
    hook = MODEL.lm_head.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
    sampled: list[int] = []
    outs = {}
    try:
        eng = engine_for(MODEL, config)
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            eng.add_request(f"r{i}", p, sp)
        while eng.has_unfinished_requests():
            outs |= {o.request_id: o for o in eng.step() if o.finished}
            sampled.append(sum(s.sample for s in eng.last_plan.seqs))
    finally:
        hook.remove()
    return seen, sampled, outs


@pytest.mark.parametrize("name", ["chunked prefill", "tight pool"])
def test_the_default_step_asks_the_lm_head_for_the_sampled_rows_only(name):
    config = CONFIGS["chunked prefill"] if name == "chunked prefill" else \
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=2, num_blocks=12)
    prompts = random_prompts(4, 6, 11, V, seed=0)
    plain = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)] * 4    # sampled logprobs: free
    seen, sampled, _ = lm_head_rows(config, prompts, plain)
    assert [n for n in seen if n] == [n for n in sampled if n]     # (an unsampled step: 0 rows)
    scored = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=0)] * 4
    seen2, sampled2, outs = lm_head_rows(config, prompts, scored)
    assert sum(seen2) == sum(sampled2) + sum(len(p) - 1 for p in prompts)    # each prompt row once
    if name == "tight pool":
        assert sum(o.num_preemptions for o in outs.values()) >= 2        # ... although recomputed
    for out in outs.values():
        check_prompt(out, 0)


def test_logprobs_counts_are_checked():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidArgument, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(InvalidArgument, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(logprobs=20, prompt_logprobs=0) == SamplingParams(logprobs=20, prompt_logprobs=0)


def test_a_one_token_prompt_has_only_the_none_entry():
    outs, _ = run_engine(MODEL, CONFIGS["one step"], [[7]], SamplingParams(max_tokens=2, prompt_logprobs=3))
    assert outs[0].prompt_logprobs == [None]


def test_logprobs_of_a_nan_row_are_finite_or_minus_infinity():
    from minicb.runtime.logprobs import row_logprobs

    row = torch.tensor([[0.0, float("nan"), 1.0]])
    (lp,) = row_logprobs(row, [1], 2)
    assert lp.logprob == -math.inf and lp.top_ids == (2, 0)
    assert lp.top_logprobs[0] == pytest.approx(-math.log1p(math.exp(-1.0)))


def test_the_simulator_answers_logprobs_of_a_model_certain_of_every_token():
    from minicb.engine.logprobs import Logprob
    from minicb.simulate.simulator import SimulatedEngine

    eng = SimulatedEngine(SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=16,
                                          max_num_batched_tokens=2), lambda plan: 0.01, token=5)
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=0))
    (out,) = eng.run_until_done()
    assert out.logprobs == [{5: Logprob(0.0, 1)}] * 2
    assert out.prompt_logprobs == [None, {2: Logprob(0.0, 1)}, {3: Logprob(0.0, 1)}]


def test_a_long_prompt_is_scored_chunk_by_chunk_beside_a_running_decode():
    """Issue 46: prompt logprobs of a prompt many chunks long are computed with its prefill, chunk by
    chunk, while a decode keeps getting a token at every step (counted in steps, no clock); each
    chunk's rows come out of that chunk's own forward (the LM head sees the chunk's rows once), and the
    result equals one plain forward over the whole prompt."""
    budget = 16
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, block_size=4, num_blocks=128)
    prompt = random_prompts(1, 150, 150, V, seed=11)[0]
    seen: list[int] = []
    hook = MODEL.lm_head.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
    try:
        eng = engine_for(MODEL, config)
        eng.add_request("decode", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        eng.step()                                              # the decode runs before the prompt arrives
        eng.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=3))
        steps, decode_tokens, final = 0, 0, None
        while final is None:
            seen.clear()
            outs = eng.step()
            steps += 1
            plan = {s.request_id: s for s in eng.last_plan.seqs}
            assert plan["decode"].sample                        # the decode is never held back
            decode_tokens += sum(len(o.new_token_ids) for o in outs if o.request_id == "decode")
            scored = plan.get("scored")
            if scored is not None and scored.prompt_targets:    # this chunk's rows, in this chunk's forward
                assert seen == [1 + len(scored.prompt_targets) + scored.sample]
            final = next((o for o in outs if o.request_id == "scored" and o.finished), None)
    finally:
        hook.remove()
    chunks = -(-len(prompt) // (budget - 1))                    # the decode takes 1 token of each step
    assert steps == chunks and decode_tokens == steps           # several chunks, a decode token each
    check_prompt(final, 3)


def test_a_request_asking_for_too_many_logprob_entries_is_refused_before_any_work():
    """``max_logprob_entries`` counts rows x (top-k + 1): (prompt - 1) x (prompt_logprobs + 1) plus
    n x max_tokens x (logprobs + 1). At the limit a request is accepted, one entry past it refused
    with ``InvalidArgument`` before it is queued (a 400 through the server)."""
    prompt = list(range(4, 24))                                 # 20 tokens: 19 scored rows
    want = 19 * (5 + 1) + 2 * 3 * (4 + 1)                      # 114 + 30
    fits = SamplingParams(max_tokens=3, n=2, logprobs=4, prompt_logprobs=5)
    eng = engine_for(MODEL, SchedulerConfig(max_num_seqs=4, block_size=4, num_blocks=64,
                                            max_logprob_entries=want))
    eng.add_request("fits", prompt, fits)
    with pytest.raises(InvalidArgument, match=f"asks for {want + 6:,} logprob entries.*limit is {want:,}"):
        eng.add_request("over", prompt + [24], fits)            # one more prompt row: 6 more entries
    assert [o.request_id for o in eng.run_until_done()] == ["fits"]
    with pytest.raises(InvalidArgument, match="max_logprob_entries"):
        SchedulerConfig(max_logprob_entries=-1)
