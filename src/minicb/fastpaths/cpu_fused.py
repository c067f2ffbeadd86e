"""Fused RMSNorm, residual add, rotary embedding and SiLU for a CPU model in float32 or bfloat16.

A decoder layer of ``llama.py`` runs about twenty small torch ops besides its matmuls: RMSNorm is six
(widen, square, mean, add eps, rsqrt, two multiplies), the rotary embedding of q and k ten (negate and
concatenate the halves, two multiplies and an add, twice), the residual adds two, the MLP's SiLU and
product two. Each is a pass over the step's activations into a freshly allocated tensor, plus some
microseconds of dispatch, thirty layers a step. vLLM's CPU build runs them as a few loops of its
``torch.compile``'d graph. This module does the same with a few C loops (compiled on first use like the
decode kernel: ``ckernels.py``)::

    llama.py (the reference, what the tutorials read)      here (same arithmetic, fewer passes)
    RMSNorm: h = x.float(); h * rsqrt(mean(h^2) + eps)      one C loop per row
    x = x + attn; h = RMSNorm(x)                            one C loop per row, x updated in place
    x = x + mlp                                             in place (x.add_)
    apply_rope(q), apply_rope(k): cat, neg, mul, mul, add   one C call per layer, q and k in place
                                                            (views into the q/k/v product's rows)
    silu(gate(x)) * up(x)                                   one C pass over the gate/up product
                                                            (``cpu_linear`` makes gate and up one)

``fuse_elementwise(model)`` switches the layers of a loaded model to these versions (their classes,
not their weights); ``LLM`` does it for the models it loads itself, on the CPU, in float32 and
bfloat16. float64 stays on the reference ops: it is the dtype minicb's exactness checks run in. How
close the rest is: the rotary embedding and the residual adds compute exactly what the reference
computes (``fused_ops.c``: no fused multiply-adds, every intermediate rounded to the model's dtype as
torch rounds it); RMSNorm sums its squares in another order than torch does (a float32 rounding
apart); the SiLU's ``e^-x`` is a polynomial (``exp_f32.h``) where torch uses its vector library's, so
float32 SiLU products agree to a few float32 roundings and bfloat16 ones nearly always exactly
(``tests/model/test_cpu_fused.py`` checks each against float64). ``MINICB_FUSED_OPS=0`` keeps the
reference ops; where the C compiler is missing, ``LLM`` keeps them and logs one line saying why.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from minicb.fastpaths import ckernels
from minicb.fastpaths.settings import Settings
from minicb.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm

SOURCE = Path(__file__).parent / "csrc" / "fused_ops.c"
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
EXTRA_FLAGS = ("-ffp-contract=off",     # no fused multiply-adds: the rounding of the separate torch ops
               "-fno-trapping-math")   # no FP exception flags read: the SiLU's clamps vectorise


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The compiled ``fused_ops.c`` (built on the first call); ``KernelUnavailable`` if it cannot be."""
    lib = ckernels.open_library(ckernels.build(SOURCE, extra_flags=EXTRA_FLAGS), "the compiled fused ops")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for suffix in DTYPES.values():
        norm = getattr(lib, f"minicb_rmsnorm_{suffix}")
        norm.argtypes, norm.restype = [ptr] * 3 + [i64] * 2 + [ctypes.c_double, ctypes.c_int], None
        rope = getattr(lib, f"minicb_rope_{suffix}")
        rope.argtypes, rope.restype = [ptr] * 4 + [i64] * 6 + [ctypes.c_int], None
        add_norm = getattr(lib, f"minicb_add_rmsnorm_{suffix}")
        add_norm.argtypes, add_norm.restype = [ptr] * 4 + [i64] * 2 + [ctypes.c_double, ctypes.c_int], None
        silu_mul_ = getattr(lib, f"minicb_silu_mul_{suffix}")
        silu_mul_.argtypes, silu_mul_.restype = [ptr] * 2 + [i64] * 3 + [ctypes.c_int], None
        argmax = getattr(lib, f"minicb_argmax_{suffix}")
        argmax.argtypes, argmax.restype = [ptr] + [i64] * 3 + [ptr, ptr, ctypes.c_int], None
    return lib


@functools.cache
def _c_function(name: str, dtype: torch.dtype):
    """The C function ``minicb_<name>_<f32|bf16>``, looked up once (a norm is called 61 times a step)."""
    return getattr(load(), f"minicb_{name}_{DTYPES[dtype]}")


def unavailable_reason() -> str | None:
    """None when the fused ops build and load here, else why not."""
    return ckernels.why_not(load)


