"""The padded static batch: how LLM serving worked before continuous batching, and minicb's oracle.

All prompts of the batch are left-padded to the longest and run together; the batch decodes until its
*last* member finishes. Rows that finished early keep computing throw-away tokens (the "padding
bubbles" of the static-batching note, docs/origins.md)::

    row 0  . . . P P P P | t t t t t t t t     (P prompt, t generated, . padding, x wasted)
    row 1  P P P P P P P | t t t x x x x x
    row 2  . . P P P P P | t t t t t x x x
           <-- prefill -->  <-- decode steps -->

The KV cache is the plainest possible: a contiguous ``[B, T_max]`` tensor per layer indexed by
position (gpt-fast's shape), behind ``StaticCacheAttention``. Every schedule the engine can produce
(any policy, chunk size, block size, preemption) must give each request exactly the tokens this
function gives it; the tests check that in float64.

``padded_token_slots`` counts the token slots computed for nothing (left padding plus finished rows),
``total_token_slots`` all slots computed, so ``padded / total`` is the benchmark table's "padding waste".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minicb.core.sampling_params import SamplingParams
from minicb.engine.logprobs import RowOutput
from minicb.model.attention import StaticCacheAttention, StaticMeta
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.sampling import Sampler


@dataclass(slots=True)
class BaselineResult:
    token_ids: list[list[int]]
    padded_token_slots: int
    total_token_slots: int
    steps: int

    @property
    def padding_waste(self) -> float:
        return self.padded_token_slots / max(self.total_token_slots, 1)


def _is_stop(token: int, n_out: int, p: SamplingParams, eos: int | None) -> bool:
    stop_id = (not p.ignore_eos and token == eos) or token in p.stop_token_ids
    return (stop_id and n_out > p.min_tokens) or n_out >= p.max_tokens


@torch.inference_mode()
def generate_padded(model: LlamaForCausalLM, prompts: list[list[int]],
                    params: SamplingParams | list[SamplingParams], eos_token_id: int | None = None,
                    pad_token_id: int = 0, tokenizer=None) -> BaselineResult:
    """Generate for ``prompts`` as one left-padded static batch; returns each row's new tokens.
    (``tokenizer`` is needed only for ``bad_words``.)"""
    b = len(prompts)
    plist = params if isinstance(params, list) else [params] * b
    cfg, dev = model.config, model.device
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    big_p = int(lens.max())
    t_max = big_p + max(p.max_tokens for p in plist)
    backend = StaticCacheAttention(cfg.num_hidden_layers, b, t_max, cfg.num_key_value_heads,
                                   cfg.head_dim, model.dtype, dev)
    ids = torch.full((b, big_p), pad_token_id, dtype=torch.long, device=dev)
    key_valid = torch.ones(b, t_max, dtype=torch.bool, device=dev)
    for r, p in enumerate(prompts):
        ids[r, big_p - len(p):] = torch.tensor(p, device=dev)
        key_valid[r, : big_p - len(p)] = False
    col = torch.arange(big_p, device=dev)
    positions = torch.clamp(col[None, :] - (big_p - lens)[:, None], min=0)

    sampler = Sampler()
    for r, p in enumerate(plist):
        sampler.register(f"row{r}", p, prompts[r], vocab_size=cfg.vocab_size, eos_token_id=eos_token_id,
                         tokenizer=tokenizer)
    rids = tuple(f"row{r}" for r in range(b))
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    padded = int((big_p - lens).sum())
    total = b * big_p
    logits = model(ids.flatten(), positions.flatten(), backend, StaticMeta(b, big_p, 0, key_valid),
                   torch.arange(b, device=dev) * big_p + big_p - 1)
    steps = 1
    t = 0
    while True:
        tokens = sampler.sample(logits, rids, plist)
        failed = next((t.error for t in tokens if isinstance(t, RowOutput)), None)
        if failed is not None:           # the padded baseline has no per-request errors: it stops
            raise RuntimeError(failed)
        for r in range(b):
            if not done[r]:
                out[r].append(tokens[r])
                done[r] = _is_stop(tokens[r], len(out[r]), plist[r], eos_token_id)
        if all(done):
            break
        # every row computes a token this step, finished or not: that is the static batch's waste
        padded += sum(done)
        total += b
        step_ids = torch.tensor([pad_token_id if done[r] else out[r][-1] for r in range(b)], device=dev)
        logits = model(step_ids, lens + t, backend, StaticMeta(b, 1, big_p + t, key_valid))
        t += 1
        steps += 1
    return BaselineResult(out, padded, total, steps)
