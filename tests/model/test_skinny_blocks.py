"""``skinny_gemm``'s products from a GGUF's Q4_1 and Q8_0 blocks (``pack_blocks``, ``matmul_blocks``): the
same bits as the bfloat16 panels of the weight the blocks stand for, on any thread count, in the builds
whose loops sum alike (AVX-512 BF16, plain C; the AVX2 build: within float32 rounding).

What the blocks stand for is checked apart from the kernel: ``blocks_weight`` against the loader's own
numpy dequantization (itself checked against the ``gguf`` package, ``test_loader.py``)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_skinny_gemm import BUILDS, _bound, kernel  # noqa: F401  (kernel: its autouse fixture)

from minicb.fastpaths import skinny_gemm as sg
from minicb.fastpaths.settings import Settings
from minicb.model.weights.gguf_loader import dequantize


def gguf_blocks(kind: str, out_f: int, in_f: int, seed: int) -> np.ndarray:
    """Random ``kind`` blocks ``[out_f, in_f / 32, 20 (Q4_1) or 34 (Q8_0)]``: scales (and offsets) of a
    real model's size, and blocks with a zero scale, a negative one, a subnormal float16 one, large
    ones."""
    rng = np.random.default_rng(seed)
    nb = in_f // 32
    d = (rng.standard_normal((out_f, nb)) * 0.01).astype(np.float16)
    m = (-rng.random((out_f, nb)) * 0.08).astype(np.float16)
    if out_f * nb >= 5:
        d.flat[0], d.flat[1], d.flat[2], d.flat[3] = 0, -0.02, np.float16(2.0 ** -20), 60.0
        m.flat[3], m.flat[4] = -900.0, np.float16(2.0 ** -24)
    scales = [a.view(np.uint8).reshape(out_f, nb, 2) for a in ((d, m) if kind == "Q4_1" else (d,))]
    qs = rng.integers(0, 256, (out_f, nb, 16 if kind == "Q4_1" else 32), dtype=np.uint8)
    return np.concatenate([*scales, qs], axis=2)


KINDS = ["Q4_1", "Q8_0"]


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_weight_is_the_loaders_dequantization_in_bfloat16(kind):
    blocks = gguf_blocks(kind, 100, 96, seed=1)
    loader = torch.from_numpy(dequantize(blocks.reshape(-1), T[kind], (100, 96))).to(torch.bfloat16)
    assert torch.equal(sg.blocks_weight(blocks), loader)
    assert loader.abs().max() >= 900 and (loader == 0).any()      # the special blocks are in it


SHAPES = [(64, 32), (100, 96), (960, 576), (576, 1536), (37, 64)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_products_from_the_blocks_equal_the_bfloat16_panels_bit_for_bit(kind, build, out_f, in_f):
    """The AVX-512 BF16 loop (the native build here, where the CPU has it) and the plain C loop give
    the bfloat16 panels' bits; the AVX2 build has no loop of its own for blocks (they take the plain C
    loop, while its bfloat16 panels take the AVX2 one, which sums otherwise), so there the products agree
    with float64 to a float32 sum rounded once, as every build's do."""
    lib = BUILDS[build]()
    blocks = gguf_blocks(kind, out_f, in_f, seed=out_f + in_f)
    weight = sg.blocks_weight(blocks)
    panels, packed = sg.pack(weight), sg.pack_blocks(blocks)
    assert packed.shape == (-(-out_f // 64), in_f // 32, 1536 if kind == "Q4_1" else 2304)
    exact = build == "plain C" or sg.path(torch.bfloat16, lib) == 2
    for rows in (1, 2, 3, 5, 6, 7, 13):
        x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = sg.matmul_blocks(x, packed, in_f, out_f, lib=lib)
        if exact:
            want = sg.matmul(x, panels, in_f, out_f, lib=lib)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rows, (got - want).abs())
        else:
            want, bound = _bound(x, weight)
            assert ((got.double() - want).abs() <= bound).all(), rows


@pytest.mark.parametrize("kind", KINDS)
def test_rows_read_through_their_stride_and_two_threads_give_the_same_bits(kind):
    """Rows 1,000 apart (the kernel's ``xstride``, no copy), and a product big enough to be split over
    two threads (``SPLIT_BYTES``: 24 panels of 18 blocks, 0.66 MB of Q4_1)."""
    blocks = gguf_blocks(kind, 1536, 576, seed=5)
    packed, panels = sg.pack_blocks(blocks), sg.pack(sg.blocks_weight(blocks))
    assert packed.nbytes > 524288
    wide = torch.randn(3, 1000).to(torch.bfloat16)
    x = wide[:, 100:676]                                   # rows 1,000 apart
    assert x.stride() == (1000, 1)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(sg.matmul_blocks(x, packed, 576, 1536))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], sg.matmul(x.contiguous(), panels, 576, 1536))


def test_what_does_not_fit_the_blocks_is_refused():
    packed = sg.pack_blocks(gguf_blocks("Q4_1", 64, 64, seed=2))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    for bad in (x.float(), x[:, :32], torch.zeros(2, 48, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="do not fit"):
            sg.matmul_blocks(bad, packed, bad.shape[1], 64)
    with pytest.raises(ValueError, match="do not fit"):
        sg.matmul_blocks(x, packed, 64, 65)                      # two panels' worth of outputs, one panel
    with pytest.raises(ValueError, match="20 .Q4_1. or 34 .Q8_0."):
        sg.pack_blocks(np.zeros((64, 2, 18), np.uint8))          # Q4_0's block size


def test_choose_block_rows():
    pinned = sg.choose_block_rows(Settings.from_env({"MINICB_BLOCK_ROWS": "7"}))
    if sg.path(torch.bfloat16) == 2:                       # AVX-512 BF16: the measured default, or the pin
        assert sg.choose_block_rows(Settings.from_env({})) == (sg.BLOCK_ROWS, "its AVX-512 BF16 path")
        assert pinned == (7, "MINICB_BLOCK_ROWS=7")
    else:                                                  # never: not the panels' bits here
        never = (0, "the blocks' loop needs AVX-512 BF16")
        assert pinned == sg.choose_block_rows(Settings.from_env({})) == never
    assert sg.choose_block_rows(Settings.from_env({"MINICB_BLOCK_ROWS": "0"})) == (0, "MINICB_BLOCK_ROWS=0")
    with pytest.raises(ValueError, match="MINICB_BLOCK_ROWS"):
        sg.choose_block_rows(Settings.from_env({"MINICB_BLOCK_ROWS": "two"}))
