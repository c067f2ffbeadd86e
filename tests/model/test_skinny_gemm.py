"""``minicb.fastpaths.skinny_gemm``: the few-row products on weights packed in panels, against float64, in
every build the CPU can run (its vector paths and the plain C loops), and routed by the packed layers."""

import pytest
import torch

from minicb.fastpaths import cpu_linear as cl
from minicb.fastpaths import skinny_gemm as sg
from minicb.fastpaths.ckernels import KernelUnavailable
from preconditions import unavailable


@pytest.fixture(autouse=True)
def kernel(monkeypatch):
    reason = sg.unavailable_reason()
    if reason is not None:
        unavailable(f"the skinny kernel does not build here: {reason}")
    monkeypatch.delenv("MINICB_SKINNY_ROWS", raising=False)
    monkeypatch.delenv("MINICB_BLOCK_ROWS", raising=False)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())


def _build(flag):
    try:
        return sg.load((flag,))
    except KernelUnavailable as e:              # a compiler for another architecture rejects the flag
        unavailable(f"no build with {flag} here: {e}")


def _plain_c():
    """The kernel built without AVX2 (and so without AVX-512): the loops a CPU without them runs (any x86
    CPU runs this)."""
    return _build("-mno-avx2")


def _avx2():
    """The kernel built without AVX-512: the AVX2 loops, where the CPU has AVX2 and FMA (all of this
    project's machines); plain C elsewhere."""
    return _build("-mno-avx512f")


BUILDS = {"native": lambda: None, "AVX2": _avx2, "plain C": _plain_c}


def _data(rows, in_f, out_f, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    return x, (0.2 * torch.randn(out_f, in_f, generator=g)).to(dtype)


def _bound(x, w):
    """float64 product of the stored values, and how far a float32 sum rounded once to x's dtype may be
    from it: one rounding of the output plus float32 summation error (generous)."""
    exact = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    unit = 2 ** -8 if x.dtype == torch.bfloat16 else 2 ** -24
    return exact, exact.abs() * unit + size * x.shape[-1] * 2 ** -24


SHAPES = [(64, 64), (576, 960), (5, 3), (37, 130), (1536, 576)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", list(BUILDS))
# 517: two chunks of 256 rows (skinny_gemm.c takes rows 256 at a time) and 5 more
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 10, 13, 16, 17, 23, 64, 517])
def test_products_match_float64(dtype, build, rows):
    lib = BUILDS[build]()
    for k, (in_f, out_f) in enumerate(SHAPES):
        x, w = _data(rows, in_f, out_f, dtype, seed=rows * 10 + k)
        y = sg.matmul(x, sg.pack(w), in_f, out_f, lib=lib)
        assert y.shape == (rows, out_f) and y.dtype == dtype
        exact, tol = _bound(x, w)
        assert ((y.double() - exact).abs() <= tol).all(), (in_f, out_f)


