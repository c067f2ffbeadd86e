"""Parallel sampling in the engine (``SamplingParams.n``), on a tiny float64 LLaMA: a request with
``n=4`` and a seed is reproducible, each child equals the same request run alone with ``n=1`` and the
child's seed ``s + i`` (and the padded baseline's row with that seed), greedy children all equal the
greedy answer, under the continuous policy with forced preemption (recompute and swap). The prompt is
not a multiple of the block size, so every child but the last writes into a copy of the shared last
block: a runner that skipped the copy gets other tokens (checked). The scheduler level is
``tests/core/test_forks.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from drain import drain, finals
from helpers import TINY, assert_drained, baseline_tokens, random_prompts, run_engine, tiny_model
from minicb.core.block_pool import BlockPool
from minicb.core.config import SchedulerConfig
from minicb.core.errors import RequestRejected
from minicb.core.sampling_params import SamplingParams
from minicb.model.kv_cache import KVCache
from minicb.runtime.runner import engine_for

PROMPTS = random_prompts(3, 9, 14, TINY.vocab_size, seed=3)
PROMPT = PROMPTS[0] + [5, 6]                           # 11+ tokens: never a multiple of block_size 4
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=1234, ignore_eos=True, n=4)


def config(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=64, max_model_len=128)
    return SchedulerConfig(**{**base, **kw})


def alone(params: SamplingParams, cfg: SchedulerConfig | None = None, prompt=PROMPT) -> list[list[int]]:
    """Each child's tokens from its own n=1 request with the child's seed, one request per engine."""
    out = []
    for i in range(params.n):
        one = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        outs, _ = run_engine(tiny_model(), cfg or config(), [prompt], one)
        out.append(outs[0].token_ids)
    return out


def children(out) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


TIGHT = {                                   # 4 children + 2 more requests in 12 blocks: preemption
    "recompute": dict(num_blocks=12, max_num_batched_tokens=16),
    "swap": dict(num_blocks=12, max_num_batched_tokens=16, preemption_mode="swap", num_host_blocks=24),
    "no caching": dict(num_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", sorted(TIGHT))
def test_each_child_equals_its_seed_alone_under_preemption(name):
    cfg = config(**TIGHT[name])
    prompts = [PROMPT, PROMPTS[1], PROMPTS[2]]
    params = [SAMPLED, dataclasses.replace(SAMPLED, n=1, seed=7), dataclasses.replace(SAMPLED, n=2, seed=9)]
    outs, eng = run_engine(tiny_model(), cfg, prompts, params, arrivals=[0, 1, 2])
    assert eng.stats.num_preemptions > 0, "the pool must be tight enough to preempt"
    want = alone(SAMPLED)
    assert children(outs[0]) == want
    assert outs[0].token_ids == want[0] and outs[0].finished
    assert len(set(map(tuple, want))) == 4, "the children must differ (seeds s + i)"
    assert children(outs[2]) == alone(params[2], prompt=PROMPTS[2])
    again, _ = run_engine(tiny_model(), cfg, prompts, params, arrivals=[0, 1, 2])
    assert [children(o) for o in again] == [children(o) for o in outs]        # reproducible


def test_children_equal_the_padded_baseline_rows_with_the_childs_seed():
    outs, _ = run_engine(tiny_model(), config(), [PROMPT], SAMPLED)
    rows = [dataclasses.replace(SAMPLED, n=1, seed=SAMPLED.seed + i) for i in range(4)]
    assert children(outs[0]) == baseline_tokens(tiny_model(), [PROMPT] * 4, rows, None)


def test_greedy_children_all_equal_the_greedy_answer():
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, n=3)
    outs, _ = run_engine(tiny_model(), config(**TIGHT["recompute"]), [PROMPT], greedy)
    want = baseline_tokens(tiny_model(), [PROMPT], SamplingParams(max_tokens=8, ignore_eos=True), None)[0]
    assert children(outs[0]) == [want] * 3


def test_the_prompt_is_computed_once_and_its_blocks_held_once(monkeypatch):
    taken = []
    real = BlockPool.take
    monkeypatch.setattr(BlockPool, "take", lambda self: taken.append(real(self)) or taken[-1])
    eng = engine_for(tiny_model(), config())
    eng.add_request("r", PROMPT, SAMPLED)
    eng.step()                                          # the prompt: one row, sampled 4 times
    plan = eng.last_plan
    assert [s.request_id for s in plan.seqs] == ["0_r"] and plan.seqs[0].forks == ("1_r", "2_r", "3_r")
    blocks = -(-len(PROMPT) // 4)
    assert len(taken) == blocks
    tables = dict(eng.snapshot().block_tables)
    assert set(tables) == {"0_r", "1_r", "2_r", "3_r"} and len(set(tables.values())) == 1
    eng.step()
    assert len(eng.last_plan.copy_blocks) == 3          # the shared last block, copied for 3 of 4
    assert eng.stats.num_batched_tokens == len(PROMPT) + 4
    outs = finals(drain(eng))
    assert children(outs["r"]) == alone(SAMPLED)


def test_a_runner_that_skips_the_copy_gets_other_tokens(monkeypatch):
    monkeypatch.setattr(KVCache, "copy_blocks", lambda self, mapping: None)
    outs, _ = run_engine(tiny_model(), config(), [PROMPT], SAMPLED)
    assert children(outs[0]) != alone(SAMPLED)          # so the tests above do check the copy


def test_streamed_deltas_add_up_per_child_and_the_request_ends_with_its_last_child():
    eng = engine_for(tiny_model(), config(max_num_seqs=2))       # 2 slots: children 2, 3 wait
    params = dataclasses.replace(SAMPLED, max_tokens=6)
    eng.add_request("r", PROMPT, dataclasses.replace(params, ignore_eos=True))
    got, finals_seen = {i: [] for i in range(4)}, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == "r" and len(out.outputs) == 4
            for c in out.outputs:
                got[c.index] += c.new_token_ids
            finals_seen.append(out.finished)
    assert finals_seen[-1] and not any(finals_seen[:-1])
    assert [got[i] for i in range(4)] == alone(params)
    assert_drained(eng)


def test_abort_ends_every_child_and_n_is_bounded():
    eng = engine_for(tiny_model(), config(max_n=4))
    eng.add_request("r", PROMPT, SAMPLED)
    eng.step()
    eng.step()
    out = eng.abort_request("r")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert_drained(eng)
    with pytest.raises(RequestRejected, match="max_n=4"):
        eng.add_request("big", PROMPT, dataclasses.replace(SAMPLED, n=5))
    with pytest.raises(RequestRejected, match="max_n=4"):     # refused before n sequences are made
        eng.add_request("huge", PROMPT, dataclasses.replace(SAMPLED, n=2**62))
    assert not eng.has_unfinished_requests()


def test_llm_generate_returns_n_completions():
    from minicb.entrypoints.llm import LLM

    llm = LLM(tiny_model(), dtype="float64", block_size=4, num_blocks=64)
    outs = llm.generate([PROMPT, PROMPTS[1]], [SAMPLED, dataclasses.replace(SAMPLED, n=1)])
    assert [len(o.outputs) for o in outs] == [4, 1]
    assert children(outs[0]) == alone(SAMPLED)
    assert outs[1].outputs[0].token_ids == outs[1].token_ids


def _scores(entries) -> list:
    """Logprob entries as comparable rows: per position, (token id, rank, logprob) in order."""
    return [None if e is None else [(t, lp.rank, lp.logprob) for t, lp in e.items()] for e in entries]


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return all(x is None and y is None or (x is not None and y is not None and len(x) == len(y) and all(
        p[:2] == q[:2] and p[2] == pytest.approx(q[2], abs=1e-9) for p, q in zip(x, y)))
        for x, y in zip(a, b, strict=True))


def test_each_childs_logprobs_and_knobs_equal_its_seed_alone():
    """Logprobs and a per-row logits processor (presence penalty) with ``n > 1``: every child has its
    own processor state and logprobs, equal to the same request run alone with ``n=1`` and the child's
    seed; the prompt's logprobs are computed once (child 0) and equal the lone request's."""
    params = dataclasses.replace(SAMPLED, n=3, logprobs=2, prompt_logprobs=1, presence_penalty=1.5)
    outs, _ = run_engine(tiny_model(), config(), [PROMPT], params)
    out = outs[0]
    lone = []
    for i in range(params.n):
        one = dataclasses.replace(params, n=1, seed=params.seed + i)
        lone.append(run_engine(tiny_model(), config(), [PROMPT], one)[0][0])
    assert children(out) == [o.token_ids for o in lone]
    assert len({tuple(o.token_ids) for o in lone}) == 3, "the children must differ (seeds s + i)"
    for c, o in zip(out.outputs, lone, strict=True):
        assert len(c.logprobs) == len(c.token_ids) == 10
        assert [next(iter(e)) for e in c.logprobs] == c.token_ids      # the sampled token first
        assert _close(_scores(c.logprobs), _scores(o.logprobs))
    assert out.logprobs == out.outputs[0].logprobs
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    assert _close(_scores(out.prompt_logprobs), _scores(lone[0].prompt_logprobs))
