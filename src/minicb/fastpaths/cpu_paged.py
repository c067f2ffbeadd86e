"""``cpu-paged``: the reference backend with its decode attention done by a small C kernel.

Why a kernel at all, in a pure-PyTorch project? Decode attention is the one part of a step that
PyTorch cannot express without a copy. A decode row's keys sit in blocks scattered over the cache
pool; PyTorch's attention wants them in one tensor, so the reference backend gathers them
(``index_select``) into a padded ``[rows, max_len, kv_heads, head_dim]`` tensor and runs SDPA over it.
The keys cross memory three times, every row is padded to its bucket's longest, and decode attention
does too little arithmetic per byte for anything but those trips to matter. vLLM's answer is its
PagedAttention kernel, which reads the keys *in place* through the block table; ``paged_decode.c``
beside this file is that kernel for the CPU, about 150 lines of C. On the W2 benchmark it did in
5.0 s what took the reference backend about 9 s, lifting continuous over static from 2.36x to 2.54x
(``bench/RESULTS.md``, "Engine throughput"); its third version takes 4.2-4.4 s ("What moved the
figure").

This module compiles it on first use with the machine's C compiler (``$CC`` or ``cc``; about a
second), caches the shared library under ``~/.cache/minicb`` (``$MINICB_CACHE_DIR`` overrides; the
machinery is ``minicb.fastpaths.ckernels``), and calls it through ``ctypes``: no build step at install
time, no new dependency. ``CpuPagedAttention``
is ``ReferenceAttention`` with one change: the decode rows of a step go to the kernel in one call per
layer, unpadded and unbucketed; prompt chunks and padding rows still go through SDPA exactly as in
the reference backend, except where ``prompts_on_kernel`` sends prompt chunks to the prompt kernel
beside it, ``paged_prompt.c``: a chunk's tokens in tiles of 16 (SmolLM2's 3 query heads a kv head),
each tile reading its sequence's keys in place once per kv head, FlashAttention's online softmax
(that file's header draws it). ``auto`` picks
this backend on the CPU; where no C compiler works, ``auto`` falls back to ``reference`` with one
logged line, and asking for ``cpu-paged`` by name fails with the compiler's reason
(``backends/__init__.py``).

Dtypes: float32 and float64 are computed in their own precision; bfloat16 K/V and queries are widened
to float32 as they are read, and the output rounded back once (``paged_decode.c``), so a bfloat16
cache costs half the memory traffic of a float32 one and loses nothing more in the arithmetic. On a
CPU with AVX-512 BF16 the scores' dot products use its bfloat16 instruction on the stored values
instead (``bf16_native()``; exact products summed in float32, as before): for head_dim 64 in the
kernel's AVX-512 row (``avx512_path()``), which reads each key and value once per kv head and is
1.4x the AVX2 row from memory on a Zen 4 core (0.77 against 1.09 ms a W2-sized step in bfloat16,
``bench/decode_kernel.py``); on a CPU with AVX2 but no AVX-512, head_dim 64 takes the AVX2 row
(widening). ``MINICB_BF16_DECODE=widen`` keeps the widening kernel everywhere, so both run and are
tested on such a CPU.

The kernel computes the same softmax as SDPA in a different order of additions, so its outputs match
the reference backend's to rounding (``tests/model/test_cpu_paged.py`` checks both, and token-exactness
against the padded baseline in float64).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from minicb.fastpaths import ckernels
from minicb.fastpaths.ckernels import KernelUnavailable, cache_dir, compiler  # noqa: F401  (this module's API)
from minicb.fastpaths.settings import Settings
from minicb.model.attention import AttentionMetadata, ReferenceAttention, _RefState, write_mask

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
PROMPT_SOURCE = Path(__file__).parent / "csrc" / "paged_prompt.c"
DTYPES = {torch.float32: "minicb_paged_decode_f32", torch.float64: "minicb_paged_decode_f64",
          torch.bfloat16: "minicb_paged_decode_bf16"}     # bfloat16: stored so, computed in float32
WIDEN_BF16 = "minicb_paged_decode_bf16_widen"             # bfloat16 widened element by element, always
PROMPT_DTYPES = {torch.float32: "minicb_paged_prompt_f32", torch.float64: "minicb_paged_prompt_f64",
                 torch.bfloat16: "minicb_paged_prompt_bf16"}
PROMPT_WIDEN_BF16 = "minicb_paged_prompt_bf16_widen"
# Multiply-adds fused into one instruction (an FMA, rounded once): ISO C (-std=c11) leaves them apart,
# and the dot products and the weighted sum of values are nothing but multiply-adds. No trapping math:
# the kernel never reads floating-point exception flags, and without the flag GCC keeps the clamp in
# exp_f32 as a branch and the softmax's exp loop one number at a time (torch builds with it too).
EXTRA_FLAGS = ("-ffp-contract=fast", "-fno-trapping-math")


def build(cc: list[str] | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile ``paged_decode.c`` into the kernel cache (``ckernels.build``); the library's path."""
    return ckernels.build(SOURCE, cc, extra_flags=(*EXTRA_FLAGS, *extra_flags))


