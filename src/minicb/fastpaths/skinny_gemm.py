"""The linear layers of a step with few rows, on weights packed for reading them once (``skinny_gemm.c``).

A decode step of one to a few sequences is a few rows times every weight of the model: almost no
arithmetic, one pass over 270 MB (bfloat16) or 538 MB (float32) of weights. Its floor is the time to
read them (``bench/decode_floor.py``). oneDNN's packed products (``cpu_linear``) are built for many
rows; on a few they stream the weights at well under half of one core's read bandwidth. This is the
loop for the few-row case, beside oneDNN rather than instead of it::

    rows of the product <= skinny_rows   ->  skinny_gemm.matmul(x, panels)      (this module)
    more rows (prompt chunks, big steps) ->  oneDNN's _linear_pointwise         (cpu_linear)

``pack`` lays a weight ``[out, in]`` out as panels of 64 outputs, each stored input by input (bfloat16:
pairs of inputs side by side, for the CPU's ``vdpbf16ps``), so the kernel reads every panel as one
straight run of memory and never sums across a vector (``skinny_gemm.c`` draws the layout). The panels
are a second copy of each weight, beside oneDNN's: 270 MB more for SmolLM2 in bfloat16, 538 MB in
float32, the price of having the right layout for both kinds of step.

``choose_rows(dtype)`` decides at load, from the CPU's features: up to ``ROWS`` rows for the loops
measured against oneDNN (float32 up to 4,096 rows, prompt chunks included, on AVX2 and on AVX-512;
bfloat16 up to 4,096 on AVX-512 BF16 and up to 32 widened on AVX2), ``AMX_ROWS`` for bfloat16 on a CPU
with AMX (oneDNN's tile products), and none where the compiled kernel has no vector loop for the dtype
(oneDNN for every step). The loops
(``path``): float32 on AVX-512 or on AVX2 with FMA; bfloat16 on AVX-512 BF16's ``vdpbf16ps``, or, on a
CPU without it, widened to float32 in registers on AVX2 (the weights still read from memory as
bfloat16: half of float32's bytes, where oneDNN would multiply a copy widened to float32).
``MINICB_SKINNY_ROWS=N`` pins it (``0``: off), so that the kernel runs, and is tested, on any CPU with
a C compiler. The kernel is built on first use like the decode kernel (``ckernels``); where that
fails, nothing changes but one logged line.

Threads: a call splits the panels over ``torch.get_num_threads()`` threads once it reads 512 KiB of
weights; ``layer_stack.c`` calls the ``_part`` entry (one thread's share of the panels) from its own
threads instead. Each output is the same loop whichever thread runs it: the same bits on any count.

Numerics: float32 sums of the products in input order, rounded once to the output dtype; oneDNN sums
in another order, so the two agree to float32 rounding (bfloat16 outputs: to one bfloat16 rounding).

A bfloat16 model read from a GGUF has its weights in fewer bytes in the file: Q4_1 and Q8_0 blocks of
32 inputs. ``pack_blocks`` lays those out as panels too, and ``matmul_blocks`` (the C loop
``panel_blocks``) makes each bfloat16 weight from them in registers right before the same product:
the same bits as ``matmul`` on the bfloat16 panels, from 3/8 (Q4_1) or 9/16 (Q8_0) of the bytes, for
steps of one row (``choose_block_rows``; the layer stack and the LM head use them:
``LayerStack._add_blocks``).
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

SOURCE = Path(__file__).parent / "csrc" / "skinny_gemm.c"
DTYPES = {torch.float32: "minicb_skinny_f32", torch.bfloat16: "minicb_skinny_bf16"}
EXTRA_FLAGS: tuple[str, ...] = ()     # the default build: ckernels' flags alone
# Every vector loop's rows, as far as it was measured to beat oneDNN (bench/RESULTS.md). On a Zen 2
# core (AVX2): float32 is level with oneDNN or faster from 1 to 4,096 rows (1.1-1.2x at 384-4,096
# rows on a quiet host, level on a busy one; its tiles prefetch the next panel while they multiply),
# so it takes prompt chunks too;
# bfloat16 widened on AVX2 beats oneDNN's float32 products (from float32 copies) up to about 48 rows.
# On a Zen 4 core (AVX-512, AVX-512 BF16): both dtypes beat oneDNN at every row count measured, 1 to
# 1,024 (float32 1.2-2x up to 32 rows, bfloat16 1.2-2x up to 64, both level from 256 on).
ROWS = {(torch.float32, 1): 4096, (torch.bfloat16, 1): 32,          # (dtype, path): rows
        (torch.float32, 2): 4096, (torch.bfloat16, 2): 4096}
AMX_ROWS = 16              # bfloat16 on a CPU with AMX: oneDNN's tile products beyond (not measured here)
PATH_NAMES = {torch.float32: {2: "AVX-512", 1: "AVX2", 0: "plain C"},
              torch.bfloat16: {2: "AVX-512 BF16", 1: "AVX2, widened to float32", 0: "plain C"}}
PANEL_WIDTH = 64           # outputs per panel: TW in skinny_gemm.c (checked against it by the tests)
# A GGUF's blocks of 32 inputs, by their size in the file: (format, kernel, bytes of a panel's block)
BLOCK_KINDS = {20: ("Q4_1", "minicb_skinny_q4", 1536), 34: ("Q8_0", "minicb_skinny_q8", 2304)}
BLOCK_KERNELS = {size: kernel for _, kernel, size in BLOCK_KINDS.values()}   # by a panel's block bytes
# Decode steps of up to this many rows read a bfloat16 model's blocks where it has them and the CPU
# has AVX-512 BF16 (``choose_block_rows``). The layer stack's time a step from the blocks over its time
# from the bfloat16 panels (``python bench/decode_floor.py --block-rows 0,8 ...``, bench/RESULTS.md,
# Zen 4): one row 0.58x on 2 threads and 0.92x on 1; two to four rows 0.88-0.98x on 2 threads but
# 1.07-1.16x on 1, six 1.21x: past one row the blocks' arithmetic costs what their bytes save.
BLOCK_ROWS = 1


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled ``skinny_gemm.c`` (built on the first call); ``KernelUnavailable`` if it cannot be.
    ``extra_flags`` builds a variant: the tests build two, ``-mno-avx2`` for the plain C loops any x86
    CPU runs, and ``-mno-avx512f`` for the AVX2 loops (on a CPU with AVX2)."""
    lib = ckernels.open_library(ckernels.build(SOURCE, extra_flags=extra_flags), "the compiled skinny GEMM")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in (*DTYPES.values(), *(kind[1] for kind in BLOCK_KINDS.values())):   # + from GGUF blocks
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int], None
        part = getattr(lib, name + "_part")       # one thread's share of the panels (layer_stack.c)
        part.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
        part.restype = None
    lib.minicb_skinny_panel_width.argtypes, lib.minicb_skinny_panel_width.restype = [], ctypes.c_int
    lib.minicb_skinny_path.argtypes, lib.minicb_skinny_path.restype = [ctypes.c_int], ctypes.c_int
    return lib


