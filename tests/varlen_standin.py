"""CPU stand-ins for the GPU varlen kernels (tests only).

``explicit_varlen_attention`` is the definition of what ``flash_attn_varlen_func`` computes, written as
plainly as possible: a Python loop over sequences, keys repeated per query head, an explicit
bottom-right causal mask (query ``i`` of a sequence with ``lq`` queries and ``lk`` keys sees keys
``j <= i + lk - lq``), and paged K/V read through the block table. The two wrappers have the real
functions' signatures and first check the inputs the way the kernels require them (int32 offsets,
contiguous tensors, exact ``max_seqlen``, shapes), recording every call so tests can inspect them.
"""

from __future__ import annotations

import torch


def explicit_varlen_attention(q, k, v, cu_q, cu_k, block_table=None, scale=None) -> torch.Tensor:
    hq, d = q.shape[1], q.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        lq, lk = q1 - q0, k1 - k0
        if block_table is None:
            kb, vb = k[k0:k1], v[k0:k1]
        else:
            pages = block_table[b, : -(-lk // k.shape[1])].long()
            kb = k[pages].reshape(-1, *k.shape[2:])[:lk]
            vb = v[pages].reshape(-1, *v.shape[2:])[:lk]
        grp = hq // kb.shape[1]
        kb, vb = kb.repeat_interleave(grp, 1), vb.repeat_interleave(grp, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], kb) * scale
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, vb)
    return out


def check_kernel_inputs(q, k, v, cu_q, cu_k, max_q, max_k, block_table=None) -> None:
    """What flash-attn 2's varlen entry point requires (``TORCH_CHECK``s in ``flash_api.cpp``)."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        assert cu.dtype == torch.int32, f"{name} must be int32, is {cu.dtype}"
        assert cu.dim() == 1 and cu.is_contiguous(), name
        assert int(cu[0]) == 0 and bool((cu[1:] >= cu[:-1]).all()), f"{name} must start at 0 and grow"
    assert cu_q.shape == cu_k.shape, "one offset per sequence in both"
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.is_contiguous(), f"{name} must be contiguous"
        assert t.dtype == q.dtype and t.device == q.device, name
    assert q.dim() == 3 and q.shape[0] == int(cu_q[-1]), "q is [total_q, Hq, D]"
    lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    assert max_q == max(lq) and max_k == max(lk), "max_seqlen must be the true maximum"
    assert isinstance(max_q, int) and isinstance(max_k, int), "max_seqlen are host ints (no sync)"
    assert all(a <= b for a, b in zip(lq, lk)), "every query has its own key (k_len >= q_len)"
    if block_table is None:
        assert k.dim() == 3 and k.shape[0] == int(cu_k[-1]) and v.shape == k.shape, "k/v [total_k, Hkv, D]"
    else:
        assert k.dim() == 4 and v.shape == k.shape, "paged k/v are [num_blocks, block_size, Hkv, D]"
        assert block_table.dtype == torch.int32 and block_table.is_contiguous()
        assert block_table.shape[0] == len(lq)
        assert all(-(-n // k.shape[1]) <= block_table.shape[1] for n in lk), "table covers every key"
    assert q.shape[1] % k.shape[-2] == 0 and q.shape[-1] == k.shape[-1]


class FlashAttnStandIn:
    """``flash_attn_varlen_func`` on the CPU."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 deterministic=False, return_attn_probs=False, block_table=None):
        assert causal and dropout_p == 0.0 and window_size == (-1, -1)
        check_kernel_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
        self.calls.append(dict(q=q.shape, k=k.shape, cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_k.tolist(),
                               paged=block_table is not None))
        return explicit_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, softmax_scale)


class TorchVarlenStandIn:
    """``torch.nn.attention.varlen.varlen_attn`` (torch 2.13 signature) on the CPU."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert window_size == (-1, 0), "causal is window_size=(-1, 0)"
        assert enable_gqa or query.shape[1] == key.shape[-2]
        check_kernel_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, block_table)
        if block_table is not None:
            assert seqused_k is not None and seqused_k.dtype == torch.int32
            assert seqused_k.tolist() == (cu_seq_k[1:] - cu_seq_k[:-1]).tolist()
        self.calls.append(dict(q=query.shape, k=key.shape, paged=block_table is not None))
        return explicit_varlen_attention(query, key, value, cu_seq_q, cu_seq_k, block_table, scale)


class OldTorchVarlenStandIn:
    """An older-style signature: ``is_causal=``, no ``enable_gqa``, no paging (the backend adapts)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                 return_aux=None, scale=None):
        assert is_causal and query.shape[1] == key.shape[1], "no GQA: heads must be repeated"
        check_kernel_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        self.calls.append(dict(q=query.shape, k=key.shape, paged=False))
        return explicit_varlen_attention(query, key, value, cu_seq_q, cu_seq_k, None, scale)
