"""The model runner: the one place where a step touches tensors.

A ``StepPlan`` says *what* to compute (no torch); the runner does it, in the order the plan module
promises::

    run(plan, params):
        kv_cache.swap_out(plan.swap_out)     # device blocks -> host blocks (swap preemption)
        kv_cache.swap_in(plan.swap_in)       # host blocks -> device blocks (resumed sequences)
        kv_cache.copy_blocks(plan.copy_blocks)   # copy-on-write of a fork's shared last block
        batch  = pack(plan)                  # flat ids, positions, cu_seqlens, slot_mapping, block_tables
        logits = model(batch)                # one forward over every scheduled token, writes new K/V
        return sampler.sample(logits)        # {request_id: token} for the rows that reached their end

A request that asks for logprobs gets a ``RowOutput`` instead of a bare token (``minicb.engine.logprobs``):
the sampled token's logprob and top-k (``SamplingParams.logprobs``), and for a prompt chunk the
logprobs of the prompt tokens its rows score (``prompt_logprobs``; the packer asked the model for
those rows' logits in the same forward).

The runner owns the model, the paged KV cache, the attention backend and the sampler's per-request
generators. It is handed how to make its attention backend and its greedy argmax (``make_backend``,
``argmax``): by default the reference model's own (``minicb.model.backends``, torch's argmax), from the
fast paths with them on (``minicb.fastpaths.runner_kwargs``), which it never imports. It knows nothing
about slots, queues or policies: it gets a frozen plan and returns the sampled tokens, so the
scheduler's state never depends on it.

**One runner, every rank.** With tensor parallelism (``minicb.distributed``) every rank holds
a runner over its own shard and calls this same ``run`` with the same plan; rank 0 (its ``TPRunner``, a
``ModelRunner`` that sends the plan first) passes the
requests' sampling parameters and gets tokens back, the other ranks pass none: they skip the LM head and
sampling, but swap, pack and run every layer (and so every all-reduce) exactly as rank 0 does. Nothing else in
minicb calls the model during serving.

**A runner for the engine.** ``ModelRunner`` is one implementation of the engine's ``Runner`` interface
(``minicb.engine.interface``): ``run``, per-request ``register`` / ``release`` (the sampler's generators),
``vocab_size``, ``eos_token_id``, ``failure``, ``close``. The engine is handed a runner and never builds one,
so it imports no torch. ``engine_for(model, config)`` is the one call that makes both: a runner whose KV pool
has the shape ``config`` schedules (``num_blocks`` x ``block_size``, ``num_host_blocks``), and the engine
that drives it::

    engine = engine_for(model, SchedulerConfig(max_num_seqs=8), tokenizer)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from minicb.core.config import SchedulerConfig
from minicb.core.errors import check_int
from minicb.core.plan import StepPlan
from minicb.core.sampling_params import SamplingParams
from minicb.engine.llm_engine import LLMEngine
from minicb.engine.logprobs import RowOutput
from minicb.model import backends
from minicb.model.kv_cache import KVCache
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.logprobs import release_heap, row_logprobs
from minicb.runtime.packer import RaggedBatch, pack
from minicb.runtime.sampling import Sampler


def _reference_backend(name, kv_cache, device):
    """The reference model's own attention backends (``minicb.model.backends``)."""
    return backends.make_backend(name, kv_cache, device)


