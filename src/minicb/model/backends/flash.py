"""The ``flash-attn`` backend: FlashAttention 2's ``flash_attn_varlen_func`` on the paged cache.

One kernel call per layer serves the whole ragged step (prompt chunks and decodes alike)::

    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=True, block_table=None | block_table)

``causal=True`` is bottom-right aligned since flash-attn 2.1, which is what a chunk after cached tokens
needs. Decodes could also use ``flash_attn_with_kvcache`` (``q`` as ``[B, 1, H, D]``); the varlen call
already handles ``q_len == 1`` rows, so one path serves both and the step needs no split.

How the cache reaches the kernel (``gather`` for any block size, ``paged`` when the block size is a
multiple of 256) and what each costs is explained in ``varlen.py``. The kernel takes float16 or
bfloat16 on a CUDA device of compute capability 8.0 or newer, head_dim a multiple of 8 up to 256; the
registry (``backends/__init__.py``) checks that before this class is built.
"""

from __future__ import annotations

from minicb.model.backends.varlen import VarlenAttention


class FlashAttnBackend(VarlenAttention):
    name = "flash-attn"

    def _load_kernel(self):
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func

    def _varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, block_table=None, seqused_k=None):
        # flash-attn takes the context lengths from cu_seqlens_k even in paged mode (no seqused_k)
        kw = {} if block_table is None else {"block_table": block_table}
        return self.kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=True, **kw)
