"""Test helpers: tiny random LLaMA models and an engine driver with staggered arrivals."""

from __future__ import annotations

import torch

from drain import drain, finals
from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.engine.llm_engine import LLMEngine
from minicb.fastpaths.install import runner_kwargs
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.baseline import generate_padded
from minicb.runtime.runner import engine_for

TINY = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                   max_position_embeddings=4096, eos_token_id=3)

_MODELS: dict = {}


def tiny_model(cfg: ModelConfig = TINY, seed: int = 0, dtype=torch.float64) -> LlamaForCausalLM:
    key = (cfg, seed, dtype)
    if key not in _MODELS:
        _MODELS[key] = LlamaForCausalLM.random(cfg, seed=seed, dtype=dtype, std=0.3)
    return _MODELS[key]


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (m,), generator=g).tolist() for m in lens]


def run_engine(model, config: SchedulerConfig, prompts, params, arrivals=None, check=True,
               attn_backend: str = "auto", fast_paths: bool = True):
    """Drive an engine: request i is added at step ``arrivals[i]``. Returns outputs in input order.
    ``fast_paths``: the runner gets the fast paths' backends and argmax (``auto`` is then the C decode
    kernel on the CPU, as under ``LLM()``); False: the reference model's own."""
    kernels = runner_kwargs() if fast_paths else {}
    eng = engine_for(model, config, attn_backend=attn_backend, **kernels)
    arrivals = arrivals or [0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    plist = params if isinstance(params, list) else [params] * len(prompts)
    steps = [0]

    def one_step(eng: LLMEngine) -> list:
        while pending and arrivals[pending[0]] <= steps[0]:
            i = pending.pop(0)
            eng.add_request(f"r{i}", prompts[i], plist[i])
        if not pending:
            eng.scheduler.close_arrivals()
        steps[0] += 1
        return eng.step()

    outs = finals(drain(eng, one_step, max_steps=100_000, more=lambda: bool(pending), check=check))
    assert_drained(eng)
    return [outs[f"r{i}"] for i in range(len(prompts))], eng


def assert_drained(eng: LLMEngine) -> None:
    s = eng.scheduler
    assert not s.has_unfinished()
    assert s.slot_table.num_free == s.config.max_num_seqs
    assert s.block_manager.num_free_blocks == s.config.num_blocks
    assert s.block_manager.num_free_host_blocks == s.config.num_host_blocks


def baseline_tokens(model, prompts, params, eos: int | None) -> list[list[int]]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    return generate_padded(model, prompts, plist, eos_token_id=eos).token_ids


def greedy(max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
