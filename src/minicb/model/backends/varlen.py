"""Varlen attention over the paged KV cache: what a FlashAttention-style kernel needs, as index maths.

A *varlen* kernel (``flash_attn_varlen_func``, ``torch.nn.attention.varlen.varlen_attn``) takes the
step's queries flat, ``q [total_q, Hq, D]``, and the keys flat, ``k/v [total_k, Hkv, D]``, with two
offset vectors that say where each sequence starts::

    q rows        a0 a1 a2 | b9 | c4 c5              cu_seqlens_q  0 3 4 6        (int32, B + 1)
    k rows        a0 a1 a2 | b0 .. b9 | c0 .. c5     cu_seqlens_k  0 3 13 19      (int32, B + 1)

Causality is *bottom-right aligned* per sequence (flash-attn >= 2.1): query ``i`` of a sequence with
``q_len`` queries and ``k_len`` keys sees keys ``0 .. k_len - q_len + i``, which is exactly "a token at
position ``start_pos + i`` sees positions ``0 .. start_pos + i``" for a prefill chunk or a decode token
that follows cached tokens. Prompt chunks and decodes (``q_len == 1``) go through the same call.

The older keys live in the paged cache, not next to each other. There are two ways to hand them over:

* **gather** (any block size; the default): every step, :func:`build_varlen_plan` turns the block
  tables into ``key_slots``, the flat cache slot of every key of every sequence laid end to end, and
  each layer does one ``index_select`` of K and one of V into contiguous ``[total_k, Hkv, D]`` tensors.
  Cost: the step's whole context is read from the cache and written once more (about 2x the attention
  memory traffic, plus ``total_k * Hkv * D`` scratch per tensor) -- cheap next to the matmuls for short
  contexts, the dominant cost for long decodes.
* **paged** (block size a multiple of 256, as flash-attn 2's paged kernels demand): the kernel reads
  the cache's pages ``[num_blocks, block_size, Hkv, D]`` itself through ``block_table``; no copy at
  all. Cost: 256-token blocks waste up to 255 slots per sequence (internal fragmentation), preemption
  and swapping move bigger units, and prefix sharing is coarser; vLLM's own kernels use 16.

Either way the new tokens' K/V are written into the cache first (through ``slot_mapping``), so one
read path serves old and new keys alike. Padding rows of the padded policies have no cache: they are
the trailing rows of the batch and attend to their own tokens in a second, cache-free varlen call.

Everything here except the kernel call is plain tensor indexing, so the preparation is tested on the
CPU (``tests/model/test_gpu_path.py``) against the reference backend, with an explicit per-sequence
attention standing in for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minicb.model.attention import AttentionBackend, AttentionMetadata, write_mask
from minicb.model.kv_cache import KVCache

PAGED_BLOCK_MULTIPLE = 256     # flash-attn 2: "Paged KV cache block size must be divisible by 256"
MODES = ("gather", "paged")


@dataclass(slots=True)
class VarlenPlan:
    """Per-step inputs of the varlen kernel calls, shared by every layer (built by ``prepare``)."""

    mode: str                           # "gather" or "paged"
    num_cached_tokens: int              # leading rows of q that belong to sequences with a cache
    cu_seqlens_q: torch.Tensor          # int32 [R + 1]
    cu_seqlens_k: torch.Tensor          # int32 [R + 1], cumulative context lengths
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_k: torch.Tensor             # int32 [R], context length of each sequence
    key_slots: torch.Tensor | None      # gather: int64 [total_k], cache slot of each key
    block_table: torch.Tensor | None    # paged: int32 [R, max_blocks]
    pad_cu_seqlens: torch.Tensor | None  # int32 [P + 1] over the trailing padding rows, or None
    pad_max_seqlen: int
    slot_mapping: torch.Tensor          # int64 [N]
    write_mask: torch.Tensor | None     # bool [N], False for padding tokens; None when all are written

    @property
    def num_seqs(self) -> int:
        """Sequences that read the cache (R); padding rows are not counted."""
        return int(self.cu_seqlens_q.shape[0]) - 1


def gather_key_slots(meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
    """The cache slot of key ``j`` of sequence ``r``, for every ``r < num_seqs`` and ``j < context_len``,
    laid end to end in ``cu_seqlens_k`` order: ``block_tables[r, j // bs] * bs + j % bs``. No loop."""
    dev = meta.slot_mapping.device
    bs = meta.block_size
    ctx = meta.context_lens[:num_seqs].long()
    total_k = sum(s + q for s, q in zip(meta.start_positions[:num_seqs], meta.q_lens[:num_seqs]))
    row = torch.repeat_interleave(torch.arange(num_seqs, device=dev), ctx, output_size=total_k)
    j = torch.arange(total_k, device=dev) - meta.cu_seqlens_k[:num_seqs].long()[row]
    blocks = meta.block_tables[:num_seqs].long()[row, j // bs]
    return blocks * bs + j % bs


def build_varlen_plan(meta: AttentionMetadata, has_cache: bool, mode: str = "gather") -> VarlenPlan:
    """A pure function of the step's metadata: the int32 offsets, and the key slots or block table."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    r = meta.num_seqs - meta.num_padding_rows if has_cache else 0
    q_lens, starts = meta.q_lens, meta.start_positions
    ctx = [s + q for s, q in zip(starts[:r], q_lens[:r])]
    n_cached = sum(q_lens[:r])
    pad = q_lens[r:]
    pad_cu = None
    if pad:
        pad_cu = (meta.cu_seqlens_q[r:] - meta.cu_seqlens_q[r]).to(torch.int32).contiguous()
    return VarlenPlan(
        mode=mode, num_cached_tokens=n_cached,
        cu_seqlens_q=meta.cu_seqlens_q[: r + 1].to(torch.int32).contiguous(),
        cu_seqlens_k=meta.cu_seqlens_k[: r + 1].to(torch.int32).contiguous(),
        max_seqlen_q=max(q_lens[:r], default=0), max_seqlen_k=max(ctx, default=0),
        seqused_k=meta.context_lens[:r].to(torch.int32).contiguous(),
        key_slots=gather_key_slots(meta, r) if (mode == "gather" and r) else None,
        block_table=meta.block_tables[:r].to(torch.int32).contiguous() if mode == "paged" else None,
        pad_cu_seqlens=pad_cu, pad_max_seqlen=max(pad, default=0),
        slot_mapping=meta.slot_mapping, write_mask=write_mask(meta.slot_mapping),
    )


class VarlenAttention(AttentionBackend):
    """Paged attention through a varlen kernel; subclasses say which kernel (``_varlen``).

    ``kernel`` replaces the library function (tests pass a CPU stand-in with the same signature);
    ``paged=None`` chooses paged mode when the kernel supports it and the block size is a multiple of
    256, gather mode otherwise.
    """

    name = "varlen"
    supports_paged = True

    def __init__(self, kv_cache: KVCache | None, kernel=None, paged: bool | None = None) -> None:
        self.kv_cache = kv_cache
        self.kernel = kernel if kernel is not None else self._load_kernel()
        if paged is None:
            paged = (self.supports_paged and kv_cache is not None
                     and kv_cache.block_size % PAGED_BLOCK_MULTIPLE == 0)
        if paged and kv_cache is None:
            raise ValueError("paged mode needs a KV cache")
        if paged and not self.supports_paged:
            raise ValueError(f"the {self.name} kernel here cannot read a paged cache; use paged=False")
        self.mode = "paged" if paged else "gather"

    def _load_kernel(self):
        raise NotImplementedError

    def _varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, block_table=None, seqused_k=None):
        """One causal (bottom-right) varlen call; ``k/v`` are pages when ``block_table`` is given."""
        raise NotImplementedError

    def prepare(self, meta: AttentionMetadata) -> VarlenPlan:
        return build_varlen_plan(meta, self.kv_cache is not None, self.mode)

    def attend(self, layer: int, q, k, v, plan: VarlenPlan) -> torch.Tensor:
        parts = []
        n = plan.num_cached_tokens
        if self.kv_cache is not None:
            self.kv_cache.write(layer, k, v, plan.slot_mapping, plan.write_mask)
        if plan.num_seqs:
            if plan.mode == "paged":
                kc, vc = self.kv_cache.data[layer, 0], self.kv_cache.data[layer, 1]   # [blocks, bs, H, D]
                extra = dict(block_table=plan.block_table, seqused_k=plan.seqused_k)
            else:
                kf, vf = self.kv_cache.layer(layer)
                kc, vc = kf.index_select(0, plan.key_slots), vf.index_select(0, plan.key_slots)
                extra = {}
            parts.append(self._varlen(q[:n].contiguous(), kc, vc, plan.cu_seqlens_q, plan.cu_seqlens_k,
                                      plan.max_seqlen_q, plan.max_seqlen_k, **extra))
        if plan.pad_cu_seqlens is not None:   # padding rows: no cache, each attends to its own tokens
            parts.append(self._varlen(q[n:].contiguous(), k[n:].contiguous(), v[n:].contiguous(),
                                      plan.pad_cu_seqlens, plan.pad_cu_seqlens, plan.pad_max_seqlen,
                                      plan.pad_max_seqlen))
        if not parts:
            return torch.empty_like(q)
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
