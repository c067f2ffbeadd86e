"""The real model: minicb's greedy tokens equal Hugging Face transformers' (both float64 on the CPU).

transformers reads the same GGUF with its own dequantization and Q/K un-permutation, so agreement here
checks the loader, the tokenizer, the forward and the whole engine against an independent oracle.
"""

import subprocess
import sys

import pytest
import torch

from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM
from minicb.measure.workloads import SMOLLM2_PROMPTS, smollm2_prompt_ids
from minicb.model.llama import LlamaForCausalLM

PROMPTS = list(SMOLLM2_PROMPTS)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return smollm2_prompt_ids(smollm2.tokenizer)


@pytest.fixture(scope="module")
def hf_tokens(hf_smollm2, prompt_ids):
    """transformers' greedy continuation of every prompt, one prompt at a time (no padding at all)."""
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            mask = torch.ones(1, len(ids), dtype=torch.long)
            gen = hf_smollm2.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                      do_sample=False, eos_token_id=2, pad_token_id=2)
            out.append(gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def model64(smollm2):
    return LlamaForCausalLM.from_state_dict(smollm2.config, smollm2.state_dict, torch.float64)


def _generate(model, tokenizer, prompt_ids, **config):
    llm = LLM(model, tokenizer=tokenizer, **config)
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=NEW_TOKENS))
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.block_manager.num_free_blocks == eng.config.num_blocks
    return [o.token_ids for o in outs], eng


@pytest.mark.model
@pytest.mark.slow
def test_greedy_equals_transformers_8_prompts(model64, smollm2, prompt_ids, hf_tokens):
    mine, _ = _generate(model64, smollm2.tokenizer, prompt_ids[:8], max_num_seqs=8)
    assert mine == hf_tokens[:8]
    assert sum(len(t) for t in mine) >= 8 * 16      # the comparison covers real generations


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_continuous_chunked_preempting_equals_transformers(model64, smollm2, prompt_ids, hf_tokens, mode):
    """16 prompts of mixed lengths, 24-token chunks, a pool too small for all: preemption must happen."""
    need = max(len(p) + NEW_TOKENS for p in prompt_ids)
    mine, eng = _generate(model64, smollm2.tokenizer, prompt_ids, max_num_seqs=8,
                          max_num_batched_tokens=48, long_prefill_chunk=24, block_size=8,
                          num_blocks=-(-need // 8) + 12, num_host_blocks=24 if mode == "swap" else 0,
                          preemption_mode=mode)
    assert mine == hf_tokens
    assert eng.scheduler.stats.num_preemptions > 0
    if mode == "swap":
        assert eng.scheduler.stats.num_swaps > 0


@pytest.mark.model
def test_cli_paris():
    r = subprocess.run([sys.executable, "-m", "minicb", "generate", "The capital of France is",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.model
def test_seeded_sampling_alone_and_in_batch_of_8(model64, smollm2, prompt_ids):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.95, seed=1234)
    llm = LLM(model64, tokenizer=smollm2.tokenizer, max_num_seqs=8)
    alone = llm.generate([prompt_ids[0]], params)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(7)]
    batch = llm.generate(prompt_ids[:8], [params] + others)
    assert batch[0].token_ids == alone
    assert len({tuple(o.token_ids) for o in batch}) > 1


@pytest.mark.model
@pytest.mark.slow
def test_prefix_caching_equals_transformers(model64, smollm2, prompt_ids, hf_tokens):
    """Prefix caching on (block_size 8) with heavy sharing, three prompts at a time so later ones hit.

    Round 1: the chat prompts 12-15 share SmolLM2's system prompt (24 tokens = 3 blocks); 13-15 are
    admitted after 12 has cached it. Round 2, on the same engine: prompt 13 again (32 tokens: whole
    blocks, all cached, so its last block is computed again), prompt 12 again (identical), and a next
    turn of prompt 15 (its prompt and first 8 generated tokens, whose blocks were cached too).
    """
    order = [12, 0, 1, 13, 14, 15]
    llm = LLM(model64, tokenizer=smollm2.tokenizer, max_num_seqs=3, block_size=8, max_num_batched_tokens=64)
    assert llm.engine.config.prefix_caching
    first = llm.generate([prompt_ids[i] for i in order], SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in first] == [hf_tokens[i] for i in order]
    assert [o.num_cached_tokens for o in first] == [0, 0, 0, 24, 24, 24]
    assert llm.engine.scheduler.stats.num_cached_prompt_tokens == 72

    k = 8
    assert len(prompt_ids[13]) == 32 and len(hf_tokens[15]) > k
    params = [SamplingParams(max_tokens=NEW_TOKENS)] * 2 + [SamplingParams(max_tokens=NEW_TOKENS - k)]
    second = llm.generate([prompt_ids[13], prompt_ids[12], prompt_ids[15] + hf_tokens[15][:k]], params)
    assert [o.token_ids for o in second] == [hf_tokens[13], hf_tokens[12], hf_tokens[15][k:]]
    assert [o.num_cached_tokens for o in second] == [24, 40, 80]
    eng = llm.engine
    assert eng.scheduler.block_manager.num_free_blocks == eng.config.num_blocks
