"""Soak: 2,000 requests through a very small LLaMA in a pool that forces preemption all the time, with
random ``abort_request`` calls mid-flight, once per preemption mode.

What must hold at the end (docs/design.md, Invariants):

* every request ended exactly once (the driver asserts it): none lost, none duplicated;
* every request that was not aborted got exactly the padded baseline's tokens (float64; greedy, or
  seeded sampling with its own generator), and an aborted one got a prefix of them;
* the tokens streamed step by step add up to the final output;
* afterwards every slot and every block, device and host, is free; the scheduler's invariants held
  after every step.

Half the prompts start with one of eight shared prefixes and prefix caching is on, so cached blocks
are shared, evicted, preempted and aborted along the way too. Prompts are 1-40 tokens and 1-24 new
tokens, so a run costs about 5,000 engine steps; the model has one layer of width 16
(``robust_helpers.MICRO``). It runs in CI (about 20-40 s per mode on 2 cores).
"""

from __future__ import annotations

import random

import pytest

from helpers import assert_drained, baseline_tokens, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.runtime.runner import engine_for
from robust_helpers import MICRO, drive

N = 2000


def workload(seed: int):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, MICRO.vocab_size) for _ in range(rng.randint(4, 20))] for _ in range(8)]
    prompts, params, arrivals, t = [], [], [], 0.0
    for _ in range(N):
        prompt = [rng.randrange(4, MICRO.vocab_size) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:
            prompt = (rng.choice(prefixes) + prompt)[:40]
        prompts.append(prompt)
        kind = rng.random()
        if kind < 0.6:
            sp = SamplingParams(max_tokens=rng.randint(1, 24))
        elif kind < 0.75:
            sp = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True,
                                stop_token_ids=(rng.randrange(4, MICRO.vocab_size),))
        else:
            sp = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.5, 1.0]),
                                top_k=rng.choice([0, 8]), top_p=rng.choice([1.0, 0.9]),
                                seed=rng.randrange(2**31))
        params.append(sp)
        t += rng.expovariate(1.0)          # about one arrival per step: the pool is never idle
        arrivals.append(int(t))
    return prompts, params, arrivals


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak(mode):
    model = tiny_model(MICRO)
    prompts, params, arrivals = workload(seed=2024 + (mode == "swap"))
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=96, long_prefill_chunk=32,
                             block_size=4, num_blocks=40, num_host_blocks=16 if mode == "swap" else 0,
                             preemption_mode=mode, max_model_len=128, enable_prefix_caching=True)
    eng = engine_for(model, config)
    rng = random.Random(7)

    def abort(step: int, live: list[str]) -> list[str]:
        return [rng.choice(live)] if rng.random() < 0.05 else []

    d = drive(eng, prompts, params, arrivals, abort=abort)

    stats = eng.scheduler.stats
    assert stats.num_preemptions > 300, stats
    if mode == "swap":
        assert stats.num_swaps > 100 and stats.num_recomputes > 0, stats     # swaps, and fallbacks
        assert stats.num_swap_ins + stats.num_recomputes >= stats.num_preemptions - len(d.aborted)
    else:
        assert stats.num_swaps == 0
    assert 50 < len(d.aborted) < N // 4
    want = []
    for i in range(0, N, 250):                  # the baseline in static batches of 250
        want += baseline_tokens(model, prompts[i:i + 250], params[i:i + 250], MICRO.eos_token_id)
    for i, exp in enumerate(want):
        out = d.outputs[f"r{i}"]
        if out.request_id in d.aborted:
            assert out.finish_reason == "abort" and out.token_ids == exp[:len(out.token_ids)], i
        else:
            assert out.finish_reason in ("stop", "length") and out.error is None, i
            assert out.token_ids == exp, f"r{i}: {out.token_ids} != {exp}"
    assert_drained(eng)
    assert len(eng._live) == 0 and len(eng.runner.sampler._generators) == 0, "engine-side state leaked"
