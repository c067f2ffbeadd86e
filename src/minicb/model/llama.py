"""LLaMA on flat tokens: one forward over all scheduled sequences laid end to end.

A continuous-batching step mixes prompt chunks and single decode tokens of many requests. Instead of a
padded ``[batch, time]`` tensor, the model takes them flat::

    input_ids   [a0 a1 a2 b9 c4 c5]      one row per token, no padding
    positions   [ 0  1  2  9  4  5]      each token's position in its own sequence (for RoPE)

Every layer except attention is per-token (embedding, RMSNorm, RoPE, the Q/K/V/O and MLP matmuls), so
it neither knows nor cares which sequence a row belongs to. Attention is the only place where
sequences must be kept apart; it is delegated to an ``AttentionBackend`` (``attention.py``) together
with the batch's metadata (``cu_seqlens``, block tables, ...), so the paged cache, the padded baseline
cache and GPU kernels all plug in without touching this file.

Architecture (Hugging Face ``LlamaForCausalLM`` parameter names, so weights load unchanged)::

    x = embed(ids)
    for each layer:  x += o_proj(attn(rope(q_proj(rms(x))), rope(k_proj(rms(x))), v_proj(rms(x))))
                     x += down_proj(silu(gate_proj(rms(x))) * up_proj(rms(x)))
    logits = lm_head(rms(x))[rows asked for]     # lm_head tied to embed when the model says so

Numerics: RMSNorm statistics and rotary angles are computed in float32 and cast back, exactly as
Hugging Face's reference does, so that float64 runs can be compared with it token for token. Both are
per-token operations, so they never make a result depend on the batch around it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument
from minicb.model.attention import AttentionBackend

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def as_dtype(dtype) -> torch.dtype:
    """A ``torch.dtype`` from itself or its name in ``DTYPES`` ("float32", ...); anything else is an
    ``InvalidArgument`` naming the choices."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@functools.lru_cache(maxsize=8)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The rotary frequencies ``theta ** (-2i / head_dim)``: the model's constants, computed once (four
    small torch calls fewer a step, each of which starts cold after the step's kernels)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin ``[N, head_dim]`` for each token's own position (angles in float32, as HF does)."""
    inv_freq = _inv_freq(head_dim, float(theta), positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, head_dim]`` by its token's angle (the "rotate half" convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x, cos, sin, layer: int, backend: AttentionBackend, state) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.project(x)
        q, k = self.rotate(q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d), cos, sin)
        out = backend.attend(layer, q, k, v.view(n, self.num_kv_heads, d), state)
        return self.o_proj(out.reshape(n, self.num_heads * d))

    def project(self, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of ``x``: three matmuls (``cpu_linear`` makes them one, packed for oneDNN)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rotate(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by their tokens' positions (``cpu_fused`` does it in place, in C)."""
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, i, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, i, bias=False)
        self.down_proj = nn.Linear(i, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin, layer: int, backend, state) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, backend, state)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns logits only for the rows in ``logits_indices``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, meta,
                logits_indices: torch.Tensor | None = None, head: bool = True) -> torch.Tensor:
        """The logits of the rows in ``logits_indices`` (``head=False``: their last hidden state, for
        a caller that applies the LM head its own way: the greedy head, ``fastpaths.greedy_head``)."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        state = backend.prepare(meta)
        hidden = self.hidden(x, cos, sin, backend, state, logits_indices)
        return self.lm_head(hidden) if head else hidden

    def hidden(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
               state, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Every decoder layer, then the final norm: the last hidden state of the rows that will be
        sampled, what the LM head reads. (A subclass may run the layers another way: ``layer_stack``.)"""
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, backend, state)
        if logits_indices is not None:
            x = x[logits_indices]      # only the rows that will be sampled: skip the big vocab matmul
        return self.model.norm(x)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state_dict: dict[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """Build the model on the meta device and adopt the weights without a second copy."""
        with torch.device("meta"):
            model = cls(cfg)
        sd = dict(state_dict)
        if cfg.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"weights missing from the state dict: {missing[:5]}")
        return model.to(device).eval()

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float64,
               std: float = 0.1):
        """A randomly initialised model for tests and tutorials (no weights file needed)."""
        g = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(std * torch.randn(p.shape, generator=g))
        return model.to(dtype).eval()
