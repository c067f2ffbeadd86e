"""The prompt kernel (``paged_prompt.c``): prompt chunks in tiles, against an independent oracle.

The oracle attends each chunk the plain way: the sequence's keys looked up through its block table,
a causal mask (query i of a chunk at position start + i sees keys 0..start + i), softmax in float64.
The kernel must agree with it to rounding for whole prompts and chunks after cached tokens, any block
size, tiles that straddle blocks and chunks that are not a whole number of tiles, GQA groups smaller
and larger than its lanes, with its AVX-512 loops and without; and give the same bits on any number of
threads.
"""

from __future__ import annotations

import pytest
import torch

from minicb.fastpaths import cpu_paged
from minicb.fastpaths.ckernels import cpu_flags
from preconditions import unavailable


@pytest.fixture(scope="module", autouse=True)
def kernel():
    why = cpu_paged.unavailable_reason() or cpu_paged.ckernels.why_not(cpu_paged.load_prompt)
    if why:
        unavailable(f"the cpu-paged kernels cannot be built here: {why}")


# (cached tokens before the chunk, chunk length): a whole prompt, a chunk after a prefix that ends
# inside a block, a one-token chunk, a chunk after a block-aligned prefix
CHUNKS = [(0, 37), (21, 19), (5, 1), (64, 33)]


def prompt_case(chunks, hq, hkv, d, bs, dtype, seed):
    """A paged cache holding each sequence's first start + q_len keys in random blocks, and the chunks'
    queries one after another: (q, k_cache, v_cache, block_tables, firsts, q_lens, starts)."""
    g = torch.Generator().manual_seed(seed)
    starts, q_lens = [s for s, _ in chunks], [n for _, n in chunks]
    max_blocks = max(-(-(s + n) // bs) for s, n in chunks)
    num_blocks = len(chunks) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=g)[:len(chunks) * max_blocks].view(len(chunks), max_blocks)
    kc, vc = (torch.randn(num_blocks * bs, hkv, d, generator=g, dtype=torch.float64).to(dtype)
              for _ in range(2))
    q = torch.randn(sum(q_lens), hq, d, generator=g, dtype=torch.float64).to(dtype)
    firsts = [sum(q_lens[:i]) for i in range(len(chunks))]
    return q, kc, vc, tables.to(torch.int32), firsts, q_lens, starts


def oracle(q, kc, vc, tables, firsts, q_lens, starts, bs):
    """Each chunk against its sequence's keys under the causal mask, in float64."""
    hq, d = q.shape[1:]
    group = hq // kc.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, (f, n, start) in enumerate(zip(firsts, q_lens, starts)):
        slots = [int(tables[s, t // bs]) * bs + t % bs for t in range(start + n)]
        k = kc[slots].double().repeat_interleave(group, dim=1)        # [keys, hq, d]
        v = vc[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q[f:f + n].double(), k) / d ** 0.5
        sees = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]     # [n, keys]
        p = torch.softmax(scores.masked_fill(~sees, float("-inf")), dim=-1)
        out[f:f + n] = torch.einsum("hij,jhd->ihd", p, v)
    return out


# the kernel as minicb builds it (AVX-512 loops where the CPU has AVX-512) and without them
BUILDS = {"default": (), "portable": ("-mno-avx512f",)}


def attend(q, kc, vc, tables, tiles, bs, build="default"):
    if build == "default":
        return cpu_paged.paged_prompt(q, kc, vc, tables, tiles, bs)
    out = torch.zeros_like(q)
    cpu_paged.check_prompt_args(q, kc, vc, tables, tiles, bs)
    kernel = getattr(cpu_paged.load_prompt(BUILDS[build]), cpu_paged.kernel_name(q.dtype, prompt=True))
    cpu_paged.prompt_into(out, q, kc, vc, tables, tiles, bs, kernel=kernel)
    return out


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bs", [1, 4, 16])
# SmolLM2's 9 / 3 x 64; head_dim 8, 32, 48, 128 on the AVX-512 loops, 12 and 6 on the portable ones
# (6: odd pairs of bfloat16); a group of 50 query heads fills more than one block of 48 lanes
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 8), (8, 1, 32), (6, 2, 48), (4, 2, 128), (3, 1, 12),
                                   (2, 2, 6), (50, 1, 8)])
@pytest.mark.parametrize("rows_per_tile", [None, 5])       # None: the kernel's own (16 for 3 heads a group)
def test_kernel_matches_oracle(build, dtype, tol, bs, shape, rows_per_tile):
    hq, hkv, d = shape
    q, kc, vc, tables, firsts, q_lens, starts = prompt_case(CHUNKS, hq, hkv, d, bs, dtype, seed=bs * 100 + d)
    tiles = cpu_paged.prompt_tiles(firsts, q_lens, starts, rows_per_tile or cpu_paged.tile_rows(hq, hkv))
    assert tiles[:, 1].sum() == q.shape[0]
    got = attend(q, kc, vc, tables, tiles, bs, build)
    assert got.dtype == dtype and got.shape == q.shape
    want = oracle(q, kc, vc, tables, firsts, q_lens, starts, bs)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_tiles_cut_each_chunk_in_order():
    tiles = cpu_paged.prompt_tiles([0, 37], [37, 5], [0, 21], 16, seqs=[2, 0])
    assert tiles.tolist() == [[0, 16, 0, 2], [16, 16, 16, 2], [32, 5, 32, 2], [37, 5, 21, 0]]
    assert cpu_paged.tile_rows(9, 3) * 3 == cpu_paged.load_prompt().minicb_paged_prompt_lanes() == 48
    assert cpu_paged.tile_rows(64, 1) == 1