def _check(name: str, *tensors: torch.Tensor, rows_strided: int = 0) -> None:
    """What keeps the C loops in bounds: one dtype of theirs, contiguous CPU tensors (one plain loop:
    this runs 150 times a step). The first ``rows_strided`` tensors may be row-strided instead: each
    row contiguous, rows ``stride(0)`` elements apart (views into a wider product's rows)."""
    dtype = tensors[0].dtype
    for i, t in enumerate(tensors):
        if t.dtype != dtype or dtype not in DTYPES:
            raise ValueError(f"{name} takes float32 or bfloat16 tensors of one dtype, got "
                             f"{[t.dtype for t in tensors]}")
        if t.device.type != "cpu" or not (t.is_contiguous() or i < rows_strided and _rows_contiguous(t)):
            raise ValueError(f"{name} takes contiguous CPU tensors"
                             + (" (or rows of them)" if i < rows_strided else ""))


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Each row (``t[i]``) one contiguous run, rows at least a row apart: a slice of a wider row."""
    return t.dim() >= 2 and t[0].is_contiguous() and t.stride(0) >= t[0].numel()


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
    what ``llama.apply_rope`` returns for each. q and k may be views into the rows of the q/k/v
    product (each row contiguous, rows further apart): no copy is made of them."""
    _check("rope_", q, k, cos, sin, rows_strided=2)
    n, d = cos.shape
    if (q.dim() != 3 or k.dim() != 3 or q.shape[::2] != (n, d) or k.shape[::2] != (n, d)
            or sin.shape != (n, d) or d % 2):
        raise ValueError(f"rope_: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if n:
        _c_function("rope", q.dtype)(
            q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, q.shape[1], k.shape[1], d,
            q.stride(0), k.stride(0), torch.get_num_threads())


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (the residual add), then ``RMSNorm`` of the new ``x``: what
    ``x = x + delta; rms_norm(x, weight, eps)`` computes, in one pass over the rows."""
    _check("add_rms_norm_", x, delta, weight)
    dim = x.shape[-1]
    if weight.shape != (dim,) or delta.shape != x.shape:
        raise ValueError(f"add_rms_norm_: x {tuple(x.shape)}, delta {tuple(delta.shape)} and weight "
                         f"{tuple(weight.shape)} do not match")
    out = torch.empty_like(x)
    if x.numel():
        _c_function("add_rmsnorm", x.dtype)(
            x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
            torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(g) * u`` of the halves ``g, u`` of each row of ``gate_up [N, 2 * inter]`` (the gate/up
    product; its rows may be strided), rounded as ``F.silu`` and the product round: ``[N, inter]``.
    The SiLU's e^-g is ``exp_f32.h``'s polynomial, not torch's: float32 results agree with
    ``F.silu(g) * u`` to about a float32 rounding (a bfloat16 one in bfloat16), not bit for bit."""
    _check("silu_mul", gate_up, rows_strided=1)
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} is not [N, 2 * {inter}]")
    out = gate_up.new_empty(gate_up.shape[0], inter)
    if out.numel():
        _c_function("silu_mul", gate_up.dtype)(
            gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, gate_up.stride(0),
            torch.get_num_threads())
    return out


def argmax(logits: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.max(logits, -1).indices`` of float32 or bfloat16 ``logits [rows, n]`` (each row contiguous):
    the first maximum of each row, the first NaN where there is one, as int64 ``[rows]``. One C pass over
    integer keys of the values (``fused_ops.c``); torch's bfloat16 loop is several times slower.
    ``finite`` (bool ``[rows]``, optional) is filled with whether each row's maximum is finite."""
    _check("argmax", logits, rows_strided=1)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax: logits {tuple(logits.shape)} is not [rows, n > 0]")
    if finite is not None and (finite.dtype != torch.bool or finite.shape != logits.shape[:1]
                               or not finite.is_contiguous()):
        raise ValueError(f"argmax: finite {finite.dtype} {tuple(finite.shape)} is not bool "
                         f"[{logits.shape[0]}]")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        _c_function("argmax", logits.dtype)(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                            logits.stride(0), out.data_ptr(),
                                            None if finite is None else finite.data_ptr(),
                                            torch.get_num_threads())
    return out


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
    """``LlamaMLP`` with SiLU and the product done in place on the gate projection (and, once
    ``cpu_linear`` has made gate and up one product, by one C loop: ``silu_mul``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(g.mul_(self.up_proj(x)))


class FusedDecoderLayer(LlamaDecoderLayer):
    """``LlamaDecoderLayer`` whose residual adds are done in place on ``x`` (the forward's own running
    sum, which nothing else holds), the first together with the post-attention RMSNorm
    (``add_rms_norm_``): two fewer passes over the step's activations and two fewer tensors a layer."""

    def forward(self, x, cos, sin, layer: int, backend, state) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin, layer, backend, state)
        norm = self.post_attention_layernorm
        h = add_rms_norm_(x, a.contiguous(), norm.weight, norm.eps)
        return x.add_(self.mlp(h))


FUSED = {RMSNorm: FusedRMSNorm, LlamaAttention: FusedAttention, LlamaMLP: FusedMLP,
         LlamaDecoderLayer: FusedDecoderLayer}


def enabled(settings: Settings | None = None) -> bool:
    """False when ``MINICB_FUSED_OPS=0`` asks for the reference ops."""
    return (settings or Settings.from_env()).fused_ops


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


def greedy_argmax(logits: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """The sampler's greedy argmax (``runtime.sampling.Sampler``): for the logits it takes (CPU float32 /
    bfloat16 ``[rows, n > 0]``, the fused ops built) ``argmax``'s tokens as a list and the rows whose
    maximum is not finite (``sampling.unscorable_rows``'s answer, from the same pass); None otherwise.

    Why the second answer comes from here: after a step's C kernels have streamed the weights through
    the caches, each small torch call of the step's Python starts cold, about ten times slower than the
    same call in a loop (``python bench/decode_floor.py --cold-calls``, ``bench/RESULTS.md``), and
    ``unscorable_rows``'s four calls were a visible part of a one-sequence step. One flag a row, written
    by the argmax's own loop, costs nothing."""
    if logits.device.type != "cpu" or logits.dtype not in DTYPES or logits.dim() != 2 \
            or not logits.shape[1] or not _builds():
        return None
    finite = torch.empty(logits.shape[0], dtype=torch.bool)
    tokens = argmax(logits, finite).tolist()
    return tokens, [i for i, ok in enumerate(finite.tolist()) if not ok]


@functools.cache
def _builds() -> bool:
    """Whether the fused ops build here, asked once per process (a failed build is not retried each step)."""
    return unavailable_reason() is None