def test_each_build_runs_the_loops_the_cpu_has():
    """Which loop each build says it runs, against the CPU's own flags (``/proc/cpuinfo``)."""
    flags = _cpu_flags()
    avx2 = 1 if {"avx2", "fma"} <= flags else 0
    assert [sg.path(d, _plain_c()) for d in (torch.float32, torch.bfloat16)] == [0, 0]
    assert [sg.path(d, _avx2()) for d in (torch.float32, torch.bfloat16)] == [avx2, avx2]
    assert sg.path(torch.float32) == (2 if "avx512f" in flags else avx2)
    assert sg.path(torch.bfloat16) == (2 if "avx512_bf16" in flags else avx2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_panels_are_the_weight_laid_out_by_64_outputs(dtype):
    w = torch.arange(130 * 7, dtype=torch.float32).reshape(130, 7).to(dtype)    # outputs 130, inputs 7
    p = sg.pack(w)
    if dtype == torch.float32:
        assert p.shape == (3, 7, 64)
        for b, i, j in [(0, 0, 0), (0, 6, 63), (1, 3, 5), (2, 0, 1)]:
            assert p[b, i, j] == w[b * 64 + j, i]
        assert (p[2, :, 2:] == 0).all()                         # outputs 130..191 are padding
    else:
        assert p.shape == (3, 4, 64, 2)                         # inputs padded to 8: four pairs
        for b, i, j in [(0, 0, 0), (0, 6, 63), (1, 3, 5), (2, 0, 1)]:
            assert p[b, i // 2, j, i % 2] == w[b * 64 + j, i]
        assert (p[:, 3, :, 1] == 0).all() and (p[2, :, 2:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_through_their_stride_and_two_threads_give_the_same_bits(dtype):
    x, w = _data(9, 576, 1024, dtype, seed=3)
    wide = torch.zeros(9, 700, dtype=dtype)
    wide[:, :576] = x
    panels = sg.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sg.matmul(x, panels, 576, 1024)
        assert torch.equal(sg.matmul(wide[:, :576], panels, 576, 1024), one)     # a row stride of 700
        torch.set_num_threads(2)                  # the panels split over two threads (2.4 MB of weights)
        assert torch.equal(sg.matmul(x, panels, 576, 1024), one)                 # each output as before
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", list(BUILDS))
def test_nan_and_infinity_reach_the_outputs_they_touch(dtype, build):
    lib = BUILDS[build]()
    x, w = _data(4, 40, 70, dtype, seed=8)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    w[7, 5] = 0.0                                   # inf x 0 = nan, as in float64
    y = sg.matmul(x, sg.pack(w), 40, 70, lib=lib)
    exact = x.double() @ w.double().T
    assert torch.equal(y.isnan(), exact.isnan()) and torch.equal(y.isinf(), exact.isinf())
    assert y[1].isnan().all() and y[2, 7].isnan() and y[[0, 3]].isfinite().all()
    assert torch.equal(y.isinf() & (y > 0), exact.isinf() & (exact > 0))


@pytest.mark.parametrize("build", list(BUILDS))
def test_an_odd_row_is_read_to_its_end_and_no_further(build):
    """bfloat16 pairs the inputs; the last of an odd count pairs with a zero, not with what follows the
    row in memory (here a NaN, which a zero weight would not hide: 0 x NaN is NaN)."""
    lib = BUILDS[build]()
    x, w = _data(3, 37, 70, torch.bfloat16, seed=5)
    wide = torch.full((3, 38), float("nan"), dtype=torch.bfloat16)
    wide[:, :37] = x
    y = sg.matmul(wide[:, :37], sg.pack(w), 37, 70, lib=lib)
    exact, tol = _bound(x, w)
    assert ((y.double() - exact).abs() <= tol).all()


def test_what_does_not_fit_the_panels_is_refused():
    """Everything here would have the C loop read outside its tensors, or ignore part of the weight."""
    x, w = _data(2, 64, 70, torch.float32, seed=0)
    panels = sg.pack(w)
    bad = [(x[:, :63], panels, 64, 70), (x.to(torch.bfloat16), panels, 64, 70), (x[None], panels, 64, 70),
           (x, panels, 64, 129),                                           # two panels hold 128 outputs
           (x, panels[:1].expand(3, 64, 64), 64, 192),                     # not contiguous
           (x, panels[:, :, :32], 64, 70),                                 # not 64 outputs wide
           (torch.randn(1, 200), torch.randn(1, 200, 1), 200, 1),          # a panel of width 1
           (x, sg.pack(w.double().float()[:, :62]), 64, 70)]               # another weight's panels
    xb, wb = _data(2, 4, 64, torch.bfloat16, seed=1)
    bad += [(xb[:, :3], sg.pack(wb), 4, 64),               # a column short of the bfloat16 weight
            (xb, sg.pack(wb.float()).to(torch.bfloat16), 4, 64)]     # float32's layout for bfloat16
    for args in bad:
        with pytest.raises(ValueError, match="do not fit"):
            sg.matmul(*args)
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        sg.pack(w.double())


def test_the_panel_width_is_the_kernels():
    assert sg.load().minicb_skinny_panel_width() == sg.PANEL_WIDTH == sg.pack(torch.zeros(1, 1)).shape[-1]


def test_choose_rows(monkeypatch):
    flags = _cpu_flags()
    avx2 = {"avx2", "fma"} <= flags
    expect = {torch.float32: "AVX-512" if "avx512f" in flags else "AVX2" if avx2 else None,
              torch.bfloat16: "AVX-512 BF16" if "avx512_bf16" in flags else
                              "AVX2, widened to float32" if avx2 else None}
    # the measured crossovers with oneDNN (bench/RESULTS.md): Zen 2 for AVX2, Zen 4 for AVX-512
    rows = {"AVX2": 4096, "AVX2, widened to float32": 32, "AVX-512": 4096, "AVX-512 BF16": 4096}
    amx = "amx_bf16" in flags
    for dtype, loop in expect.items():
        if loop == "AVX-512 BF16" and amx:
            want = (16, "its AVX-512 BF16 path, AMX's tiles beyond 16 rows")
        elif loop:
            want = (rows[loop], f"its {loop} path")
        else:
            want = (0, "its vector loops need AVX2 with FMA, which this CPU lacks")
        assert sg.choose_rows(dtype) == want
    assert sg.choose_rows(torch.float64)[0] == 0
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "3")
    assert sg.choose_rows(torch.bfloat16) == (3, "MINICB_SKINNY_ROWS=3")
    assert sg.choose_rows(torch.float64) == (0, "MINICB_SKINNY_ROWS=3")
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "many")
    with pytest.raises(ValueError, match="MINICB_SKINNY_ROWS"):
        sg.choose_rows(torch.float32)


def test_a_cpu_with_amx_keeps_bfloat16_steps_of_more_than_16_rows_for_onednn(monkeypatch):
    """AMX's tile products are oneDNN's: bfloat16 on such a CPU goes to the kernel for few rows only,
    float32 (no AMX for it) as on any AVX-512 CPU. The flags are stood in; the loop is this build's."""
    loops = {dtype: sg.path(dtype) for dtype in (torch.float32, torch.bfloat16)}
    monkeypatch.setattr(sg.ckernels, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16", "amx_bf16"])
    bf16, f32 = sg.choose_rows(torch.bfloat16), sg.choose_rows(torch.float32)
    if loops[torch.bfloat16]:
        assert bf16[0] == 16 and "AMX" in bf16[1]
    if loops[torch.float32]:
        assert f32[0] == 4096 and "AMX" not in f32[1]
    monkeypatch.setattr(sg.ckernels, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    if loops[torch.bfloat16]:
        assert sg.choose_rows(torch.bfloat16)[0] == (4096 if loops[torch.bfloat16] == 2 else 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_send_few_rows_to_the_kernel_and_more_to_onednn(dtype, monkeypatch):
    if not cl.can_pack():
        unavailable("this torch has no oneDNN packed linear ops")
    lin = torch.nn.Linear(48, 200, bias=False).to(dtype)
    # oneDNN packs bfloat16 only where the CPU has bfloat16 products; elsewhere it computes in float32
    compute = dtype if dtype == torch.float32 or cl.no_bf16_packing_reason() is None else torch.float32
    layer = cl.PackedLinear(lin, compute, skinny_rows=4)
    stacked = cl.PackedProjections([lin, lin], compute, skinny_rows=4)
    calls = []
    real = sg.matmul
    monkeypatch.setattr(sg, "matmul", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 48).to(dtype)
        exact, tol = _bound(x, lin.weight)
        for got in (layer(x), *stacked(x).split(200, dim=-1)):
            assert ((got.double() - exact).abs() <= 2 * tol).all()
    assert calls == [1, 1, 4, 4]                                # 5 and 40 rows went to oneDNN
    assert not hasattr(cl.PackedLinear(lin, compute), "weight_panels")
    if dtype == torch.bfloat16:         # computed in float32 by oneDNN: bfloat16 panels all the same
        calls.clear()
        for f32_product in (cl.PackedLinear(lin, torch.float32, skinny_rows=4),
                            cl.PackedProjections([lin, lin], torch.float32, skinny_rows=4),
                            cl.PackedLinear(cl.Float32ComputeLinear(lin), torch.float32, skinny_rows=4)):
            assert f32_product.skinny_rows == 4
            weight = lin.weight.detach()
            weight = weight if f32_product.out_features == 200 else torch.cat([weight, weight])
            assert torch.equal(f32_product.weight_panels, sg.pack(weight))     # the weights, exactly
            for rows in (3, 9):                   # the kernel, then oneDNN in float32: one rounding each
                x = torch.randn(rows, 48).to(dtype)
                exact, tol = _bound(x, lin.weight)
                got = f32_product(x)[:, :200]
                assert got.dtype == dtype and ((got.double() - exact).abs() <= 2 * tol).all()
        assert calls == [3, 3, 3]


def test_a_bfloat16_model_on_float32_products_takes_the_kernel_and_says_so(monkeypatch, caplog):
    """oneDNN multiplies a bfloat16 model in float32 on a CPU without bfloat16 products; its steps of few
    rows read the bfloat16 panels instead, and agree with oneDNN's float32 products."""
    import logging

    from helpers import TINY
    from minicb.entrypoints.llm import cpu_fast_paths
    from minicb.model.attention import ReferenceAttention
    from minicb.model.llama import LlamaForCausalLM
    from minicb.runtime.packer import pack_prompts

    if not cl.can_pack():
        unavailable("this torch has no oneDNN packed linear ops")
    monkeypatch.setenv("MINICB_LINEAR", "onednn-f32")
    models = {}
    for rows in ("16", "0"):
        monkeypatch.setenv("MINICB_SKINNY_ROWS", rows)
        models[rows] = LlamaForCausalLM.random(TINY, dtype=torch.bfloat16, seed=0)
        with caplog.at_level(logging.INFO, logger="minicb"):
            cpu_fast_paths(models[rows], "cpu")
        assert cl.skinny_rows_of(models[rows]) == int(rows)
    assert caplog.records[-2].getMessage().endswith(
        "; steps of up to 16 rows on the skinny kernel (MINICB_SKINNY_ROWS=16)")
    calls = []
    real = sg.matmul
    monkeypatch.setattr(sg, "matmul", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    b = pack_prompts([[5, 6, 7, 8]])
    got, ref = (models[r](b.input_ids, b.positions, ReferenceAttention(None), b.attn) for r in ("16", "0"))
    assert calls and set(calls) == {4}
    assert got.dtype == ref.dtype == torch.bfloat16
    assert (got.float() - ref.float()).abs().max() <= 0.05 * ref.float().abs().max()
