"""Which rank holds which weights, and the model that one rank runs.

Tensor parallelism (Megatron-LM's scheme) gives every rank a slice of every weight matrix;
``shard_layout`` decides the slices (by KV group, so each rank's attention is ordinary grouped-query
attention over the heads it holds), ``shard_state_dict`` cuts one rank's weights out of the full
state dict, and ``ShardedLlama`` is the single-process LLaMA built from them, with o_proj and
down_proj made *row-parallel* (``RowParallelLinear``: each rank multiplies its slice of the input
features, an all-reduce sums the partial products)::

    x ─ RMSNorm ─┬ q_proj[q heads of r]  ─┐ attention over r's heads,
                 ├ k_proj[kv heads of r] ─┼ r's own KV cache ─ o_proj[:, q heads of r] ─ all-reduce ─ + x
                 └ v_proj[kv heads of r] ─┘
    x ─ RMSNorm ─ gate_proj[cols of r], up_proj[cols of r] ─ silu(g)·u ─ down_proj[:, cols of r]
                                                                          ─ all-reduce ─ + x

The package docstring (``minicb.distributed``) explains the layout rules with examples. Nothing here
communicates by itself: the all-reduce belongs to the rank's ``TPGroup`` (``minicb.distributed.group``),
which ``ShardedLlama.attach`` hands to the row-parallel layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minicb.core.config import ModelConfig
from minicb.core.errors import check_int
from minicb.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from minicb.distributed.group import TPGroup


@dataclass(slots=True, frozen=True)
class RankShard:
    """The query heads, KV heads and MLP intermediate columns that one rank holds."""

    rank: int
    q_heads: range
    kv_heads: range
    mlp: range


def _split(r: range, n: int) -> list[range]:
    """``r`` cut into ``n`` contiguous parts whose lengths differ by at most one (longer ones first)."""
    q, extra = divmod(len(r), n)
    bounds = [r.start]
    for i in range(n):
        bounds.append(bounds[-1] + q + (i < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def shard_layout(cfg: ModelConfig, world: int) -> tuple[RankShard, ...]:
    """Who holds which heads and columns (``minicb.distributed``, "Sharding"). Raises ``InvalidArgument`` if
    ``world`` exceeds the query heads or the MLP's intermediate size."""
    h, k = cfg.num_attention_heads, cfg.num_key_value_heads
    check_int("tensor_parallel_size", world, lo=1, hi=min(h, cfg.intermediate_size))
    group = h // k
    mlp = _split(range(cfg.intermediate_size), world)
    if world <= k:
        kv = _split(range(k), world)
        return tuple(RankShard(r, range(kv[r].start * group, kv[r].stop * group), kv[r], mlp[r])
                     for r in range(world))
    shards: list[RankShard] = []
    for j, ranks in enumerate(_split(range(world), k)):          # the ranks that share KV head j
        q_parts = _split(range(j * group, (j + 1) * group), len(ranks))
        shards += [RankShard(r, q, range(j, j + 1), mlp[r]) for r, q in zip(ranks, q_parts)]
    return tuple(shards)


def local_config(cfg: ModelConfig, shard: RankShard) -> ModelConfig:
    """The shape of one rank's slice: a LLaMA with fewer heads and a narrower MLP (same hidden size)."""
    return dataclasses.replace(cfg, num_attention_heads=len(shard.q_heads),
                               num_key_value_heads=len(shard.kv_heads),
                               intermediate_size=len(shard.mlp), head_dim=cfg.head_dim)


def shard_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig,
                     shard: RankShard) -> dict[str, torch.Tensor]:
    """One rank's weights (Hugging Face names): sliced ones are fresh, contiguous copies (so the full
    tensors can be freed); replicated ones (embedding, norms, head) are the originals."""
    d = cfg.head_dim
    q = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    cols = slice(shard.mlp.start, shard.mlp.stop)
    out = {}
    for name, w in state_dict.items():
        if name.endswith("q_proj.weight"):
            w = w[q]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            w = w[kv]
        elif name.endswith("o_proj.weight"):
            w = w[:, q]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            w = w[cols]
        elif name.endswith("down_proj.weight"):
            w = w[:, cols]
        else:
            out[name] = w
            continue
        out[name] = w.clone(memory_format=torch.contiguous_format)
    return out



# --- the sharded model --------------------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """``y = x_r @ W_r.T`` summed over ranks: rank ``r`` holds the input columns ``W_r`` of its heads (or
    MLP columns) and an all-reduce adds the partial products. The weight keeps its parameter name."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class ShardedLlama(LlamaForCausalLM):
    """One rank's slice of a LLaMA: ``config`` is the local shape (``local_config``), ``full_config`` the
    model's. Its forward is the single-process one; only o_proj and down_proj are row-parallel."""

    full_config: ModelConfig
    tp: TPGroup | None = None

    @classmethod
    def build(cls, cfg: ModelConfig, shard: RankShard, state_dict: dict[str, torch.Tensor],
              dtype: torch.dtype, device: torch.device) -> ShardedLlama:
        model = cls.from_state_dict(local_config(cfg, shard), state_dict, dtype, device)
        model.full_config = cfg
        return model

    def attach(self, tp: TPGroup) -> None:
        """Make o_proj and down_proj row-parallel over ``tp``."""
        self.tp = tp
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj.weight, tp)
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj.weight, tp)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        try:
            return super().forward(*args, **kwargs)
        except BaseException as exc:   # the other ranks wait in an all-reduce this rank will not join
            self.tp.fail(exc)
            raise