@functools.lru_cache(maxsize=4)
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled kernel library (built on the first call); ``KernelUnavailable`` if it cannot be.
    ``extra_flags`` builds a variant: ``("-DDECODE_AVX2=0",)`` leaves out the AVX2 path (the tests run
    both)."""
    lib = ckernels.open_library(build(extra_flags=extra_flags), "the compiled kernel")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in (*DTYPES.values(), WIDEN_BF16):
        fn = getattr(lib, name)
        fn.argtypes = [ptr] * 6 + [i64] * 7 + [ctypes.c_double, ctypes.c_int]
        fn.restype = ctypes.c_int
    for name in ("minicb_paged_decode_bf16_native", "minicb_paged_decode_avx2", "minicb_paged_decode_avx512"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int
    return lib


@functools.lru_cache(maxsize=4)
def load_prompt(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled prompt kernel, ``paged_prompt.c`` (built on the first call, with the decode kernel's
    flags); ``("-mno-avx512f",)`` builds it without its AVX-512 loops (the tests run both)."""
    path = ckernels.build(PROMPT_SOURCE, extra_flags=(*EXTRA_FLAGS, *extra_flags))
    lib = ckernels.open_library(path, "the compiled prompt kernel")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in (*PROMPT_DTYPES.values(), PROMPT_WIDEN_BF16):
        fn = getattr(lib, name)
        fn.argtypes = [ptr] * 5 + [i64, ptr] + [i64] * 5 + [ctypes.c_double, ctypes.c_int, i64]
        fn.restype = ctypes.c_int
    for name in ("minicb_paged_prompt_lanes", "minicb_paged_prompt_avx512"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int
    return lib


def bf16_native() -> bool:
    """Whether the compiled bfloat16 kernel uses the CPU's bfloat16 dot-product instructions: in the
    portable loops (every head size but 64 where the CPU has AVX2), and in the AVX-512 row (64)."""
    return bool(load().minicb_paged_decode_bf16_native())


def avx2_path() -> bool:
    """Whether the compiled kernel has its AVX2 path (``head_dim`` 64 on a CPU with AVX2 and FMA)."""
    return bool(load().minicb_paged_decode_avx2())


def avx512_path() -> bool:
    """Whether that path runs its AVX-512 row (a CPU with AVX-512: each key and value read once per kv
    head, 16 keys at a time; bfloat16 scores on ``vdpbf16ps`` where the CPU has AVX-512 BF16)."""
    return bool(load().minicb_paged_decode_avx512())


def kernel_name(dtype: torch.dtype, settings: Settings | None = None, prompt: bool = False) -> str:
    """The C function for ``dtype`` (``prompt``: of the prompt kernel): ``MINICB_BF16_DECODE=widen``
    picks the widening bfloat16 one."""
    if dtype == torch.bfloat16 and (settings or Settings.from_env()).bf16_decode == "widen":
        return PROMPT_WIDEN_BF16 if prompt else WIDEN_BF16
    return (PROMPT_DTYPES if prompt else DTYPES)[dtype]


def unavailable_reason() -> str | None:
    """None when the kernel builds and loads here, else why not (a success is cached by ``load``; a
    failure is tried again on the next call)."""
    return ckernels.why_not(load)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, max_context: int | None = None,
                 scale: float | None = None) -> torch.Tensor:
    """Decode attention read in place from one layer's paged cache.

    q ``[rows, q_heads, head_dim]``; k_cache / v_cache ``[slots, kv_heads, head_dim]`` (one layer, as
    ``KVCache.layer`` returns them); block_tables int32 ``[rows, max_blocks]``; context_lens int32
    ``[rows]``, each at least 1. Returns ``[rows, q_heads, head_dim]``, what SDPA over each row's first
    ``context_lens`` keys returns (scale ``1 / sqrt(head_dim)`` unless given).
    """
    max_context = check_decode_args(q, k_cache, v_cache, block_tables, context_lens, block_size, max_context)
    out = torch.empty_like(q)
    if q.shape[0]:
        decode_into(out, q, k_cache, v_cache, block_tables, context_lens, block_size, max_context, scale)
    return out