def unavailable_reason() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    return ckernels.why_not(load)


def path(dtype: torch.dtype, lib: ctypes.CDLL | None = None) -> int:
    """Which loop the compiled kernel (or the variant ``lib``) runs for ``dtype`` on this CPU: 2 AVX-512
    (bfloat16: ``vdpbf16ps``), 1 AVX2 (bfloat16: widened to float32), 0 plain C (``PATH_NAMES``)."""
    return (lib or load()).minicb_skinny_path(int(dtype == torch.bfloat16))


@functools.cache
def _c_function(dtype: torch.dtype, part: bool = False):
    """The kernel for ``dtype``; ``part``: its entry for one share of the panels (``NAME_part``)."""
    return getattr(load(), DTYPES[dtype] + ("_part" if part else ""))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (float32 or bfloat16) as the kernel's panels: ``[panels, in, 64]`` in float32,
    ``[panels, in / 2, 64, 2]`` in bfloat16; outputs padded with zeros to a multiple of 64, and a
    bfloat16 weight's inputs to an even count. Contiguous, on huge pages where the OS allows them
    (``host_memory.on_huge_pages``)."""
    if weight.dtype not in DTYPES or weight.dim() != 2:
        raise ValueError(f"skinny_gemm.pack takes a 2-D float32 or bfloat16 weight, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    width = PANEL_WIDTH
    out_f, in_f = weight.shape
    pairs = weight.dtype == torch.bfloat16
    w = F.pad(weight.detach().cpu(), (0, in_f % 2 if pairs else 0, 0, (-out_f) % width))
    n_out, n_in = w.shape
    if pairs:
        panels = w.reshape(n_out // width, width, n_in // 2, 2).permute(0, 2, 1, 3)
    else:
        panels = w.reshape(n_out // width, width, n_in).permute(0, 2, 1)
    return host_memory.on_huge_pages(panels)      # every step streams them: 2 MiB pages where allowed


def unpack(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The weight ``[out_features, in_features]`` that ``pack`` made ``panels`` of, as a view (no copy)."""
    if panels.dim() == 4:                                  # bfloat16: [panels, in / 2, 64, 2]
        w = panels.permute(0, 2, 1, 3).reshape(-1, panels.shape[1] * 2)
    else:
        w = panels.permute(0, 2, 1).reshape(-1, panels.shape[1])
    return w[:out_features, :in_features]


