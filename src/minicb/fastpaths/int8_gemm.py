"""Products on int8 activations and a GGUF's Q4_1 weights as stored: llama.cpp's CPU arithmetic, opt-in.

A bfloat16 product of many rows (a W2 decode step, a prompt chunk) is arithmetic-bound: it runs at 96%
of ``vdpbf16ps``'s peak on a Zen 4 core (``bench/cpu_ceilings.py``). AVX-512 VNNI's ``vpdpbusd``
multiplies bytes at twice that rate, so ``int8_gemm.c`` rounds each row's activations to bytes per
block of 32 inputs and multiplies them by the file's 4-bit weights (the layout and the arithmetic are
drawn there). The weights are the file's exactly; the activations lose precision, so this is a
different model arithmetic from the bfloat16 one, not a faster way to the same sums. What it costs
in agreement and what it gains in time are measured figures (``python bench/agreement.py --modes
fast,int8``, ``python bench/int8_product.py``, bench/RESULTS.md), and it is off unless asked for::

    MINICB_INT8_PRODUCTS=1 minicb generate "Hi"          # a bfloat16 model loaded from a Q4_1 GGUF

Where: every product of the decoder layers, in the steps the layer stack runs (``layer_stack``) and in
the others (``cpu_linear.Int8Products``), so a sequence gets one arithmetic however it is batched (the
LM head stays bfloat16: the sampled distribution comes from bfloat16 weights); for a bfloat16 model
whose layers are all Q4_1 in the file, on a CPU with AVX-512 VNNI (``vpdpbusd``) or AVX2
(``vpmaddubsw``, a Zen 2's).
Elsewhere the setting says why it is not used and nothing changes. The plain C loop (any CPU) gives
the same bits as both and is what the tests compare them with; it is too slow to serve.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from minicb.fastpaths import ckernels, host_memory
from minicb.fastpaths.settings import Settings

SOURCE = Path(__file__).parent / "csrc" / "int8_gemm.c"
PANEL_WIDTH, BLOCK, BLOCK_BYTES = 64, 32, 1280      # TW, QB and BLOCK_BYTES in int8_gemm.c
Q4_1_BYTES = 20                                     # a GGUF Q4_1 block: d, m (float16), 16 bytes of nibbles
PATH_NAMES = {2: "AVX-512 VNNI", 1: "AVX2", 0: "plain C"}


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled ``int8_gemm.c`` (built on the first call); ``extra_flags`` builds a variant (the
    tests build ``-mno-avx512f`` for the plain C loop)."""
    lib = ckernels.open_library(ckernels.build(SOURCE, extra_flags=extra_flags), "the compiled int8 GEMM")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.minicb_int8_q4.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.minicb_int8_q4.restype = ctypes.c_int
    lib.minicb_int8_q4_part.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.minicb_int8_q4_part.restype = None          # from rows rounded by minicb_int8_quantize
    lib.minicb_int8_quantize.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.minicb_int8_quantize.restype = None
    lib.minicb_int8_path.argtypes, lib.minicb_int8_path.restype = [], ctypes.c_int
    return lib