def check_decode_args(q, k_cache, v_cache, block_tables, context_lens, block_size: int,
                      max_context: int | None) -> int:
    """Refuse what the C kernel would read or write out of bounds (it checks nothing itself); returns
    ``max_context`` (the longest context when not given). A few host syncs: the backend checks a step's
    tables once, not once per layer."""
    _check_tensors("paged_decode", q, k_cache, v_cache, block_tables, context_lens, names="block_tables and "
                   "context_lens")
    rows = q.shape[0]
    if block_tables.shape[0] != rows or context_lens.shape != (rows,):
        raise ValueError(f"paged_decode: inconsistent shapes q {tuple(q.shape)}, block_tables "
                         f"{tuple(block_tables.shape)}, context_lens {tuple(context_lens.shape)}")
    if rows == 0:
        return max_context or 0
    longest = int(context_lens.max())
    max_context = longest if max_context is None else max_context
    if longest > max_context:
        raise ValueError(f"max_context={max_context} is below the longest context ({longest})")
    _check_fits(max_context, block_tables, block_size, k_cache)
    return max_context


def _check_tensors(what: str, q, k_cache, v_cache, *ints, names: str) -> None:
    """What both kernels ask of their tensors: one dtype they take, contiguous CPU, int32 tables."""
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{what} takes float32, float64 or bfloat16 q / k_cache / v_cache of one dtype,"
                         f" got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in (q, k_cache, v_cache, *ints)):
        raise ValueError(f"{what} takes contiguous CPU tensors")
    if any(t.dtype != torch.int32 for t in ints):
        raise ValueError(f"{names} must be int32")
    if (k_cache.shape != v_cache.shape or k_cache.shape[2] != q.shape[2] or q.shape[1] % k_cache.shape[1]):
        raise ValueError(f"{what}: inconsistent shapes q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")


def _check_fits(keys: int, block_tables, block_size: int, k_cache) -> None:
    """``keys`` keys fit the tables' width, and the tables name blocks of the cache."""
    if keys > block_tables.shape[1] * block_size:
        raise ValueError(f"a context of {keys} keys does not fit {block_tables.shape[1]} blocks "
                         f"of {block_size}")
    num_blocks = k_cache.shape[0] // block_size
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks):
        raise ValueError(f"block_tables name blocks outside the cache's {num_blocks}")