def panels_shape(in_features: int, out_features: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape ``pack`` gives a ``[out_features, in_features]`` weight of ``dtype``."""
    panels = -(-out_features // PANEL_WIDTH)
    if dtype == torch.bfloat16:
        return (panels, -(-in_features // 2), PANEL_WIDTH, 2)
    return (panels, in_features, PANEL_WIDTH)


def matmul(x: torch.Tensor, panels: torch.Tensor, in_features: int, out_features: int,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x [rows, in_features] @ W.T`` from the panels ``pack`` made of ``W [out_features, in_features]``,
    in ``x``'s dtype (the panels' one). Whatever the C loop would read out of bounds is refused (a
    wrong shape, dtype or layout of either); the values are not checked. ``lib``: a variant from
    ``load(extra_flags)`` instead of the default build."""
    if (x.dim() != 2 or x.shape[1] != in_features or x.dtype != panels.dtype or x.dtype not in DTYPES
            or panels.shape != panels_shape(in_features, out_features, x.dtype)
            or not panels.is_contiguous()):
        raise ValueError(f"skinny_gemm.matmul: x {x.dtype} {tuple(x.shape)} and a [{out_features}, "
                         f"{in_features}] weight do not fit panels {panels.dtype} {tuple(panels.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    fn = _c_function(x.dtype) if lib is None else getattr(lib, DTYPES[x.dtype])
    fn(x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), out_features, x.shape[0], in_features,
       out_features, torch.get_num_threads())
    return y


def choose_rows(dtype: torch.dtype, settings: Settings | None = None) -> tuple[int, str]:
    """``(rows, why)``: the products of up to ``rows`` rows go to this kernel for a model of ``dtype``
    (0: none); module docstring. ``MINICB_SKINNY_ROWS`` pins it."""
    env = (settings or Settings.from_env()).skinny_rows
    if env:
        if not env.isdigit():
            raise ValueError(f"MINICB_SKINNY_ROWS must be a whole number of rows (0: off), got {env!r}")
        if int(env) and dtype in DTYPES and unavailable_reason() is not None:
            return 0, f"MINICB_SKINNY_ROWS={env}, but the kernel is unavailable: {unavailable_reason()}"
        return (int(env) if dtype in DTYPES else 0), f"MINICB_SKINNY_ROWS={env}"
    if dtype not in DTYPES:
        return 0, f"{dtype} has no skinny kernel"
    reason = unavailable_reason()
    if reason is not None:
        return 0, f"the skinny kernel is unavailable: {reason}"
    loop = path(dtype)
    if loop == 0:
        return 0, "its vector loops need AVX2 with FMA, which this CPU lacks"
    if dtype == torch.bfloat16 and "amx_bf16" in ckernels.cpu_flags():
        return AMX_ROWS, f"its {PATH_NAMES[dtype][loop]} path, AMX's tiles beyond {AMX_ROWS} rows"
    return ROWS[dtype, loop], f"its {PATH_NAMES[dtype][loop]} path"


# --------------------------------------------------------------------------------------------------
# The same products from a GGUF's blocks (Q4_1, Q8_0): skinny_gemm.c's panel_blocks draws the layout
# --------------------------------------------------------------------------------------------------

def _kind(blocks: np.ndarray) -> tuple[str, str, int]:
    if blocks.dtype != np.uint8 or blocks.ndim != 3 or blocks.shape[2] not in BLOCK_KINDS:
        raise ValueError(f"GGUF blocks are [out, in / 32, 20 (Q4_1) or 34 (Q8_0)] uint8, got {blocks.dtype} "
                         f"{blocks.shape}")
    return BLOCK_KINDS[blocks.shape[2]]


def blocks_weight(blocks: np.ndarray) -> torch.Tensor:
    """The bfloat16 weight ``[out, in]`` that GGUF ``blocks`` (``[out, in / 32, 20 or 34]`` bytes) stand
    for: ``d * q + m`` (Q4_1) or ``d * q`` (Q8_0) in float32 as the loader computes it
    (``gguf_loader.dequantize``), rounded by torch.

    The kernel rounds with ``vcvtne2ps2bf16``, which differs from torch only on subnormals (it makes
    them zero) and in a NaN's bits. A float16 ``d`` and ``m`` are multiples of 2^-24, so every weight
    is 0 or at least 2^-24, never subnormal; and a weight equal to a finite one (``panels_of_blocks``
    checks that the panels hold exactly this weight; the loader that every weight is finite) is no
    NaN."""
    _kind(blocks)
    b = torch.from_numpy(blocks)
    scale = b[..., 0:2].contiguous().view(torch.float16).float()
    if blocks.shape[2] == 34:                               # Q8_0: d, then 32 signed bytes
        return b[..., 2:].view(torch.int8).float().mul_(scale).flatten(1).to(torch.bfloat16)
    offset, qs = b[..., 2:4].contiguous().view(torch.float16).float(), b[..., 4:]
    return torch.cat([qs & 15, qs >> 4], dim=2).float().mul_(scale).add_(offset).flatten(1).to(torch.bfloat16)


def pack_blocks(blocks: np.ndarray) -> torch.Tensor:
    """GGUF ``blocks`` ``[out, in / 32, 20 or 34]`` (uint8: Q4_1's d, m as float16 and 16 bytes of
    nibbles; Q8_0's d and 32 signed bytes) as panel_blocks' panels, uint8 ``[panels, in / 32, 1536 or
    2304]``: outputs padded with zero blocks to a multiple of 64. Per panel and block, each vector's
    scales (float16, each output's twice: one per input of a pair), then the pairs: word t of vector
    v of pair j is output 16v + t // 2, input 2j + t % 2 of the block, from byte t % 16's low nibble
    (t < 16) or high one (Q4_1), or from byte t (Q8_0)."""
    kind = _kind(blocks)[0]
    out, nb, _ = blocks.shape
    panels = -(-out // PANEL_WIDTH)
    b = F.pad(torch.from_numpy(blocks), (0, 0, 0, 0, 0, panels * PANEL_WIDTH - out))   # zero blocks
    if kind == "Q8_0":
        # [panel, vector, output, block, pair, input of the pair] -> [panel, block, pair, vector, ...]
        pairs = b[..., 2:].reshape(panels, 4, 16, nb, 16, 2).permute(0, 3, 4, 1, 2, 5)
        pairs = pairs.reshape(panels, nb, 2048)
        scales = b[..., :2].reshape(panels, 4, 2, 8, nb, 1, 2)   # [panel, vector, half, output, block, d]
    else:
        qs = b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=2)          # [out, nb, 32]: the block's inputs in order
        q = q.reshape(panels, 4, 2, 8, nb, 16, 2).permute(0, 4, 5, 1, 2, 3, 6)   # [.., vector, half, ..]
        pairs = (q[:, :, :, :, 0] | q[:, :, :, :, 1] << 4).reshape(panels, nb, 1024)
        scales = b[..., :4].reshape(panels, 4, 2, 8, nb, 2, 2)   # [.., block, (d, m), float16 bytes]
    # [panel, block, vector, (d, m), half, output, bytes]: each output's scale (and offset) twice
    scales = scales.permute(0, 4, 1, 5, 2, 3, 6).repeat_interleave(2, dim=5).reshape(panels, nb, -1)
    return host_memory.on_huge_pages(torch.cat([scales, pairs], dim=2))


def panels_of_blocks(blocks: np.ndarray, panels: torch.Tensor, out_features: int, in_features: int
                     ) -> torch.Tensor | None:
    """``pack_blocks(blocks)`` if ``blocks`` stand for exactly the bfloat16 weight ``[out_features,
    in_features]`` whose skinny panels are ``panels`` (``blocks_weight``: the kernel then gives the
    same bits from either), else None."""
    if blocks.shape[:2] != (out_features, in_features // 32) or in_features % 32:
        return None
    weight = blocks_weight(blocks)
    return pack_blocks(blocks) if torch.equal(unpack(panels, out_features, in_features), weight) else None


def matmul_blocks(x: torch.Tensor, panels: torch.Tensor, in_features: int, out_features: int,
                  lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``matmul`` from ``pack_blocks``' panels: bfloat16 ``x [rows, in_features]`` times the weight the
    blocks stand for (``blocks_weight``), the same bits as ``matmul`` on that weight's bfloat16
    panels (the AVX-512 BF16 and the plain C loops)."""
    nb = in_features // 32
    if (x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.bfloat16 or in_features % 32
            or panels.dtype != torch.uint8 or not panels.is_contiguous() or panels.dim() != 3
            or panels.shape[:2] != (-(-out_features // PANEL_WIDTH), nb)
            or panels.shape[2] not in BLOCK_KERNELS):
        raise ValueError(f"skinny_gemm.matmul_blocks: x {x.dtype} {tuple(x.shape)} and a [{out_features}, "
                         f"{in_features}] weight do not fit panels {panels.dtype} {tuple(panels.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    fn = getattr(lib or load(), BLOCK_KERNELS[panels.shape[2]])
    fn(x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), out_features, x.shape[0], in_features,
       out_features, torch.get_num_threads())
    return y


def choose_block_rows(settings: Settings | None = None) -> tuple[int, str]:
    """``(rows, why)``: decode steps of up to ``rows`` rows read a bfloat16 model's GGUF blocks (0:
    never): ``BLOCK_ROWS``, or what ``MINICB_BLOCK_ROWS`` pins, where the kernel has its AVX-512 BF16
    loop; never elsewhere (the blocks' loop there is plain C, slower, and sums otherwise than the
    bfloat16 panels' AVX2 loop: the bits would depend on the step's rows)."""
    env = (settings or Settings.from_env()).block_rows
    if env and not env.isdigit():
        raise ValueError(f"MINICB_BLOCK_ROWS must be a whole number of rows (0: off), got {env!r}")
    if env == "0" or unavailable_reason() is not None or path(torch.bfloat16) != 2:
        # elsewhere the blocks' plain C loop would not give the bits of the panels' AVX2 loop
        return 0, "MINICB_BLOCK_ROWS=0" if env == "0" else "the blocks' loop needs AVX-512 BF16"
    return (int(env), f"MINICB_BLOCK_ROWS={env}") if env else (BLOCK_ROWS, "its AVX-512 BF16 path")
