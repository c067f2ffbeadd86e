"""Fused RMSNorm and rotary embedding for a CPU model in float32 or bfloat16 (``fused_ops.c``).

A decoder layer of ``llama.py`` runs about twenty small torch ops besides its matmuls: RMSNorm is six
(widen, square, mean, add eps, rsqrt, two multiplies), the rotary embedding of q and k ten (negate and
concatenate the halves, two multiplies and an add, twice). Each is a pass over the step's activations
into a freshly allocated tensor, plus some microseconds of dispatch, thirty layers a step. vLLM's CPU
build runs them as a few loops of its ``torch.compile``'d graph. This module does the same for the two
biggest groups with two C loops (compiled on first use like the decode kernel: ``ckernels.py``), and
the MLP's SiLU and product in place::

    llama.py (the reference, what the tutorials read)      here (same arithmetic, fewer passes)
    RMSNorm: h = x.float(); h * rsqrt(mean(h^2) + eps)      one C loop per row
    apply_rope(q), apply_rope(k): cat, neg, mul, mul, add   one C call per layer, q and k in place
    silu(gate(x)) * up(x)                                   silu_(g); g.mul_(up(x))

``fuse_elementwise(model)`` switches the layers of a loaded model to these versions (their classes,
not their weights); ``LLM`` does it for the models it loads itself, on the CPU, in float32 and
bfloat16. float64 stays on the reference ops: it is the dtype minicb's exactness checks run in, and
this RMSNorm sums its squares in another order than torch does (a float32 rounding apart); the rotary
embedding and the MLP compute exactly what the reference computes (``fused_ops.c``: no fused
multiply-adds, every intermediate rounded to the model's dtype as torch rounds it).
``MINICB_FUSED_OPS=0`` keeps the reference ops; where the C compiler is missing, ``LLM`` keeps them
and logs one line saying why.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from minicb.model import ckernels
from minicb.model.llama import LlamaAttention, LlamaMLP, RMSNorm

SOURCE = Path(__file__).with_name("fused_ops.c")
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
EXTRA_FLAGS = ("-ffp-contract=off",)     # no fused multiply-adds: the rounding of the separate torch ops


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The compiled ``fused_ops.c`` (built on the first call); ``KernelUnavailable`` if it cannot be."""
    lib = ckernels.open_library(ckernels.build(SOURCE, extra_flags=EXTRA_FLAGS), "the compiled fused ops")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for suffix in DTYPES.values():
        norm = getattr(lib, f"minicb_rmsnorm_{suffix}")
        norm.argtypes, norm.restype = [ptr] * 3 + [i64] * 2 + [ctypes.c_double, ctypes.c_int], None
        rope = getattr(lib, f"minicb_rope_{suffix}")
        rope.argtypes, rope.restype = [ptr] * 4 + [i64] * 4 + [ctypes.c_int], None
    return lib


@functools.cache
def _c_function(name: str, dtype: torch.dtype):
    """The C function ``minicb_<name>_<f32|bf16>``, looked up once (a norm is called 61 times a step)."""
    return getattr(load(), f"minicb_{name}_{DTYPES[dtype]}")


def unavailable_reason() -> str | None:
    """None when the fused ops build and load here, else why not."""
    return ckernels.why_not(load)


def _check(name: str, *tensors: torch.Tensor) -> None:
    """What keeps the C loops in bounds: one dtype of theirs, contiguous CPU tensors (one plain loop:
    this runs 91 times a step)."""
    dtype = tensors[0].dtype
    for t in tensors:
        if t.dtype != dtype or dtype not in DTYPES:
            raise ValueError(f"{name} takes float32 or bfloat16 tensors of one dtype, got "
                             f"{[t.dtype for t in tensors]}")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} takes contiguous CPU tensors")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` of ``x [..., dim]`` with ``weight [dim]``, as ``llama.RMSNorm`` computes it."""
    _check("rms_norm", x, weight)
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    out = torch.empty_like(x)
    if x.numel():
        _c_function("rmsnorm", x.dtype)(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
            torch.get_num_threads())
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q [N, q_heads, D]`` and ``k [N, kv_heads, D]`` in place by ``cos`` / ``sin [N, D]``:
    what ``llama.apply_rope`` returns for each."""
    _check("rope_", q, k, cos, sin)
    n, d = cos.shape
    if (q.dim() != 3 or k.dim() != 3 or q.shape[::2] != (n, d) or k.shape[::2] != (n, d)
            or sin.shape != (n, d) or d % 2):
        raise ValueError(f"rope_: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if n:
        _c_function("rope", q.dtype)(
            q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, q.shape[1], k.shape[1], d,
            torch.get_num_threads())


class FusedRMSNorm(RMSNorm):
    """``RMSNorm`` computed by one C loop (``rms_norm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.contiguous(), self.weight, self.eps)


class FusedAttention(LlamaAttention):
    """``LlamaAttention`` with q and k rotated in place by one C call (``rope_``)."""

    def rotate(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        rope_(q, k, cos, sin)
        return q, k


class FusedMLP(LlamaMLP):
    """``LlamaMLP`` with SiLU and the product done in place on the gate projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(g.mul_(self.up_proj(x)))


FUSED = {RMSNorm: FusedRMSNorm, LlamaAttention: FusedAttention, LlamaMLP: FusedMLP}


def enabled() -> bool:
    """False when ``MINICB_FUSED_OPS=0`` asks for the reference ops."""
    return os.environ.get("MINICB_FUSED_OPS", "1") != "0"


def fuse_elementwise(model: torch.nn.Module) -> int:
    """Switch ``model``'s norms, attention and MLP modules to their fused versions, in place (their
    weights untouched); returns how many were switched. Builds the C ops first, so a missing compiler
    raises ``KernelUnavailable`` before anything changes."""
    dtype = next(model.parameters()).dtype
    if dtype not in DTYPES:
        raise ValueError(f"the fused ops are for float32 and bfloat16 models, not {dtype}")
    load()
    swaps = [m for m in model.modules() if type(m) in FUSED]
    for m in swaps:
        m.__class__ = FUSED[type(m)]
    return len(swaps)