def decode_into(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, max_context: int,
                scale: float | None = None, kernel=None) -> None:
    """``paged_decode`` into ``out`` (contiguous, like ``q``) with arguments ``check_decode_args`` has
    passed: no checks here, one C call (``kernel``: the C function, when the caller looked it up)."""
    rows, q_heads, head_dim = q.shape
    scale = head_dim ** -0.5 if scale is None else scale
    kernel = getattr(load(), kernel_name(q.dtype)) if kernel is None else kernel
    failed = kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), rows, q_heads, k_cache.shape[1], head_dim,
        block_tables.shape[1], block_size, max_context, scale, torch.get_num_threads())
    if failed:
        raise MemoryError("paged_decode could not allocate its score buffer")


def tile_rows(q_heads: int, kv_heads: int) -> int:
    """Prompt tokens per tile: as many as fill the kernel's lanes with their query heads of one kv head
    (SmolLM2, 3 query heads a kv head: 16 tokens, 48 lanes)."""
    return max(1, load_prompt().minicb_paged_prompt_lanes() // (q_heads // kv_heads))


def prompt_tiles(firsts, q_lens, starts, rows_per_tile: int, seqs=None) -> torch.Tensor:
    """int32 ``[n, 4]``: the tiles of prompt chunks, (first row, rows, position of the first row,
    sequence). Chunk i is ``q_lens[i]`` rows from row ``firsts[i]``, at positions from ``starts[i]``,
    of sequence ``seqs[i]`` (default i) of the block tables; each is cut into tiles of
    ``rows_per_tile`` rows, the last one shorter."""
    seqs = range(len(q_lens)) if seqs is None else seqs
    tiles = [(f + a, min(rows_per_tile, n - a), s + a, i) for f, n, s, i in zip(firsts, q_lens, starts, seqs)
             for a in range(0, n, rows_per_tile)]
    return torch.tensor(tiles, dtype=torch.int32).view(-1, 4)


def check_prompt_args(q, k_cache, v_cache, block_tables, tiles, block_size: int) -> None:
    """Refuse what ``paged_prompt.c`` would read or write out of bounds (it checks nothing itself)."""
    _check_tensors("paged_prompt", q, k_cache, v_cache, block_tables, tiles, names="block_tables and tiles")
    if tiles.dim() != 2 or tiles.shape[1] != 4:
        raise ValueError(f"tiles must be [n, 4], got {tuple(tiles.shape)}")
    if not tiles.numel():
        return
    first, rows, start, seq = tiles.long().unbind(1)
    if min(int(rows.min()) - 1, int(first.min()), int(start.min())) < 0 or int((first + rows).max()) > len(q):
        raise ValueError(f"tiles name rows outside q's {q.shape[0]} (or none)")
    if int(seq.min()) < 0 or int(seq.max()) >= block_tables.shape[0]:
        raise ValueError(f"tiles name sequences outside the {block_tables.shape[0]} block tables")
    _check_fits(int((start + rows).max()), block_tables, block_size, k_cache)


def paged_prompt(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 tiles: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """Prompt attention read in place from one layer's paged cache, a tile of tokens at a time.

    q ``[rows, q_heads, head_dim]``; k_cache / v_cache as for ``paged_decode`` (the prompt's own keys
    written already); block_tables int32 ``[seqs, max_blocks]``; tiles int32 ``[n, 4]``
    (``prompt_tiles``). Returns ``[rows, q_heads, head_dim]`` whose tiles' rows hold what SDPA returns
    for a query at position p over its sequence's keys 0..p (the other rows are zero).
    """
    check_prompt_args(q, k_cache, v_cache, block_tables, tiles, block_size)
    out = torch.zeros_like(q)
    prompt_into(out, q, k_cache, v_cache, block_tables, tiles, block_size, scale)
    return out


def prompt_into(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, tiles: torch.Tensor, block_size: int, scale: float | None = None,
                kernel=None) -> None:
    """``paged_prompt`` into ``out`` with arguments ``check_prompt_args`` has passed: one C call."""
    rows, q_heads, head_dim = q.shape
    scale = head_dim ** -0.5 if scale is None else scale
    kernel = getattr(load_prompt(), kernel_name(q.dtype, prompt=True)) if kernel is None else kernel
    if kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), tiles.data_ptr(),
              tiles.shape[0], out.data_ptr(), q_heads, k_cache.shape[1], head_dim, block_tables.shape[1],
              block_size, scale, torch.get_num_threads(), -1):
        raise MemoryError("paged_prompt could not allocate its scratch")


