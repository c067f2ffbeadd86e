"""The model runner: the one place where a step touches tensors.

A ``StepPlan`` says *what* to compute (no torch); the runner does it, in the order the plan module
promises::

    run(plan, params):
        kv_cache.swap_out(plan.swap_out)     # device blocks -> host blocks (swap preemption)
        kv_cache.swap_in(plan.swap_in)       # host blocks -> device blocks (resumed sequences)
        batch  = pack(plan)                  # flat ids, positions, cu_seqlens, slot_mapping, block_tables
        logits = model(batch)                # one forward over every scheduled token, writes new K/V
        return sampler.sample(logits)        # {request_id: token} for the rows that reached their end

The runner owns the model, the paged KV cache, the attention backend and the sampler's per-request
generators. It knows nothing about slots, queues or policies: it gets a frozen plan and returns the
sampled tokens, so the scheduler's state never depends on it.

**One runner, every rank.** With tensor parallelism (``minicb.distributed.tensor_parallel``) every rank holds
a runner over its own shard and calls this same ``run`` with the same plan; rank 0 (the engine) passes the
requests' sampling parameters and gets tokens back, the other ranks pass none: they skip the LM head and
sampling, but swap, pack and run every layer (and so every all-reduce) exactly as rank 0 does. Nothing else in
minicb calls the model during serving.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from minicb.core.plan import StepPlan
from minicb.core.sampling_params import SamplingParams
from minicb.model.backends import make_backend
from minicb.model.kv_cache import KVCache
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.packer import pack
from minicb.runtime.sampling import Sampler


class ModelRunner:
    """Owns the model, its paged KV cache, the attention backend and the sampler; ``run`` executes a plan."""

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int,
                 num_host_blocks: int = 0, attn_backend: str = "auto", seed: int | None = None,
                 pad_token_id: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                cfg.head_dim, model.dtype, model.device, num_host_blocks)
        self.backend = make_backend(attn_backend, self.kv_cache, model.device)
        self.sampler = Sampler(seed)
        self.pad_token_id = pad_token_id
        self._no_rows = torch.empty(0, dtype=torch.long, device=model.device)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def run(self, plan: StepPlan, params: Mapping[str, SamplingParams] | None = None) -> dict[str, int]:
        """Swap, pack, forward, sample. ``params`` maps each request of the plan to its sampling
        parameters; ``None`` (tensor-parallel worker ranks) runs every layer but samples nothing."""
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        batch = pack(plan, self.model.device, self.pad_token_id)
        if batch.num_tokens == 0:
            return {}
        rows = batch.logits_indices if params is not None else self._no_rows
        logits = self.model(batch.input_ids, batch.positions, self.backend, batch.attn, rows)
        if params is None or not batch.sample_request_ids:
            return {}
        ids = batch.sample_request_ids
        tokens = self.sampler.sample(logits, ids, [params[r] for r in ids])
        return dict(zip(ids, tokens))
