"""``minicb.model.skinny_gemm``: the few-row products on weights packed in panels, against float64, in
every build the CPU can run (its vector paths and the plain C loops), and routed by the packed layers."""

import pytest
import torch

from minicb.model import cpu_linear as cl
from minicb.model import skinny_gemm as sg
from minicb.model.ckernels import KernelUnavailable
from preconditions import unavailable


@pytest.fixture(autouse=True)
def kernel(monkeypatch):
    reason = sg.unavailable_reason()
    if reason is not None:
        unavailable(f"the skinny kernel does not build here: {reason}")
    monkeypatch.delenv("MINICB_SKINNY_ROWS", raising=False)


def _plain_c():
    """The kernel built without AVX-512: the loops a CPU without it runs (any x86 CPU runs this)."""
    try:
        return sg.load(("-mno-avx512f",))
    except KernelUnavailable as e:              # a compiler for another architecture rejects the flag
        unavailable(f"no build without AVX-512 here: {e}")


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
@pytest.mark.parametrize("build", ["native", "plain C"])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 16, 17])
def test_products_match_float64(dtype, build, rows):
    lib = None if build == "native" else _plain_c()
    for k, (in_f, out_f) in enumerate(SHAPES):
        x, w = _data(rows, in_f, out_f, dtype, seed=rows * 10 + k)
        y = sg.matmul(x, sg.pack(w), out_f, lib=lib)
        assert y.shape == (rows, out_f) and y.dtype == dtype
        exact, tol = _bound(x, w)
        assert ((y.double() - exact).abs() <= tol).all(), (in_f, out_f)


def test_the_plain_c_build_is_the_fallback_the_isa_says():
    assert _plain_c().minicb_skinny_isa() == 0
    assert sg.isa() in (0, 1, 2)


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
    one = sg.matmul(x, panels, 1024)
    assert torch.equal(sg.matmul(wide[:, :576], panels, 1024), one)      # a row stride of 700
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(sg.matmul(x, panels, 1024), one)             # each output summed as before
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", ["native", "plain C"])
def test_an_odd_row_is_read_to_its_end_and_no_further(build):
    """bfloat16 pairs the inputs; the last of an odd count pairs with a zero, not with what follows the
    row in memory (here a NaN, which a zero weight would not hide: 0 x NaN is NaN)."""
    lib = None if build == "native" else _plain_c()
    x, w = _data(3, 37, 70, torch.bfloat16, seed=5)
    wide = torch.full((3, 38), float("nan"), dtype=torch.bfloat16)
    wide[:, :37] = x
    y = sg.matmul(wide[:, :37], sg.pack(w), 70, lib=lib)
    exact, tol = _bound(x, w)
    assert ((y.double() - exact).abs() <= tol).all()


def test_what_does_not_fit_the_panels_is_refused():
    x, w = _data(2, 64, 70, torch.float32, seed=0)
    panels = sg.pack(w)
    for bad in (x[:, :63], x.to(torch.bfloat16), x[None]):
        with pytest.raises(ValueError, match="do not fit"):
            sg.matmul(bad, panels, 70)
    with pytest.raises(ValueError, match="do not fit"):
        sg.matmul(x, panels, 129)                               # two panels hold 128 outputs
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        sg.pack(w.double())


def test_choose_rows(monkeypatch):
    rows, why = sg.choose_rows(torch.float32)
    assert (rows, why) == ((sg.DEFAULT_ROWS, "its AVX-512 path") if sg.isa() >= 1 else
                           (0, "its vector path needs AVX-512, which this CPU lacks"))
    rows, why = sg.choose_rows(torch.bfloat16)
    assert rows == (sg.DEFAULT_ROWS if sg.isa() == 2 else 0)
    assert sg.choose_rows(torch.float64)[0] == 0
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "3")
    assert sg.choose_rows(torch.bfloat16) == (3, "MINICB_SKINNY_ROWS=3")
    assert sg.choose_rows(torch.float64) == (0, "MINICB_SKINNY_ROWS=3")
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "many")
    with pytest.raises(ValueError, match="MINICB_SKINNY_ROWS"):
        sg.choose_rows(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_send_few_rows_to_the_kernel_and_more_to_onednn(dtype, monkeypatch):
    if not cl.can_pack():
        unavailable("this torch has no oneDNN packed linear ops")
    lin = torch.nn.Linear(48, 200, bias=False).to(dtype)
    layer = cl.PackedLinear(lin, dtype, skinny_rows=4)
    stacked = cl.PackedProjections([lin, lin], dtype, skinny_rows=4)
    calls = []
    real = sg.matmul
    monkeypatch.setattr(sg, "matmul", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 48).to(dtype)
        exact, tol = _bound(x, lin.weight)
        for got in (layer(x), *stacked(x).split(200, dim=-1)):
            assert ((got.double() - exact).abs() <= 2 * tol).all()
    assert calls == [1, 1, 4, 4]                                # 5 and 40 rows went to oneDNN
    assert not hasattr(cl.PackedLinear(lin, dtype), "weight_panels")
    if dtype == torch.bfloat16:                                 # computed in float32: oneDNN only
        assert cl.PackedLinear(lin, torch.float32, skinny_rows=4).skinny_rows == 0