@dataclass(slots=True)
class _DecodeRows:
    """All of a step's decode rows, for one kernel call per layer, checked once per step."""

    tokens: torch.Tensor | None  # int64 [n]: their (single) tokens' rows; None: the step is these rows
    block_tables: torch.Tensor   # int32 [n, max_blocks], contiguous
    context_lens: torch.Tensor   # int32 [n]: keys each attends over, its new one included
    max_context: int
    checked: bool = False        # True once check_decode_args has passed, at the first layer
    kernel: object = None        # the C function, looked up at the first layer (kernel_name)


@dataclass(slots=True)
class _PromptTiles:
    """A step's prompt chunks, for one ``paged_prompt`` call per layer, and its decode rows (if any)."""

    chunks: tuple                # (first rows, q_lens, start positions, sequences), one entry per chunk
    block_tables: torch.Tensor   # int32 [seqs, max_blocks], contiguous: the step's
    decodes: _DecodeRows | None  # the step's decode rows, for paged_decode
    whole: bool                  # no padding rows: the chunks and decodes are the whole step
    tiles: torch.Tensor | None = None   # int32 [n, 4] (prompt_tiles), made at the first layer
    checked: bool = False
    kernel: object = None

    def check(self, q, k_cache, v_cache, block_size: int) -> None:
        """Make the chunks' tiles and check them with the tables, at the first layer only: every layer
        has the same heads and tables (the backend and the layer stack both call this)."""
        if not self.checked:
            rows_per_tile = tile_rows(q.shape[1], k_cache.shape[1])
            self.tiles = prompt_tiles(*self.chunks[:3], rows_per_tile, self.chunks[3])
            check_prompt_args(q, k_cache, v_cache, self.block_tables, self.tiles, block_size)
            self.checked = True


def prompts_on_kernel(dtype: torch.dtype, head_dim: int, settings: Settings | None = None) -> bool:
    """Whether prompt chunks go to the prompt kernel, ``paged_prompt`` (``MINICB_PROMPT_ATTENTION=kernel``
    or ``sdpa`` pins it): by default head_dim 64 on a CPU with AVX-512, in float32 and in bfloat16 on
    its native dot products, where it ran 1.9-3.6x SDPA's speed from 64 to 2,048 tokens on a Zen 4 core
    and 1.7-2.0x the decode kernel's with each prompt token a row (``bench/decode_kernel.py
    --prompts``, ``bench/RESULTS.md``, issue 47); SDPA elsewhere."""
    pinned = (settings or Settings.from_env()).prompt_attention
    if pinned in ("kernel", "sdpa"):
        return pinned == "kernel"
    if pinned:
        raise ValueError(f"MINICB_PROMPT_ATTENTION must be 'kernel' or 'sdpa', not {pinned!r}")
    if head_dim != 64 or not avx512_path():
        return False
    return dtype == torch.float32 or dtype == torch.bfloat16 and bf16_native()


