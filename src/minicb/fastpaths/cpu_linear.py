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

**Every linear layer, packed once for oneDNN.** ``F.linear`` goes to MKL's sgemm, which copies the
weight into its own blocked panels on every call, and which takes slow paths on CPUs that are not
Intel's. vLLM's CPU build reorders every weight once at load for oneDNN
(``dispatch_cpu_unquantized_gemm``, ``onednn_mm``); ``PackedLinear`` does the same, through the torch
ops inductor uses when it freezes a CPU model::

    load:   packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)       # once: oneDNN's layout
    step:   y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

``pack_linears`` packs the whole model: the q, k and v projections as ONE matrix (their weights
stacked, one GEMM, its output split), the MLP's gate and up projections as one, o_proj, down_proj and
the LM head each as one. The packed copies are non-persistent buffers, and once they exist the
unpacked layer weights are dropped (``keep_unpacked=False``, the default): a step reads only the
packed copy, so keeping both would hold every weight twice (538 MB more for SmolLM2 in float32). What
stays is what something else still reads: the embedding, the norms, and a tied LM head's weight,
which *is* the embedding matrix (``lm_head.weight is embed_tokens.weight``: the token lookup needs it,
so only the head's packed copy is extra, 113 MB in float32, 57 MB in bfloat16). The packed model's
``state_dict`` then lacks the layers' projections; ``keep_unpacked=True`` keeps them (and the old
``state_dict``), and the reference path (``torch``) packs nothing, so it keeps every weight it reads.

**Which GEMM: the paths.** ``choose_path`` picks one per model dtype at load, ``LLM`` logs one line
saying which and why, and ``MINICB_LINEAR`` pins it, so every path runs (and is tested) on any CPU:
correctness everywhere, speed where the hardware has it.

- ``torch``: ``F.linear`` on the weights as they are, the reference (what the tutorials read).
- ``mkl``: MKL's float32 ``F.linear`` for the layers (a bfloat16 layer through ``Float32ComputeLinear``)
  and the LM head alone packed in float32: what minicb did before, and the fallback.
- ``onednn-f32``: every layer packed, float32 products (a bfloat16 model widens the input and rounds
  the output back).
- ``onednn-bf16``: every layer packed in bfloat16, on the CPU's bfloat16 dot-product instructions
  (AVX-512 BF16, AMX) where it has them (oneDNN emulates them elsewhere, slowly); a float32 model keeps
  float32 products (``onednn-f32``).

