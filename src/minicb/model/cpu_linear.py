"""Linear layers on the CPU: bfloat16 computed in float32, and an LM head packed once for oneDNN.

**bfloat16 on a CPU without bfloat16 matrix instructions: compute it in float32.**

A bfloat16 matmul is fast on the CPU only when the hardware multiplies bfloat16 itself (AVX-512 BF16,
AMX) and torch's oneDNN uses it (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``). Elsewhere (an
AVX2-only machine, or a VM that hides AVX-512) torch falls back to a generic loop: on the 2-core AVX2
machine of ``bench/RESULTS.md`` a ``[64, 576] x [576, 1536]`` bfloat16 ``F.linear`` runs at about
2.4 GFLOP/s, forty times slower than the same product in float32 through MKL.

What a bfloat16 linear layer computes is the same either way: bfloat16 inputs and weights, products
summed in float32, the result rounded once to bfloat16. A bfloat16 value widens to float32 exactly
(it is the top half of a float32), so ``F.linear(x.float(), w.float()).to(torch.bfloat16)`` is that
computation, with the order of the additions left to the float32 GEMM::

    x (bf16) --widen--> x32 --MKL sgemm with w32 (bf16 values, stored as float32)--> y32 --round--> y (bf16)

``Float32ComputeLinear`` does exactly this with a float32 copy of the weight made once, so every matmul
runs at float32 speed. The price is memory (the float32 copy beside the bfloat16 weight) and the
weights' trip from memory at float32 size; the model's dtype, its activations, its KV cache and every
other operation stay bfloat16. ``LLM`` applies it to models it loads itself when
``needs_float32_compute(dtype, device)`` says so; a model built by hand is left as it is.

**The LM head, packed once.** ``F.linear`` goes to MKL's sgemm, which copies the weight into its own
blocked panels on every call. For the seven matrices of a layer that copy is small beside the
arithmetic; for the LM head (SmolLM2: ``[49152, 576]``, 113 MB in float32) it is not, because a decode
step asks it for few rows (one per running sequence) and the copy of 113 MB is most of the call: at 36
rows it ran at about 50 GFLOP/s here, where one core's float32 matmuls reach about 95. vLLM's CPU
build reorders every weight once at load for oneDNN (``onednn_mm``); ``PackedLinear`` does that for the
LM head alone, through the same torch ops inductor uses when it freezes a CPU model::

    load:   packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)       # once: oneDNN's layout
    step:   y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

The same products, summed in float32 in oneDNN's order instead of MKL's (results agree to float32
rounding, not bit for bit). On the machine of ``bench/RESULTS.md`` the head is 1.2-1.9x faster at the
8 to 64 rows of decode steps, about as fast at 1 row and at 512 (``python bench/step_parts.py
--lm-head``); for the layers' matrices oneDNN's packed path was slower than MKL above a handful of
rows, so they stay on ``F.linear``. The price is memory: the packed copy beside the weight the
embedding still reads (tied weights). float64 has no oneDNN GEMM and keeps ``F.linear``;
``MINICB_PACKED_LM_HEAD=0`` keeps it for every dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def fast_bf16_matmul() -> bool:
    """Whether torch multiplies bfloat16 matrices with the CPU's own bfloat16 instructions."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def needs_float32_compute(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True for a bfloat16 model on a CPU whose bfloat16 matmul is torch's slow fallback."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not fast_bf16_matmul()


class Float32ComputeLinear(nn.Module):
    """An ``nn.Linear`` (no bias) whose bfloat16 product is computed in float32 (module docstring).

    ``weight`` is the original bfloat16 parameter (shared, so tied embeddings and ``state_dict`` are
    unchanged); ``weight_f32`` is its exact float32 copy, the one the matmul reads.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Float32ComputeLinear takes linear layers without bias (LLaMA has none)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_buffer("weight_f32", linear.weight.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight_f32).to(x.dtype)


def compute_linears_in_float32(model: nn.Module) -> int:
    """Replace every bfloat16 ``nn.Linear`` of ``model`` by a ``Float32ComputeLinear``, in place.
    Returns how many were replaced."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16]
    for parent, name, child in swaps:
        setattr(parent, name, Float32ComputeLinear(child))
    return len(swaps)


def can_pack() -> bool:
    """Whether this torch has oneDNN's packed linear ops (a CPU build with MKLDNN)."""
    try:
        return (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """An ``nn.Linear`` (no bias) computed by oneDNN from a float32 weight it reordered once (module
    docstring). ``weight`` stays the original parameter (tied embeddings and ``state_dict`` unchanged);
    ``weight_packed`` is oneDNN's copy, in float32 also for a bfloat16 layer, whose input is widened and
    output rounded back as ``Float32ComputeLinear`` does."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("PackedLinear takes linear layers without bias (LLaMA has none)")
        if linear.weight.device.type != "cpu" or linear.weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("PackedLinear takes float32 or bfloat16 CPU layers, got "
                             f"{linear.weight.dtype} on {linear.weight.device.type}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        w32 = getattr(linear, "weight_f32", None)           # a Float32ComputeLinear's copy, if any
        w32 = (linear.weight.detach().float() if w32 is None else w32).contiguous()
        self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(w32, 64),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.weight_packed, None, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def packed_lm_head_enabled() -> bool:
    """False when ``MINICB_PACKED_LM_HEAD=0`` asks for ``F.linear``."""
    return os.environ.get("MINICB_PACKED_LM_HEAD", "1") != "0"


def pack_lm_head(model: nn.Module) -> bool:
    """Replace ``model.lm_head`` by a ``PackedLinear`` when it is a float32 product on the CPU (a
    float32 layer, or a bfloat16 one computed in float32) and this torch can pack; True if it did."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, PackedLinear) or not packed_lm_head_enabled() or not can_pack():
        return False
    float32_product = (type(head) is nn.Linear and head.weight.dtype == torch.float32) or \
        isinstance(head, Float32ComputeLinear)
    if not float32_product or head.weight.device.type != "cpu" or getattr(head, "bias", None) is not None:
        return False
    model.lm_head = PackedLinear(head)
    return True