class CpuPagedAttention(ReferenceAttention):
    """``ReferenceAttention`` whose decode rows are attended by ``paged_decode`` in place, and, where
    ``prompts_on_kernel`` says so, its prompt chunks by ``paged_prompt``, a tile of tokens at a time:
    a step with prompt chunks is one ``_PromptTiles`` group (its decode rows inside it), one call of
    each kernel per layer."""

    name = "cpu-paged"

    def __init__(self, kv_cache, settings: Settings | None = None) -> None:
        super().__init__(kv_cache)
        settings = settings or Settings.from_env()
        load()           # build now, so that a broken compiler fails at engine start, not mid-run
        dtype = kv_cache.data.dtype
        self.prompts_on_kernel = prompts_on_kernel(dtype, kv_cache.data.shape[-1], settings)
        self.kernel_name = kernel_name(dtype, settings)
        self.prompt_kernel_name = kernel_name(dtype, settings, prompt=True)
        if self.prompts_on_kernel:
            load_prompt()

    def prepare(self, meta: AttentionMetadata):
        n_real = meta.num_seqs - meta.num_padding_rows
        prompts = [i for i in range(n_real) if meta.q_lens[i] > 1]
        if not self.prompts_on_kernel or not prompts:   # SDPA for prompt chunks, or a step without
            return super().prepare(meta)
        decodes = [i for i in range(n_real) if meta.q_lens[i] == 1]
        firsts = meta.cu_seqlens_q.tolist()
        chunks = ([firsts[i] for i in prompts], [meta.q_lens[i] for i in prompts],
                  [meta.start_positions[i] for i in prompts], prompts)
        groups = [_PromptTiles(chunks, meta.block_tables.contiguous(),
                               self._decode_groups(meta, decodes)[0] if decodes else None,
                               whole=not meta.num_padding_rows)]
        if meta.num_padding_rows:        # padding rows attend to themselves, as in the reference
            groups.append(self._group(meta, list(range(n_real, meta.num_seqs)), False))
        return _RefState(groups, meta.slot_mapping, write_mask(meta.slot_mapping))

    def _decode_groups(self, meta: AttentionMetadata, decodes: list[int]) -> list:
        dev = meta.slot_mapping.device
        seqs = torch.tensor(decodes, dtype=torch.long, device=dev)
        ctx = [meta.start_positions[i] + 1 for i in decodes]
        # a step of decodes only (most of a long run): row i of q is decode i, nothing to gather
        whole = len(decodes) == meta.num_seqs
        tokens = None if whole else meta.cu_seqlens_q.index_select(0, seqs).long()   # one token each
        return [_DecodeRows(tokens, meta.block_tables.index_select(0, seqs),         # int32, contiguous
                            torch.tensor(ctx, dtype=torch.int32, device=dev), max(ctx))]

    def _attend_group(self, g, q, k, v, kc, vc, out: torch.Tensor) -> None:
        if isinstance(g, _PromptTiles):
            if g.decodes is not None:
                self._attend_group(g.decodes, q, k, v, kc, vc, out)
            qc = q.contiguous()
            if g.kernel is None:
                g.check(qc, kc, vc, self.kv_cache.block_size)
                g.kernel = getattr(load_prompt(), self.prompt_kernel_name)
            prompt_into(out, qc, kc, vc, g.block_tables, g.tiles, self.kv_cache.block_size, kernel=g.kernel)
            return
        if not isinstance(g, _DecodeRows):
            return super()._attend_group(g, q, k, v, kc, vc, out)
        bs = self.kv_cache.block_size
        # q may be a view into the q/k/v product's rows (cpu_linear): the kernel reads it whole
        qd = (q if g.tokens is None else q.index_select(0, g.tokens)).contiguous()
        if not g.checked:         # the tables are the same for every layer: check them at the first
            check_decode_args(qd, kc, vc, g.block_tables, g.context_lens, bs, g.max_context)
            g.checked, g.kernel = True, getattr(load(), self.kernel_name)
        if g.tokens is None:
            decode_into(out, qd, kc, vc, g.block_tables, g.context_lens, bs, g.max_context,
                        kernel=g.kernel)
        else:
            od = torch.empty_like(qd)
            decode_into(od, qd, kc, vc, g.block_tables, g.context_lens, bs, g.max_context, kernel=g.kernel)
            out.index_copy_(0, g.tokens, od)