``auto`` (the default): a bfloat16 model on a CPU whose oneDNN multiplies bfloat16 natively
(``fast_bf16_matmul``) gets ``onednn-bf16``; otherwise a micro-check (``onednn_speedup``) times one
layer-shaped float32 product (16 rows, the model's q/k/v shape) through MKL and packed oneDNN,
alternately, and keeps oneDNN only if it is at least ``ONEDNN_MARGIN`` faster; where the skinny
kernel has a vector loop for the dtype (``skinny_gemm.choose_rows``), which only the packed paths bring
(steps of few rows, and on AVX2 float32 up to 4,096), oneDNN need only be no more than that much slower
(a near tie, as on a Zen 2 core, where the check read 1.0-1.5x from one load to the next, goes to the
packed path and its kernel, 1.1-1.7x MKL's products from memory there). On the AMD EPYC of
``bench/RESULTS.md`` (avx512_bf16) packed oneDNN was 1.5-3x MKL in float32 (W2: 1.5-1.6x per CPU
second) and packed bfloat16 1.1-1.2x torch's own unpacked bfloat16 on W2; on the AVX2-only machine of
its earlier sections MKL's float32 was faster than packed oneDNN for the layers' matrices above a
handful of rows. float64 has no oneDNN GEMM and keeps ``F.linear``; ``MINICB_PACKED_LM_HEAD=0`` (the
older switch) means no packing at all.

Numerics: every path sums bfloat16 or float32 products in float32, each library in its own order, so
the paths agree to float32 rounding (float32 models) or to one bfloat16 rounding of each output
(bfloat16 models), not bit for bit.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from minicb.fastpaths import cpu_fused, int8_gemm, skinny_gemm
from minicb.fastpaths.ckernels import cpu_flags
from minicb.fastpaths.settings import Settings


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


def no_bf16_packing_reason() -> str | None:
    """Why oneDNN cannot pack a bfloat16 weight on this CPU (None: it can). oneDNN's bfloat16 products
    need AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on a CPU without them (AMD's Zen 1-3, Intel before
    Skylake-X) a bfloat16 layer is computed in float32 (``onednn-f32``, ``mkl``)."""
    if fast_bf16_matmul():
        return None
    flags = " ".join(cpu_flags()) or "none"
    return (f"oneDNN has no bfloat16 products on this CPU (flags: {flags}; they need AVX-512 BW/VL/DQ or "
            "AVX-NE-CONVERT): its bfloat16 layers are computed in float32 (onednn-f32 or mkl)")


def _pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight [out, in]`` in ``dtype``, reordered once into oneDNN's blocked layout."""
    if dtype == torch.bfloat16 and (reason := no_bf16_packing_reason()):
        raise ValueError(f"cannot pack a bfloat16 weight: {reason}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), 64)


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, dtype: torch.dtype):
    """``x @ W.T`` with oneDNN's packed ``W``, computed in ``dtype``, returned in ``x``'s dtype."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.dtype != dtype:                    # each skipped no-op is a dispatch saved, 200 calls a step
        flat = flat.to(dtype)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], out_features)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _compute_dtype(weight: torch.Tensor, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a packed product runs in: bfloat16 only for a bfloat16 weight that asks for it."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("oneDNN packing takes float32 or bfloat16 CPU layers, got "
                         f"{weight.dtype} on {weight.device.type}")
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"a packed product is computed in float32 or bfloat16, not {compute_dtype}")
    return torch.bfloat16 if weight.dtype == compute_dtype == torch.bfloat16 else torch.float32


class Int8Products:
    """Mixed into the packed layers: once ``read_int8`` gave them panels of the GGUF's Q4_1 blocks
    (``int8_gemm.pack``, ``MINICB_INT8_PRODUCTS=1``), every product of theirs is on int8-rounded
    activations, whatever its rows, so that a sequence's steps get one arithmetic whether the layer
    stack runs them or the layers do. The panels are dropped (bfloat16 products again) when the
    layer's own skinny panels were replaced after they were read: they would be the old weight's."""

    int8_panels = None

    def read_int8(self, panels: torch.Tensor | None) -> None:
        self.int8_panels, self._int8_of = panels, self.weight_panels.data_ptr()

    def _int8(self, x: torch.Tensor) -> torch.Tensor | None:
        """The product on the int8 panels (``forward`` asks only when it has them), or None."""
        if x.dim() != 2:
            return None
        if self.weight_panels.data_ptr() != self._int8_of:        # a weight replaced: stale panels
            self.int8_panels = None
            return None
        return int8_gemm.matmul(x, self.int8_panels, self.in_features, self.out_features)


class PackedLinear(Int8Products, nn.Module):
    """An ``nn.Linear`` (no bias) computed by oneDNN from a weight it reordered once (module docstring).

    ``weight`` stays the original parameter only with ``keep_weight`` (``pack_linears`` keeps it for
    a tied LM head, whose weight is the embedding); ``weight_packed`` is oneDNN's copy in
    ``compute_dtype``: float32 (a bfloat16 layer's input is widened and its output rounded back, as
    ``Float32ComputeLinear`` does), or bfloat16 for a bfloat16 layer on the CPU's bfloat16
    instructions (a float32 layer always keeps float32 products)."""

    block_rows = 0          # products of up to so many rows from the GGUF's blocks (``read_blocks``)

    def __init__(self, linear: nn.Module, compute_dtype: torch.dtype = torch.float32,
                 keep_weight: bool = True, skinny_rows: int = 0) -> None:
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("PackedLinear takes linear layers without bias (LLaMA has none)")
        self.compute_dtype = _compute_dtype(linear.weight, compute_dtype)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if keep_weight:                  # else the packed copy is the only one (pack_linears drops it)
            self.weight = linear.weight
        w = getattr(linear, "weight_f32", None)          # a Float32ComputeLinear's copy, if any
        w = linear.weight if w is None or self.compute_dtype != torch.float32 else w
        self.register_buffer("weight_packed", _pack(w, self.compute_dtype), persistent=False)
        _add_panels(self, w, linear.weight.dtype, skinny_rows)

    def read_blocks(self, panels: torch.Tensor, rows: int) -> None:
        """Products of up to ``rows`` rows from ``panels``: ``skinny_gemm.panels_of_blocks`` of the GGUF
        blocks that stand for this layer's weight (the same bits as its skinny panels)."""
        self.block_panels, self.block_rows = panels, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_panels is not None and (y := self._int8(x)) is not None:   # MINICB_INT8_PRODUCTS=1
            return y
        if 0 < x.shape[0] <= self.block_rows and x.dim() == 2:  # the GGUF's blocks: the same bits
            return skinny_gemm.matmul_blocks(x, self.block_panels, self.in_features, self.out_features)
        if self.skinny_rows and x.shape[0] <= self.skinny_rows and x.dim() == 2:
            return skinny_gemm.matmul(x, self.weight_panels, self.in_features, self.out_features)
        return _packed_matmul(x, self.weight_packed, self.out_features, self.compute_dtype)


class PackedProjections(Int8Products, nn.Module):
    """Linear layers that read the same input (q, k, v; gate, up) as ONE packed product: their weights
    stacked ``[sum(sizes), in]``, so one GEMM streams the input once. ``forward`` returns the stacked
    output ``[..., sum(sizes)]``; ``sizes`` says where to split it. It holds no parameter (the layers keep
    theirs, until ``pack_linears`` drops them)."""

    def __init__(self, linears: list[nn.Module], compute_dtype: torch.dtype = torch.float32,
                 skinny_rows: int = 0) -> None:
        super().__init__()
        if any(getattr(lin, "bias", None) is not None for lin in linears):
            raise ValueError("PackedProjections takes linear layers without bias (LLaMA has none)")
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError("PackedProjections stacks layers of one input size")
        self.compute_dtype = _compute_dtype(linears[0].weight, compute_dtype)
        self.in_features = linears[0].in_features
        self.sizes = [lin.out_features for lin in linears]
        stacked = torch.cat([lin.weight.detach().to(self.compute_dtype) for lin in linears])
        self.register_buffer("weight_packed", _pack(stacked, self.compute_dtype), persistent=False)
        self.out_features = sum(self.sizes)
        _add_panels(self, stacked, linears[0].weight.dtype, skinny_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_panels is not None and (y := self._int8(x)) is not None:   # MINICB_INT8_PRODUCTS=1
            return y
        if self.skinny_rows and x.shape[0] <= self.skinny_rows and x.dim() == 2:
            return skinny_gemm.matmul(x, self.weight_panels, self.in_features, self.out_features)
        return _packed_matmul(x, self.weight_packed, self.out_features, self.compute_dtype)


def _add_panels(layer: nn.Module, weight: torch.Tensor, input_dtype: torch.dtype, skinny_rows: int) -> None:
    """Give a packed ``layer`` the skinny kernel's panels of ``weight`` for products of up to
    ``skinny_rows`` rows (``skinny_gemm``), in the layer's own dtype ``input_dtype``: a bfloat16 layer
    that oneDNN computes in float32 gets bfloat16 panels (its weights, exactly), since the kernel sums
    in float32 whatever it reads and rounds once, as the float32 product does."""
    layer.skinny_rows = 0
    if skinny_rows > 0 and input_dtype in skinny_gemm.DTYPES:
        layer.register_buffer("weight_panels", skinny_gemm.pack(weight.detach().to(input_dtype)),
                              persistent=False)
        layer.skinny_rows = skinny_rows


class PackedQKV:
    """Mixed into a ``LlamaAttention`` (or ``FusedAttention``): q, k and v from one packed product."""

    def project(self, x):
        # views into the product's rows, no copies: the C rotary (cpu_fused.rope_) rotates q and k
        # in place there, the reference one makes new tensors, and v is only copied into the cache
        # (and gathered for a prompt chunk), which read a strided view as well
        return self.qkv_packed(x).split(self.qkv_packed.sizes, dim=-1)


class PackedGateUp:
    """Mixed into a ``LlamaMLP`` (or ``FusedMLP``): gate and up from one packed product, SiLU and the
    product in place on the gate's half (what ``FusedMLP`` computes)."""

    def forward(self, x):
        gate_up = self.gate_up_packed(x)
        if isinstance(self, cpu_fused.FusedMLP):       # SiLU and product in one C pass
            return self.down_proj(cpu_fused.silu_mul(gate_up, self.gate_up_packed.sizes[0]))
        g, u = gate_up.split(self.gate_up_packed.sizes, dim=-1)
        return self.down_proj(F.silu(g, inplace=True).mul_(u))      # in the product's own buffer


@functools.cache
def _packed_class(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s methods first: the module keeps its other behaviour (fused rotary, ...)."""
    return type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})


def pack_linears(model: nn.Module, compute_dtype: torch.dtype = torch.float32,
                 keep_unpacked: bool = False, skinny_rows: int = 0) -> int:
    """Pack every linear layer of a float32 or bfloat16 LLaMA for oneDNN, in place: q/k/v as one
    product, gate/up as one, o_proj, down_proj and the LM head each as one (module docstring). Returns
    how many products were packed (0 the second time: idempotent). Unless ``keep_unpacked``, each
    layer's unpacked weight is dropped as soon as its packed copy exists (the q/k/v and gate/up
    ``nn.Linear`` modules are removed; a tied LM head keeps the embedding it shares), so the weights
    are never all held twice. Call it after ``cpu_fused.fuse_elementwise``, which recognises the
    modules by their class. ``skinny_rows`` > 0 also gives every product the skinny kernel's panels,
    for steps of up to that many rows (``skinny_gemm``)."""
    from minicb.model.llama import LlamaAttention, LlamaMLP

    if not can_pack():
        raise RuntimeError("this torch has no oneDNN packed linear ops (torch.ops.mkldnn)")
    keep, count = keep_unpacked, 0
    for m in list(model.modules()):
        if isinstance(m, LlamaAttention) and not isinstance(m, PackedQKV):
            m.qkv_packed = PackedProjections([m.q_proj, m.k_proj, m.v_proj], compute_dtype, skinny_rows)
            m.o_proj = PackedLinear(m.o_proj, compute_dtype, keep_weight=keep, skinny_rows=skinny_rows)
            if not keep:
                del m.q_proj, m.k_proj, m.v_proj
            m.__class__ = _packed_class(PackedQKV, type(m))
            count += 2
        elif isinstance(m, LlamaMLP) and not isinstance(m, PackedGateUp):
            m.gate_up_packed = PackedProjections([m.gate_proj, m.up_proj], compute_dtype, skinny_rows)
            m.down_proj = PackedLinear(m.down_proj, compute_dtype, keep_weight=keep, skinny_rows=skinny_rows)
            if not keep:
                del m.gate_proj, m.up_proj
            m.__class__ = _packed_class(PackedGateUp, type(m))
            count += 2
    head = getattr(model, "lm_head", None)
    if head is not None and not isinstance(head, PackedLinear):
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = embed is not None and head.weight is embed.weight       # the lookup still reads it
        model.lm_head = PackedLinear(head, compute_dtype, keep_weight=keep or tied, skinny_rows=skinny_rows)
        count += 1
    if count and not keep:
        return_freed_memory()
    return count


def return_freed_memory() -> None:
    """Hand the memory of freed tensors back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Needed after dropping the unpacked weights: glibc serves large blocks from its heap
    once a large block has been freed (its mmap threshold grows), and a free block in the middle of
    the heap stays resident until trimmed: SmolLM2 float32 measured 1,380 MiB resident with the
    weights dropped, 933 MiB after the trim (``bench/linear_paths.py --memory``)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def packed_lm_head_enabled(settings: Settings | None = None) -> bool:
    """False when ``MINICB_PACKED_LM_HEAD=0`` asks for ``F.linear`` (no packing at all)."""
    return (settings or Settings.from_env()).packed_lm_head


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


# --- choosing the path at load -----------------------------------------------------------------------

PATHS = ("torch", "mkl", "onednn-f32", "onednn-bf16")
ONEDNN_MARGIN = 1.1        # the micro-check keeps MKL unless packed oneDNN is at least this much faster


@functools.cache
def onednn_speedup(in_features: int, out_features: int, rows: int = 16, rounds: int = 15) -> float:
    """The micro-check: MKL ``F.linear`` time over packed oneDNN time for one float32 ``[rows, in] x
    [in, out]`` product, the median of ``rounds`` alternating pairs (a loaded machine slows both)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g)
    packed = _pack(w, torch.float32)
    paths = (lambda: F.linear(x, w), lambda: _packed_matmul(x, packed, out_features, torch.float32))
    for run in paths:
        run()
    ratios = []
    for _ in range(rounds):
        t = []
        for run in paths:
            t0 = time.perf_counter()
            for _ in range(3):
                run()
            t.append(time.perf_counter() - t0)
        ratios.append(t[0] / t[1])
    return sorted(ratios)[len(ratios) // 2]


def choose_path(dtype: torch.dtype, in_features: int = 576, out_features: int = 960,
                settings: Settings | None = None) -> tuple[str, str]:
    """``(path, why)`` for a model of ``dtype`` whose q/k/v product is ``[in, out]`` (module docstring)."""
    settings = settings or Settings.from_env()
    env = settings.linear
    if env not in (*PATHS, "auto"):
        raise ValueError(f"MINICB_LINEAR must be one of auto, {', '.join(PATHS)}; got {env!r}")
    if dtype not in (torch.float32, torch.bfloat16):
        return "torch", f"{dtype} has no oneDNN GEMM"
    if env == "onednn-bf16" and dtype == torch.bfloat16 and (reason := no_bf16_packing_reason()):
        raise ValueError(f"MINICB_LINEAR=onednn-bf16: {reason}")
    if env != "auto":
        return env, f"MINICB_LINEAR={env}"
    if not settings.packed_lm_head:
        return "mkl", "MINICB_PACKED_LM_HEAD=0 (no packing)"
    if not can_pack():
        return "mkl", "this torch has no oneDNN packed linear ops"
    flags = " ".join(cpu_flags()) or "none"
    if dtype == torch.bfloat16 and fast_bf16_matmul():
        return "onednn-bf16", f"oneDNN multiplies bfloat16 natively on this CPU (flags: {flags})"
    ratio = onednn_speedup(in_features, out_features)
    shape = f"16x{in_features}x{out_features} float32 product (flags: {flags})"
    skinny = skinny_gemm.choose_rows(dtype, settings)[0] > 0   # only the packed paths bring the skinny one
    margin = 1 / ONEDNN_MARGIN if skinny else ONEDNN_MARGIN
    if ratio >= margin:
        return "onednn-f32", f"packed oneDNN {ratio:.2f}x MKL on a {shape}"
    return "mkl", (f"packed oneDNN only {ratio:.2f}x MKL on a {shape}, below the {margin:.2f}x asked"
                   + (" even with the skinny kernel beside it" if skinny else ""))


def apply_path(model: nn.Module, path: str, keep_unpacked: bool = False, skinny_rows: int = 0) -> list[str]:
    """Put ``model``'s linear layers on ``path``, in place; the names of what was applied. The packed
    paths drop the unpacked layer weights unless ``keep_unpacked`` (``pack_linears``), and send products
    of up to ``skinny_rows`` rows to the skinny kernel (``skinny_gemm``; the other paths ignore it)."""
    if path not in PATHS:
        raise ValueError(f"unknown linear path {path!r}; one of {', '.join(PATHS)}")
    dtype = next(model.parameters()).dtype
    if path == "torch" or dtype not in (torch.float32, torch.bfloat16):
        return []
    if path == "mkl":
        applied = ["float32-linears"] if dtype == torch.bfloat16 and compute_linears_in_float32(model) else []
        return applied + (["packed-lm-head"] if pack_lm_head(model) else [])
    compute = torch.bfloat16 if path == "onednn-bf16" and dtype == torch.bfloat16 else torch.float32
    pack_linears(model, compute, keep_unpacked, skinny_rows)
    applied = ["packed-linears-bf16" if compute == torch.bfloat16 else "packed-linears-f32"]
    rows = skinny_rows_of(model)
    return applied + ([f"skinny-gemm-{rows}-rows"] if rows else [])


def skinny_rows_of(model: nn.Module) -> int:
    """Up to how many rows ``model``'s products go to the skinny kernel (0: never)."""
    return max((getattr(m, "skinny_rows", 0) for m in model.modules()
                if isinstance(m, (PackedLinear, PackedProjections))), default=0)


def linear_path(model: nn.Module) -> str:
    """Which path ``model``'s linear layers are on now (what ``apply_path`` left)."""
    head = getattr(model, "lm_head", None)
    mlps = [m for m in model.modules() if isinstance(m, PackedGateUp)]
    if mlps:
        return "onednn-bf16" if mlps[0].gate_up_packed.compute_dtype == torch.bfloat16 else "onednn-f32"
    if isinstance(head, PackedLinear) or any(isinstance(m, Float32ComputeLinear) for m in model.modules()):
        return "mkl"
    return "torch"
