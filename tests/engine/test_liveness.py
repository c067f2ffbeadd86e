"""Liveness: under tight memory and continuous arrivals every request finishes, within a bound.

Why it holds (continuous policy, ``fcfs``). Call *O* the running sequence admitted earliest. The
preemption victim is always the most recently admitted running sequence, so O is never preempted while
anyone else runs; alone it always fits, because a request larger than the whole pool is rejected at
``add``. When ``max_num_batched_tokens >= max_num_seqs`` the decodes scheduled before it (at most
``max_num_seqs - 1`` tokens) leave O at least one token of budget (and the stall-free cap,
``max_prefill_tokens_while_decoding >= 1``, at least one prompt token, which O, the first prefill in
admission order, takes), so O computes at least one token every step and never loses one. A newer
admission cannot take O's role, so O keeps it until it finishes, at most ``prompt + max_tokens`` steps
later. And when nothing runs but something is
unfinished, that step admits (or swaps in) the front request into the empty pool, which becomes O.
So every step is either idle (nothing has arrived yet) or some O makes progress, and::

    every request has finished by step  max(arrival) + sum over requests of (prompt + max_tokens)

which bounds the steps any request waits (end step minus arrival step). The hypothesis test checks it
on the scheduler with the token-exact fake model of ``scheduler_fixtures``; the engine tests check the same
with the tiny LLaMA; the livelock tests show two requests that each need the whole pool take turns
instead of preempting each other forever. (With ``scheduling_policy="priority"`` a stream of more
important requests may starve a less important one; that is the policy, and only eventual completion
of a finite workload is checked.)
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY, assert_drained, baseline_tokens, tiny_model
from hypothesis_profiles import examples
from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.runtime.runner import engine_for
from robust_helpers import drive, random_workload
from scheduler_fixtures import VOCAB, Req, assert_token_exact
from scheduler_fixtures import drive as drive_scheduler


def wait_bound(prompt_lens, max_tokens, arrivals) -> int:
    """The step by which every request has finished (module docstring)."""
    return max(arrivals) + sum(p + m for p, m in zip(prompt_lens, max_tokens))


@st.composite
def tight_workloads(draw):
    n = draw(st.integers(2, 14))
    reqs = [Req(f"r{i}", draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24)),
                draw(st.integers(1, 16)), arrival=draw(st.integers(0, 30)), ignore_eos=draw(st.booleans()))
            for i in range(n)]
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 5))
    need = max(-(-(len(r.prompt) + r.max_tokens) // block_size) for r in reqs)
    budget = draw(st.integers(max_num_seqs, 40))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size,
        long_prefill_chunk=draw(st.one_of(st.none(), st.integers(1, budget))),
        max_prefill_tokens_while_decoding=draw(st.one_of(st.none(), st.integers(1, budget))),
        num_blocks=max(need, max_num_seqs) + draw(st.integers(0, 2)),         # just the largest request
        num_host_blocks=draw(st.sampled_from([0, need, 4 * need])) if mode == "swap" else 0,
        preemption_mode=mode, max_model_len=4096)
    return reqs, config


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_workloads())
def test_no_request_waits_longer_than_the_bound(w):
    reqs, config = w
    bound = wait_bound([len(r.prompt) for r in reqs], [r.max_tokens for r in reqs], [r.arrival for r in reqs])
    run = drive_scheduler(config, reqs, max_steps=bound + 1)      # every step is checked; all drain
    assert_token_exact(run, reqs)
    for r in reqs:
        end = run.seqs[r.rid].finish_time                         # the driver's clock is the step number
        # load-independent: the driver's clock is the step number
        assert end - r.arrival <= bound - r.arrival, (r.rid, end, r.arrival, bound)
        assert run.seqs[r.rid].first_scheduled_time is not None  # load-independent: step-number clock


def test_the_bound_is_reached_by_the_oldest_admitted_progressing_every_step():
    """Under heavy pressure the oldest running request computes a token in every step it runs."""
    reqs = [Req(f"r{i}", [(3 * i + j) % (VOCAB - 1) + 1 for j in range(12)], 10, arrival=i, ignore_eos=True)
            for i in range(8)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, block_size=2, num_blocks=12,
                             num_host_blocks=6, preemption_mode="swap")
    run = drive_scheduler(config, reqs)
    assert_token_exact(run, reqs)
    assert run.scheduler.stats.num_preemptions > 0
    for plan in run.plans:
        if not plan.seqs:
            continue
        oldest = min((run.seqs[s.request_id] for s in plan.seqs), key=lambda q: q.admitted_index)
        assert oldest.request_id not in plan.preempted


# --- the engine, with the tiny LLaMA ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_engine_under_tight_memory_and_continuous_arrivals(mode, scheduling_policy):
    prompts, params, arrivals = random_workload(40, seed=11, prompt_len=(1, 30), max_tokens=(1, 20),
                                                arrival_gap=0.7)
    need = max(-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(prompts, params))
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, long_prefill_chunk=8, block_size=4,
                             num_blocks=need + 1, num_host_blocks=need if mode == "swap" else 0,
                             preemption_mode=mode, scheduling_policy=scheduling_policy)
    eng = engine_for(tiny_model(), config)
    bound = wait_bound([len(p) for p in prompts], [sp.max_tokens for sp in params], arrivals)
    d = drive(eng, prompts, params, arrivals, max_steps=bound + 1)
    want = baseline_tokens(tiny_model(), prompts, params, TINY.eos_token_id)
    assert [d.outputs[f"r{i}"].token_ids for i in range(40)] == want
    assert eng.scheduler.stats.num_preemptions > 10
    if scheduling_policy == "fcfs":
        assert all(d.end_step[r] - d.arrival_step[r] <= bound - d.arrival_step[r] for r in d.outputs)
    assert_drained(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_two_requests_that_each_need_the_whole_pool_take_turns(mode):
    # 4 blocks of 4 = 16 token positions; each request grows to 8 + 8 = 16: they cannot both run.
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, block_size=4, num_blocks=4,
                             num_host_blocks=8 if mode == "swap" else 0, preemption_mode=mode)
    eng = engine_for(tiny_model(), config)
    plans = []
    eng.listen(on_plan=lambda ev: plans.append(ev.plan))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2
    d = drive(eng, prompts, params, [0, 0], max_steps=2 * 16)
    assert [d.outputs[f"r{i}"].token_ids for i in range(2)] == baseline_tokens(tiny_model(), prompts,
                                                                               params, None)
    preempted = [rid for p in plans for rid in p.preempted]
    assert preempted and set(preempted) == {"r1"}, "the older request is never the victim"
    assert d.end_step["r0"] < d.end_step["r1"] <= 2 * 16
    assert d.outputs["r0"].num_preemptions == 0
    assert_drained(eng)


def test_engine_a_crowd_of_pool_sized_requests_finishes_one_by_one():
    """Six requests that each need the whole pool, arriving together: no livelock, oldest first."""
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, block_size=2, num_blocks=10)
    eng = engine_for(tiny_model(), config)
    prompts = [[4 + i + j for j in range(12)] for i in range(6)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 6
    d = drive(eng, prompts, params, [0] * 6, max_steps=wait_bound([12] * 6, [8] * 6, [0] * 6))
    assert [d.outputs[f"r{i}"].token_ids for i in range(6)] == baseline_tokens(tiny_model(), prompts,
                                                                               params, None)
    ends = [d.end_step[f"r{i}"] for i in range(6)]
    assert ends == sorted(ends), "requests finish in arrival order"
    assert_drained(eng)
