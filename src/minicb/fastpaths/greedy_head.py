"""Greedy tokens without most of the LM head: the tokens ``argmax(lm_head(x))`` gives, bit for bit.

A step in which every row is greedy (temperature 0, no logprobs, no logits processors) needs only the
index of each row's largest logit. ``greedy_head.c`` estimates every logit from byte-rounded weights
and activations (``vpdpbusd``: twice the products per instruction of ``vdpbf16ps``, half the bytes),
bounds how far each estimate can be from the bfloat16 product's logit, and multiplies exactly only the
64-output panels whose bound reaches the row's best: the same skinny-kernel loop on the same panels,
so the token is the one the whole product would give (the file draws the four steps and the bound).

Where: a bfloat16 model whose LM head is the skinny kernel's panels (``cpu_linear.PackedLinear``), on
a CPU with AVX-512 VNNI, for steps of more rows than the LM head reads from the GGUF's blocks (at one
row the product is memory-bound and the estimate reads as many bytes). ``MINICB_GREEDY_HEAD=0`` turns
it off. Anything it cannot bound (a row that is not finite) gets the whole LM head, as before.

The runner asks for it (``ModelRunner.run``); ``python bench/greedy_head.py`` counts the panels it
multiplies on W2's rows and times it against the whole LM head.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from minicb.fastpaths import ckernels, host_memory, skinny_gemm
from minicb.fastpaths.settings import Settings

SOURCE = Path(__file__).parent / "csrc" / "greedy_head.c"
BLOCK, WIDTH = 32, 64                   # QB and PW in greedy_head.c
MAX_ROWS = 256      # a step's sampled rows it takes (its scratch grows with rows x panels: 3 MiB at 256)


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled ``greedy_head.c`` (``("-mno-avx512f",)``: its plain C estimate, which the tests
    run too)."""
    lib = ckernels.open_library(ckernels.build(SOURCE, extra_flags=extra_flags), "the compiled greedy head")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.minicb_greedy_head.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr,
                                       ctypes.c_int]
    lib.minicb_greedy_head.restype = ctypes.c_int
    lib.minicb_greedy_vnni.argtypes, lib.minicb_greedy_vnni.restype = [], ctypes.c_int
    return lib


