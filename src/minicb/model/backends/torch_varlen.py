"""The ``torch-varlen`` backend: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA only).

The same FlashAttention 2 kernel that ships inside PyTorch, so no extra package is needed::

    varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True,
                block_table=None | block_table, seqused_k=None | context_lens)

``window_size=(-1, 0)`` is causal, bottom-right aligned like flash-attn's (torch 2.13; earlier
releases spelled it ``is_causal=True``). The keyword arguments the installed torch accepts are read
from the function's signature: without ``enable_gqa`` the K/V heads are repeated for grouped-query
attention, and without ``block_table`` the backend always gathers (see ``varlen.py`` for gather
versus paged).
"""

from __future__ import annotations

import inspect

from minicb.model.backends.varlen import VarlenAttention


class TorchVarlenBackend(VarlenAttention):
    name = "torch-varlen"

    def __init__(self, kv_cache, kernel=None, paged: bool | None = None) -> None:
        kern = kernel if kernel is not None else self._load_kernel()
        params = inspect.signature(kern).parameters
        self._window = "window_size" in params
        self._gqa = "enable_gqa" in params
        self.supports_paged = "block_table" in params and self._gqa
        super().__init__(kv_cache, kern, paged)

    def _load_kernel(self):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn

    def _varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, block_table=None, seqused_k=None):
        kw = {"window_size": (-1, 0)} if self._window else {"is_causal": True}
        if self._gqa:
            kw["enable_gqa"] = True
        elif q.shape[1] != k.shape[-2]:
            grp = q.shape[1] // k.shape[-2]
            k, v = k.repeat_interleave(grp, dim=-2), v.repeat_interleave(grp, dim=-2)
        if block_table is not None:
            kw.update(block_table=block_table, seqused_k=seqused_k)
        return self.kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
