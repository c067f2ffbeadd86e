"""Random ragged steps for checking an attention backend against the float64 reference.

Used by the tests (with a CPU stand-in for the GPU kernels) and by ``bench/gpu_check.py`` (with the
real kernels). A step mixes what a continuous-batching step holds: decodes over a long cached context,
prompt chunks that follow cached tokens, whole prompts with no cache, and (optionally) trailing
padding rows; the sequences' blocks are scattered over the pool, so a wrong block-table lookup shows.

    plan, num_blocks = random_plan(seed=0, block_size=16)
    inputs = random_inputs(plan, num_blocks, heads=9, kv_heads=3, head_dim=64)
    ref = run_backend(lambda kv: ReferenceAttention(kv), inputs, torch.float64, "cpu")
    out = run_backend(lambda kv: make_backend("flash-attn", kv), inputs, torch.bfloat16, "cuda")
    relative_error(out, ref)    # max |out - ref| / max |ref|
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.model.kv_cache import KVCache
from minicb.runtime.packer import pack


def random_plan(seed: int, block_size: int, num_decodes: int = 3, num_chunks: int = 3,
                num_padding: int = 0, max_context: int = 96, max_chunk: int = 24) -> tuple[StepPlan, int]:
    """A one-step plan and the number of blocks its pool needs (a few spare ones in between)."""
    rng = random.Random(seed)
    shapes = [(rng.randint(1, max_context - 1), 1) for _ in range(num_decodes)]
    for i in range(num_chunks):   # alternately a chunk after cached tokens and a prompt from scratch
        start = rng.randint(1, max_context - max_chunk) if i % 2 == 0 else 0
        shapes.append((start, rng.randint(2, max_chunk)))
    rng.shuffle(shapes)
    need = [-(-(s + q) // block_size) for s, q in shapes]
    num_blocks = sum(need) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    seqs = []
    for i, ((start, q), n) in enumerate(zip(shapes, need)):
        table = tuple(pool.pop() for _ in range(n))
        seqs.append(ScheduledSeq(f"s{i}", i, tuple(rng.randrange(100) for _ in range(q)), start, table, True))
    padding = tuple(rng.randint(1, max_chunk) for _ in range(num_padding))
    return StepPlan(0, tuple(seqs), padding=padding, block_size=block_size), num_blocks


@dataclass(slots=True)
class AttentionInputs:
    plan: StepPlan
    num_blocks: int
    q: torch.Tensor          # float64 [N, Hq, D], the step's new tokens
    k: torch.Tensor          # float64 [N, Hkv, D]
    v: torch.Tensor
    ctx_slots: torch.Tensor  # int64: cache slots of the tokens cached before the step
    ctx_k: torch.Tensor      # float64 [len(ctx_slots), Hkv, D]
    ctx_v: torch.Tensor


def random_inputs(plan: StepPlan, num_blocks: int, heads: int, kv_heads: int, head_dim: int,
                  seed: int = 0) -> AttentionInputs:
    g = torch.Generator().manual_seed(seed)
    n = plan.num_batched_tokens + plan.num_padding_tokens
    bs = plan.block_size
    slots = [s.block_table[p // bs] * bs + p % bs for s in plan.seqs for p in range(s.start_pos)]

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return AttentionInputs(plan, num_blocks, rnd(n, heads, head_dim), rnd(n, kv_heads, head_dim),
                           rnd(n, kv_heads, head_dim), torch.tensor(slots, dtype=torch.long),
                           rnd(len(slots), kv_heads, head_dim), rnd(len(slots), kv_heads, head_dim))


def run_backend(factory, inputs: AttentionInputs, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, KVCache]:
    """Fill a fresh cache with the context, run ``prepare`` + ``attend`` on layer 0; the output as
    float64 on the CPU, and the cache (to check what the backend wrote)."""
    kv = KVCache(1, inputs.num_blocks, inputs.plan.block_size, inputs.k.shape[1],
                 inputs.k.shape[2], dtype, device)
    if len(inputs.ctx_slots):
        kv.write(0, inputs.ctx_k.to(device, dtype), inputs.ctx_v.to(device, dtype),
                 inputs.ctx_slots.to(device))
    backend = factory(kv)
    batch = pack(inputs.plan, device)
    state = backend.prepare(batch.attn)
    out = backend.attend(0, inputs.q.to(device, dtype), inputs.k.to(device, dtype),
                         inputs.v.to(device, dtype), state)
    return out.to("cpu", torch.float64), kv


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` (both as float64)."""
    out, ref = out.to(torch.float64).cpu(), ref.to(torch.float64).cpu()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
