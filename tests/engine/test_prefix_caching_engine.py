"""Prefix caching in the engine, on a tiny float64 LLaMA: caching on gives the same tokens as caching
off and as the padded baseline, on workloads with heavy sharing (identical prompts, a common system
prompt, prompts that are prefixes of each other, prompts of whole blocks, prompts fully covered by
cached blocks), staggered so that later requests hit, with chunked prefill and forced preemption; and
``LLM.reset_prefix_cache``. The block manager and scheduler levels are ``tests/core/test_prefix_caching.py``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TINY, baseline_tokens, run_engine, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams


def test_llm_reset_prefix_cache_makes_a_rerun_compute_its_prompts_again():
    from minicb.entrypoints.llm import LLM

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, TINY.vocab_size, (n,), generator=g).tolist() for n in (9, 13, 17)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm = LLM(tiny_model(), dtype="float64", block_size=4, num_blocks=64)
    stats = llm.engine.stats
    first = [o.token_ids for o in llm.generate(prompts, params)]
    cached, computed = stats.num_cached_prompt_tokens, stats.num_batched_tokens
    assert cached == 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == first
    assert stats.num_cached_prompt_tokens - cached == 4 * (2 + 3 + 4)      # full blocks, last token's aside
    assert llm.reset_prefix_cache() is True
    cached, computed = stats.num_cached_prompt_tokens, stats.num_batched_tokens
    assert [o.token_ids for o in llm.generate(prompts, params)] == first
    assert stats.num_cached_prompt_tokens == cached                        # nothing found: computed again
    assert stats.num_batched_tokens - computed == sum(map(len, prompts)) + 3 * 4


# --- the engine: tiny float64 LLaMA, caching on == caching off == padded baseline ---------------------
def _workloads():
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(4, TINY.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    system, long = rand(21), rand(40)
    return {
        "identical": [long[:13]] * 6,
        "system prompt": [system + rand(int(n)) for n in torch.randint(1, 10, (8,), generator=g)],
        "prefixes of each other": [long[:k] for k in (1, 4, 5, 8, 12, 16, 17, 23, 32, 40)],
        "whole blocks, fully covered": [long[:16], long[:32], long[:16], long[:8], long[:32], long[:8]],
    }


WORKLOADS = _workloads()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("block_size, budget, chunk, slack, mode", [
    (4, 64, None, None, "recompute"),         # room for all: hits on blocks still held and freed
    (4, 12, 5, None, "recompute"),            # chunked prefill after the cached prefix
    (1, 33, None, 2, "swap"),                 # one token per block; forced preemption, swap
    (8, 16, None, 0, "recompute"),            # forced preemption (no slack: same-step sharing saves blocks)
])
def test_engine_with_caching_equals_without_and_the_baseline(name, block_size, budget, chunk, slack, mode):
    model = tiny_model()
    prompts = WORKLOADS[name]
    params = [SamplingParams(max_tokens=3 + (5 * i) % 9, ignore_eos=True) for i in range(len(prompts))]
    arrivals = [i // 2 * 3 for i in range(len(prompts))]     # pairs, three steps apart
    need = max(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(prompts, params))
    num_blocks = 64 if slack is None else max(need, 4) + slack
    base = dict(max_num_seqs=4, max_num_batched_tokens=budget, long_prefill_chunk=chunk,
                block_size=block_size, num_blocks=num_blocks, preemption_mode=mode,
                num_host_blocks=num_blocks if mode == "swap" else 0, max_model_len=128)
    on, eng_on = run_engine(model, SchedulerConfig(**base), prompts, params, arrivals)
    off, _ = run_engine(model, SchedulerConfig(**base, enable_prefix_caching=False), prompts, params,
                        arrivals)
    expected = baseline_tokens(model, prompts, params, None)
    assert [o.token_ids for o in on] == expected
    assert [o.token_ids for o in off] == expected
    stats = eng_on.scheduler.stats
    assert stats.num_cached_prompt_tokens > 0, "the workload must actually hit the cache"
    assert any(o.num_cached_tokens > 0 for o in on)
    if slack is not None:
        assert stats.num_preemptions > 0