def _round_up(t: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below: the bound's per-output norms may only err upwards."""
    f = t.float()
    return torch.where(f.double() < t, torch.nextafter(f, torch.full_like(f, float("inf"))), f)


class GreedyHead:
    """The estimate's weights for one LM head (``weight`` [vocab, in], bfloat16, and its skinny
    ``panels``), and the call. ``tokens(x)``: the greedy token of each row of ``x`` (bfloat16 [rows,
    in]), or None where some row cannot be bounded, or where the LM head it was made from (``of``) has
    other panels now: the caller then computes every logit, as the layer stack stops reading blocks of
    weights that were replaced."""

    def __init__(self, weight: torch.Tensor, panels: torch.Tensor, extra_flags: tuple[str, ...] = ()) -> None:
        vocab, n_in = weight.shape
        if weight.dtype != torch.bfloat16 or n_in % BLOCK:
            raise ValueError("the greedy head takes a bfloat16 weight with inputs in blocks of 32")
        self.lib = load(extra_flags)
        self.vocab, self.in_features, self.panels = vocab, n_in, panels
        pad, nb = -vocab % WIDTH, n_in // BLOCK
        w = torch.cat([weight.float(), torch.zeros(pad, n_in)]).view(-1, nb, BLOCK)   # exact: bfloat16
        d = w.abs().amax(-1) / 127                                             # [outputs, blocks]
        q = torch.where(d[..., None] > 0, (w / d[..., None]).round(), torch.zeros_like(w)).to(torch.int16)
        # the bound's norms per output, in float64 a few thousand rows at a time (a copy of the whole
        # head in float64 is 226 MB), rounded up to float32
        wn, en, wmax = (torch.empty(w.shape[0], dtype=torch.float64) for _ in range(3))
        for i in range(0, w.shape[0], 4096):
            wi, approx = w[i:i + 4096].double(), q[i:i + 4096].double() * d[i:i + 4096, :, None].double()
            wn[i:i + 4096] = approx.flatten(1).norm(dim=-1)                    # |W^_j|
            en[i:i + 4096] = (wi - approx).flatten(1).norm(dim=-1)             # |W'_j - W^_j|
            wmax[i:i + 4096] = wi.flatten(1).abs().amax(-1)                    # max |W'_j|
        self.wn, self.en, self.wmax = _round_up(wn), _round_up(en), _round_up(wmax)
        # [panels of 64][blocks][chunk 8][vector 4][output 16][input 4], q + 128 as bytes (the skinny
        # kernel's panels of 64 outputs); d [panels][blocks][64]
        u8 = (q + 128).to(torch.uint8).view(-1, 4, 16, nb, 8, 4)
        self.wq = host_memory.on_huge_pages(u8.permute(0, 3, 4, 1, 2, 5))    # every step streams them
        self.wd = host_memory.on_huge_pages(d.view(-1, WIDTH, nb).permute(0, 2, 1))
        self.skinny = ctypes.cast(skinny_gemm._c_function(torch.bfloat16, part=True), ctypes.c_void_p).value
        self.recomputed = 0                     # panels multiplied exactly, every call so far
        self.min_rows, self.max_rows = 2, MAX_ROWS      # the steps the runner hands it (for_model's)
        self.source = None                      # the LM head it was made from (``of``), if any

    @classmethod
    def of(cls, head, extra_flags: tuple[str, ...] = ()) -> GreedyHead:
        """The greedy head of a packed LM head ``head`` (``cpu_linear.PackedLinear`` with skinny
        panels), for the steps its own products would take from the bfloat16 panels."""
        greedy = cls(skinny_gemm.unpack(head.weight_panels, head.out_features, head.in_features),
                     head.weight_panels, extra_flags)
        greedy.min_rows = head.block_rows + 1 if head.block_rows else 2
        greedy.max_rows = min(head.skinny_rows, MAX_ROWS)
        greedy.source = head
        return greedy

    def tokens(self, x: torch.Tensor) -> list[int] | None:
        rows = x.shape[0]
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features or x.stride(1) != 1:
            raise ValueError(f"greedy head: bfloat16 rows of {self.in_features} inputs, got {x.dtype} "
                             f"{tuple(x.shape)}")
        if self.source is not None and self.source.weight_panels.data_ptr() != self.panels.data_ptr():
            return None     # the LM head's panels were replaced since: its estimate is of other weights
        out = torch.empty(rows, dtype=torch.int64)
        count = ctypes.c_int64(0)
        if self.lib.minicb_greedy_head(x.data_ptr(), x.stride(0), rows, self.in_features, self.wq.data_ptr(),
                                       self.wd.data_ptr(), self.wn.data_ptr(), self.en.data_ptr(),
                                       self.wmax.data_ptr(), self.vocab, self.skinny, self.panels.data_ptr(),
                                       out.data_ptr(), ctypes.byref(count), torch.get_num_threads()):
            raise MemoryError("greedy head: its scratch could not be allocated")
        self.recomputed += count.value
        tokens = out.tolist()
        return None if -1 in tokens else tokens


def for_model(model, settings: Settings | None = None) -> GreedyHead | None:
    """The greedy head of a model loaded on the fast paths, or None where it does not apply (module
    docstring): not bfloat16, no skinny panels for the LM head, no AVX-512 VNNI, or turned off."""
    settings = settings or Settings.from_env()
    head = getattr(model, "lm_head", None)
    panels = getattr(head, "weight_panels", None)
    if not settings.greedy_head or panels is None or getattr(head, "int8_panels", None) is not None:
        return None
    if panels.dtype != torch.bfloat16 or head.in_features % BLOCK or ckernels.why_not(load):
        return None
    if not load().minicb_greedy_vnni():
        return None
    return GreedyHead.of(head)