class ModelRunner:
    """Owns the model, its paged KV cache, the attention backend and the sampler; ``run`` executes a plan."""

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int,
                 num_host_blocks: int = 0, attn_backend: str = "auto", seed: int | None = None,
                 pad_token_id: int = 0, tokenizer=None, make_backend=None, argmax=None,
                 greedy_head=None) -> None:
        if seed is not None:
            seed = check_int("seed", seed, lo=0, hi=2**63 - 1)     # a plain int (numpy / torch ints too)
        cfg = model.config
        self.model = model
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                cfg.head_dim, model.dtype, model.device, num_host_blocks)
        self.backend = (make_backend or _reference_backend)(attn_backend, self.kv_cache, model.device)
        # the tokenizer is for structured outputs only: a grammar is over text, its mask over token ids
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        eos = cfg.eos_token_id if eos is None else eos
        self.sampler = Sampler(seed, tokenizer=tokenizer, vocab_size=cfg.vocab_size, eos_token_id=eos,
                               argmax=argmax)
        self.greedy_head = greedy_head(model) if greedy_head is not None else None
        self.pad_token_id = pad_token_id
        self._device = model.device
        self._no_rows = torch.empty(0, dtype=torch.long, device=model.device)

    @classmethod
    def for_config(cls, model: LlamaForCausalLM, config: SchedulerConfig, **kwargs) -> ModelRunner:
        """A runner whose KV pool is the one ``config`` schedules (blocks, block size, host blocks)."""
        return cls(model, num_blocks=config.num_blocks, block_size=config.block_size,
                   num_host_blocks=config.num_host_blocks, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # --- the engine's Runner interface (minicb.engine.interface) --------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.model.config.eos_token_id

    failure: BaseException | None = None      # one process: a failed step never breaks the runner

    def register(self, request_id: str, params: SamplingParams, prompt_token_ids=(), *,
                 eos_token_id: int | None = None, tokenizer=None) -> None:
        self.sampler.register(request_id, params, prompt_token_ids, vocab_size=self.vocab_size,
                              eos_token_id=eos_token_id, tokenizer=tokenizer)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def close(self) -> None:
        """Nothing to release: the model and the KV cache go with the runner."""

    def run(self, plan: StepPlan, params: Mapping[str, SamplingParams] | None = None
            ) -> dict[str, int | RowOutput]:
        """Swap, pack, forward, sample. ``params`` maps each request of the plan to its sampling
        parameters; ``None`` (tensor-parallel worker ranks) runs every layer but samples nothing. A
        step whose rows are all plain greedy takes its tokens from the greedy head where the fast paths
        gave one (``fastpaths.greedy_head``: argmax's tokens without computing every logit)."""
        if plan.swap_out or plan.swap_in or plan.copy_blocks:   # preemption and forks only
            self.kv_cache.swap_out(plan.swap_out)
            self.kv_cache.swap_in(plan.swap_in)
            self.kv_cache.copy_blocks(plan.copy_blocks)
        if not (plan.seqs or plan.padding):
            return {}
        batch = pack(plan, self._device, self.pad_token_id)
        rows = batch.logits_indices if params is not None else self._no_rows
        if self.greedy_head is not None and self._greedy_only(batch, params):   # the tokens alone
            hidden = self.model(batch.input_ids, batch.positions, self.backend, batch.attn, rows, head=False)
            tokens = self.greedy_head.tokens(hidden)
            if tokens is not None:
                return dict(zip(batch.sample_request_ids, tokens))
            logits = self.model.lm_head(hidden)     # a row it could not bound: every logit, as usual
            return self._sample(batch, logits, params)
        logits = self.model(batch.input_ids, batch.positions, self.backend, batch.attn, rows)
        if params is None or not (batch.sample_request_ids or batch.prompt_spans):
            return {}
        if batch.prompt_spans:
            return self._with_prompt_logprobs(batch, logits, params)
        return self._sample(batch, logits, params)

    def _greedy_only(self, batch: RaggedBatch, params: Mapping[str, SamplingParams] | None) -> bool:
        """Whether this step's tokens may come from the greedy head: it has one, every sampled row is
        greedy and wants nothing but its token (no logprobs, no processors, no prompt logprobs), and
        the step has as many rows as the head takes."""
        head, ids = self.greedy_head, batch.sample_request_ids
        if params is None or batch.prompt_spans:
            return False
        if not head.min_rows <= len(ids) <= head.max_rows:
            return False
        procs = self.sampler._processors
        return not any(params[r].temperature or params[r].logprobs is not None or r in procs for r in ids)

    def _sample(self, batch: RaggedBatch, logits: torch.Tensor,
                params: Mapping[str, SamplingParams]) -> dict[str, int | RowOutput]:
        """The sampled rows' tokens (``logits``: one row per sampled request, in order): plain ints,
        or ``RowOutput``s for the requests that want logprobs."""
        ids = batch.sample_request_ids
        if not ids:
            return {}
        plist, logprobs = [], False
        for r in ids:
            plist.append(params[r])
            logprobs = logprobs or params[r].logprobs is not None
        if not logprobs:                                       # the usual step: tokens only
            return dict(zip(ids, self.sampler.sample(logits, ids, plist)))
        tokens, lps = self.sampler.sample_with_logprobs(logits, ids, plist)
        return {r: t if lp is None else RowOutput(t, lp) for r, t, lp in zip(ids, tokens, lps)}

    def _with_prompt_logprobs(self, batch: RaggedBatch, logits: torch.Tensor,
                              params: Mapping[str, SamplingParams]) -> dict[str, int | RowOutput]:
        """A step with prompt rows: sample the sampled rows, score each chunk's prompt rows (the raw
        model distribution: no processor applies to a prompt) and join them per request."""
        out = self._sample(batch, logits[batch.sample_rows], params)
        for rid, first, start, targets in batch.prompt_spans:
            rows = row_logprobs(logits[first:first + len(targets)], targets, params[rid].prompt_logprobs)
            sampled = out.get(rid)
            if isinstance(sampled, RowOutput):
                out[rid] = RowOutput(sampled.token, sampled.logprobs, tuple(rows), start, sampled.error)
            else:
                out[rid] = RowOutput(sampled, None, tuple(rows), start)
        release_heap()                       # the rows' temporaries: back to the system, not kept
        return out


def engine_for(model: LlamaForCausalLM, config: SchedulerConfig, tokenizer=None, *, seed: int | None = None,
               clock: Callable[[], float] = time.perf_counter, attn_backend: str = "auto",
               **kernels) -> LLMEngine:
    """An ``LLMEngine`` that runs ``model``: a ``ModelRunner`` with ``config``'s KV pool, driven by the
    engine's one step loop. ``seed`` seeds the sampler of requests without their own seed; the runner
    gets ``tokenizer`` too, for structured outputs (a grammar's mask is built from the vocabulary's text);
    ``attn_backend`` picks the attention implementation (``minicb.model.backends``). ``kernels``: what
    the fast paths hand the runner (``make_backend``, ``argmax``: ``minicb.fastpaths.runner_kwargs()``);
    without them the runner runs the reference model's own code."""
    runner = ModelRunner.for_config(model, config, attn_backend=attn_backend, seed=seed, tokenizer=tokenizer,
                                    **kernels)
    return LLMEngine(runner, config, tokenizer, clock=clock)
