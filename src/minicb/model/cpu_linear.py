"""bfloat16 linear layers on a CPU without bfloat16 matrix instructions: compute them in float32.

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
"""

from __future__ import annotations

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