def test_the_avx512_loops_are_built_where_the_cpu_has_avx512():
    assert bool(cpu_paged.load_prompt().minicb_paged_prompt_avx512()) == ("avx512f" in cpu_flags())
    assert not cpu_paged.load_prompt(BUILDS["portable"]).minicb_paged_prompt_avx512()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_two_and_three_threads_give_the_same_bits(dtype):
    """Each (tile, kv head) is computed by one thread, the same way whichever it is."""
    chunks = [(0, 200), (150, 120), (7, 3)]
    q, kc, vc, tables, firsts, q_lens, starts = prompt_case(chunks, 9, 3, 64, 16, dtype, seed=7)
    tiles = cpu_paged.prompt_tiles(firsts, q_lens, starts, cpu_paged.tile_rows(9, 3))
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_paged.paged_prompt(q, kc, vc, tables, tiles, 16))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 8), (2, 2, 6)])
def test_widening_bfloat16_kernel_is_the_float32_kernel_rounded(shape, monkeypatch):
    """The widening bfloat16 kernel widens to float32 and multiply-adds in the float32 kernel's order:
    its output is the float32 kernel's on the widened inputs, rounded by torch."""
    monkeypatch.setenv("MINICB_BF16_DECODE", "widen")
    hq, hkv, d = shape
    q, kc, vc, tables, firsts, q_lens, starts = prompt_case(CHUNKS, hq, hkv, d, 16, torch.bfloat16, seed=d)
    tiles = cpu_paged.prompt_tiles(firsts, q_lens, starts, cpu_paged.tile_rows(hq, hkv))
    got = cpu_paged.paged_prompt(q, kc, vc, tables, tiles, 16)
    want = cpu_paged.paged_prompt(q.float(), kc.float(), vc.float(), tables, tiles, 16).to(torch.bfloat16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 8)])
def test_native_bfloat16_kernel_is_a_rounding_from_float64(shape, monkeypatch):
    """The bfloat16 kernels against the float64 kernel on the same values. The widening one computes in
    float32 and rounds once: within one bfloat16 rounding of the output. The default one (vdpbf16ps where
    the CPU has it) also rounds each softmax weight to bfloat16 before the weighted sum of the values, an
    error of one bfloat16 rounding of each term p_j v_j: so its bound is one rounding of the output plus
    one of sum_j p_j |v_j| (the float64 kernel on |v|), which a sum with cancelling terms can exceed the
    output by. Both bounds have a factor of two to spare (a rounding is at most 2^-9 relative)."""
    hq, hkv, d = shape
    q, kc, vc, tables, firsts, q_lens, starts = prompt_case(CHUNKS, hq, hkv, d, 16, torch.bfloat16, d + 1)
    tiles = cpu_paged.prompt_tiles(firsts, q_lens, starts, cpu_paged.tile_rows(hq, hkv))
    exact = cpu_paged.paged_prompt(q.double(), kc.double(), vc.double(), tables, tiles, 16)
    magnitude = cpu_paged.paged_prompt(q.double(), kc.double(), vc.double().abs(), tables, tiles, 16)
    native = bool(cpu_paged.load_prompt().minicb_paged_prompt_avx512()) and cpu_paged.bf16_native()
    for mode, bound in (("native", exact.abs() + magnitude * native), ("widen", exact.abs())):
        monkeypatch.setenv("MINICB_BF16_DECODE", mode)
        got = cpu_paged.paged_prompt(q, kc, vc, tables, tiles, 16).double()
        assert ((got - exact).abs() <= bound * 2 ** -8 + 1e-4).all(), mode
    if native:      # the weights' rounding is there: the widening kernel's bound would not hold
        monkeypatch.setenv("MINICB_BF16_DECODE", "native")
        got = cpu_paged.paged_prompt(q, kc, vc, tables, tiles, 16).double()
        assert not ((got - exact).abs() <= exact.abs() * 2 ** -9).all()


def test_kernel_rejects_bad_input():
    q, kc, vc, tables, firsts, q_lens, starts = prompt_case(CHUNKS, 4, 2, 8, 4, torch.float32, seed=1)
    tiles = cpu_paged.prompt_tiles(firsts, q_lens, starts, 16)

    def bad(match, **change):
        args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables, tiles=tiles, block_size=4) | change
        with pytest.raises(ValueError, match=match):
            cpu_paged.paged_prompt(**args)

    bad("float32, float64 or bfloat16", q=q.half())
    bad("of one dtype", q=q.bfloat16())
    bad("contiguous", q=q.transpose(0, 1))
    bad("int32", tiles=tiles.long())
    bad("inconsistent shapes", k_cache=kc[:, :, :4].contiguous())
    bad(r"\[n, 4\]", tiles=tiles[:, :3].contiguous())
    bad("rows outside", tiles=tiles + torch.tensor([q.shape[0], 0, 0, 0], dtype=torch.int32))
    bad("rows outside", tiles=tiles * torch.tensor([1, 0, 1, 1], dtype=torch.int32))     # no rows
    bad("sequences outside", tiles=tiles + torch.tensor([0, 0, 0, 9], dtype=torch.int32))
    bad("does not fit", tiles=tiles + torch.tensor([0, 0, 1000, 0], dtype=torch.int32))
    bad("outside the cache", block_tables=tables + kc.shape[0] // 4)
    assert cpu_paged.paged_prompt(q, kc, vc, tables, tiles[:0], 4).abs().sum() == 0