def row_bytes(in_features: int) -> int:
    """Bytes of one row rounded for the kernel: ``in`` int8, then two float32 per block (QROW)."""
    return in_features + 8 * (in_features // BLOCK)


def pack(blocks: np.ndarray) -> torch.Tensor:
    """GGUF Q4_1 ``blocks`` ``[out, in / 32, 20]`` (uint8: d, m as float16, then byte k's low nibble is
    input k and its high one input k + 16) as ``int8_gemm.c``'s panels, uint8 ``[panels, in / 32,
    1280]``, outputs padded with zero blocks to a multiple of 64."""
    if blocks.dtype != np.uint8 or blocks.ndim != 3 or blocks.shape[2] != Q4_1_BYTES:
        raise ValueError(f"int8_gemm.pack takes Q4_1 blocks [out, in / 32, 20] uint8, got {blocks.dtype} "
                         f"{blocks.shape}")
    out, nb, _ = blocks.shape
    panels = -(-out // PANEL_WIDTH)
    b = F.pad(torch.from_numpy(blocks), (0, 0, 0, 0, 0, panels * PANEL_WIDTH - out))
    qs = b[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=2)                   # [out, nb, 32]: the inputs in order
    # input 8 gp + 4 half + t of output 16 v + o -> [panel, block, gp, v, o, t, half]
    q = q.reshape(panels, 4, 16, nb, 4, 2, 4).permute(0, 3, 4, 1, 2, 6, 5)
    nibbles = (q[..., 0] | q[..., 1] << 4).reshape(panels, nb, 1024)
    scales = b[..., :4].reshape(panels, PANEL_WIDTH, nb, 2, 2).permute(0, 2, 3, 1, 4)   # [.., (d, m), out, 2]
    return host_memory.on_huge_pages(torch.cat([nibbles, scales.reshape(panels, nb, 256)], dim=2))


def random_q4_1(out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random GGUF Q4_1 blocks ``[out, in / 32, 20]`` (d in [0.001, 0.02], m in [-0.1, 0] as float16,
    random nibbles): what the tests and ``bench/int8_product.py`` multiply."""
    rng = np.random.default_rng(seed)
    nb = in_features // BLOCK
    b = np.zeros((out_features, nb, Q4_1_BYTES), np.uint8)
    for k, (lo, hi) in ((0, (0.001, 0.02)), (2, (-0.1, 0.0))):          # d, then m
        half = rng.uniform(lo, hi, (out_features, nb)).astype(np.float16)
        b[..., k:k + 2] = half.view(np.uint8).reshape(out_features, nb, 2)
    b[..., 4:] = rng.integers(0, 256, (out_features, nb, 16), dtype=np.uint8)
    return b


def reference(x: torch.Tensor, blocks: np.ndarray, magnitudes: bool = False) -> torch.Tensor:
    """What the kernel computes, in float64 from the same rounding of ``x`` (``[rows, in]`` bfloat16):
    each block's ``d s (q . p) + m s sum(p)``, summed; float64 ``[rows, out]``. The tests' independent
    statement of ``int8_gemm.c``'s arithmetic. ``magnitudes``: the same sums of ``|p|`` and ``|m|``, the
    size of the terms the kernel's float32 sum rounds (where they cancel, its error is theirs)."""
    out, nb, _ = blocks.shape
    b = torch.from_numpy(blocks)
    d, m = (b[..., k:k + 2].contiguous().view(torch.float16).double()[..., 0] for k in (0, 2))   # [out, nb]
    q = torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], dim=2).double()                         # [out, nb, 32]
    xb = x.float().reshape(x.shape[0], nb, BLOCK)
    finite = torch.isfinite(xb).all(dim=2, keepdim=True)
    amax = torch.where(finite, xb.abs(), 0).amax(dim=2, keepdim=True)
    # 127 / max in one float32 division, as the kernel (torch's ``127.0 / t`` is 127 * (1 / t): two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    inv = torch.where(torch.isfinite(inv) & finite, inv, 0)     # a max under 127 / FLT_MAX: zeros
    p = torch.round(torch.where(finite, xb, 0) * inv).double()             # to nearest even
    if magnitudes:
        p, m = p.abs(), m.abs()
    s = torch.where(inv > 0, amax / 127.0, 0).double()
    s = torch.where(finite, s, torch.nan)[..., 0]               # [rows, nb]: an inf or NaN makes NaN
    dots = torch.einsum("onk,rnk->ron", q, p)
    return (dots * d * s[:, None] + m * (s * p.sum(dim=2))[:, None]).sum(dim=2)


def matmul(x: torch.Tensor, packed: torch.Tensor, in_features: int, out_features: int,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """bfloat16 ``x [rows, in_features]`` times the weight of the blocks ``pack`` made ``packed`` of, on
    int8 activations: bfloat16 ``[rows, out_features]``. Shapes that the C loop would read out of bounds
    are refused."""
    nb = in_features // BLOCK
    if (x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.bfloat16 or in_features % BLOCK
            or packed.dtype != torch.uint8 or not packed.is_contiguous()
            or packed.shape != (-(-out_features // PANEL_WIDTH), nb, BLOCK_BYTES)):
        raise ValueError(f"int8_gemm.matmul: x {x.dtype} {tuple(x.shape)} and a [{out_features}, "
                         f"{in_features}] weight do not fit panels {packed.dtype} {tuple(packed.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    if (lib or load()).minicb_int8_q4(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(),
                                      out_features, x.shape[0], in_features, out_features,
                                      torch.get_num_threads()):
        raise MemoryError("int8_gemm: no memory for the rounded activations")
    return y


def path(lib: ctypes.CDLL | None = None) -> int:
    """2: the build's AVX-512 VNNI loop; 1: its AVX2 loop (``vpmaddubsw``); 0: plain C."""
    return (lib or load()).minicb_int8_path()


def choose(settings: Settings | None = None) -> tuple[bool, str]:
    """``(on, why)``: whether a bfloat16 model from a Q4_1 GGUF gets these products
    (``MINICB_INT8_PRODUCTS=1`` and a CPU with AVX-512 VNNI or AVX2; the model's own checks are
    ``layer_stack``'s)."""
    env = (settings or Settings.from_env()).int8_products
    if env not in ("", "0", "1"):
        raise ValueError(f"MINICB_INT8_PRODUCTS must be 1 (on) or 0 (off), got {env!r}")
    if env != "1":
        return False, "MINICB_INT8_PRODUCTS is not 1"
    reason = ckernels.why_not(load)
    if reason is not None:
        return False, f"MINICB_INT8_PRODUCTS=1, but the int8 kernel is unavailable: {reason}"
    if path() == 0:
        return False, "MINICB_INT8_PRODUCTS=1, but this CPU has neither AVX-512 VNNI nor AVX2 (too slow)"
    return True, f"MINICB_INT8_PRODUCTS=1 ({PATH_NAMES[path()]})"
