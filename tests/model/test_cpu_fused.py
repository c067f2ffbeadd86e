"""``minicb.fastpaths.cpu_fused``: RMSNorm and the rotary embedding as C loops (``fused_ops.c``).

The rotary embedding must equal ``llama.apply_rope`` bit for bit (no fused multiply-adds, each step
rounded as torch rounds it); RMSNorm sums its squares in another order, so it is checked to a float32
rounding (and to one bfloat16 step). Then the model level: switching a model's modules keeps its
weights and its greedy tokens, and ``LLM`` switches the models it loads itself.
"""

from __future__ import annotations

import copy
import logging
import shlex
import subprocess

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY, random_prompts
from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM, cpu_fast_paths
from minicb.fastpaths import ckernels, cpu_fused, cpu_paged, greedy_head, int8_gemm, layer_stack, skinny_gemm
from minicb.model.attention import ReferenceAttention
from minicb.model.llama import LlamaForCausalLM, RMSNorm, apply_rope, rope_cos_sin
from minicb.runtime.packer import pack_prompts
from minicb.runtime.sampling import unscorable_rows
from preconditions import unavailable

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True, scope="module")
def built():
    why = cpu_fused.unavailable_reason()
    if why:
        unavailable(f"the fused ops do not build here: {why}")


def rand(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,q_heads,kv_heads,dim", [(1, 4, 2, 8), (37, 9, 3, 64), (300, 8, 8, 16)])
def test_rope_equals_apply_rope_bit_for_bit(dtype, rows, q_heads, kv_heads, dim):
    q, k = rand(rows, q_heads, dim, dtype=dtype), rand(rows, kv_heads, dim, dtype=dtype, seed=1, scale=30)
    positions = torch.randint(0, 5000, (rows,), generator=torch.Generator().manual_seed(2))
    cos, sin = rope_cos_sin(positions, dim, 10000.0, dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cpu_fused.rope_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_views_into_the_qkv_product_in_place(dtype):
    # q and k as the packed q/k/v product hands them over: slices of wider rows (row stride 15 * 8)
    rows, q_heads, kv_heads, dim = 23, 9, 3, 8
    qkv = rand(rows, (q_heads + 2 * kv_heads) * dim, dtype=dtype, seed=3)
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, q_heads, dim), k.view(rows, kv_heads, dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = rope_cos_sin(torch.arange(100, 100 + rows), dim, 10000.0, dtype)
    want_q, want_k, want_v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.clone()
    cpu_fused.rope_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, want_v)                     # the rest of each row untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 8), (64, 576), (2048, 96)])
def test_rms_norm_matches_the_reference_to_a_rounding(dtype, rows, dim):
    x, w = rand(rows, dim, dtype=dtype, scale=3), 1 + rand(dim, dtype=dtype, seed=1, scale=0.1)
    ref = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
    want, got = ref(x), cpu_fused.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        assert (got.double() - exact).abs().max() <= 4 * (want.double() - exact).abs().max() + 1e-6
    else:                           # a rounding apart in float32 is at most one bfloat16 step apart
        step = 2.0 ** (torch.floor(torch.log2(want.double().abs().clamp_min(1e-30))) - 7)
        assert ((got.double() - want.double()).abs() <= step).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 8), (70, 576)])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype, rows, dim):
    x, delta = rand(rows, dim, dtype=dtype, scale=3), rand(rows, dim, dtype=dtype, seed=1)
    w = 1 + rand(dim, dtype=dtype, seed=2, scale=0.1)
    want_x = x + delta                                  # torch's add, rounded to dtype
    got = cpu_fused.add_rms_norm_(x, delta, w, 1e-5)
    assert torch.equal(x, want_x)                       # in place, bit for bit
    assert torch.equal(got, cpu_fused.rms_norm(want_x, w, 1e-5))     # the same norm as rms_norm's
    ref = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, ref(want_x), **tol)


def _silu_mul_float64(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    g, u = gate_up.double().split(inter, dim=-1)
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 3), (17, 64), (64, 1536)])
def test_silu_mul_matches_silu_times_up(dtype, rows, inter):
    gate_up = rand(rows, 2 * inter, dtype=dtype, scale=4)
    gate_up[0, :3] = torch.tensor([-100.0, 60.0, 0.0])        # far tails and zero
    got = cpu_fused.silu_mul(gate_up, inter)
    g, u = gate_up.split(inter, dim=-1)
    want = F.silu(g) * u                                # what FusedMLP computes with torch's ops
    assert got.dtype == dtype and got.shape == (rows, inter)
    if dtype == torch.float32:      # against float64: as close as torch's float32 ops, to a few ulps
        exact = _silu_mul_float64(gate_up, inter)
        err, ref_err = (got.double() - exact).abs(), (want.double() - exact).abs()
        assert (err <= 4 * ref_err + 4e-7 * exact.abs() + 1e-30).all()
    else:                           # one bfloat16 rounding of the SiLU, then one of the product
        step = 2.0 ** (torch.floor(torch.log2(want.double().abs().clamp_min(1e-30))) - 7)
        assert ((got.double() - want.double()).abs() <= 2 * step).all()
        if got.numel() > 64:                           # nearly always the same bfloat16
            assert (got == want).float().mean() > 0.97


def test_silu_mul_reads_strided_rows_and_keeps_nan_and_inf():
    wide = rand(9, 20, dtype=torch.float32, seed=4)
    gate_up = wide[:, :12]                                 # rows 20 apart, 12 used: inter 6
    got = cpu_fused.silu_mul(gate_up, 6)
    torch.testing.assert_close(got, F.silu(gate_up[:, :6]) * gate_up[:, 6:], rtol=1e-6, atol=1e-7)
    special = torch.tensor([[float("nan"), float("inf"), 1.0, 2.0, 1.0, 1.0]])
    out = cpu_fused.silu_mul(special, 3)
    assert out[0, 0].isnan() and out[0, 1] == float("inf")
    assert cpu_fused.silu_mul(torch.zeros(0, 8), 4).shape == (0, 4)


def test_rms_norm_of_a_zero_row_and_of_no_rows():
    out = cpu_fused.rms_norm(torch.zeros(2, 16), torch.ones(16), 1e-5)
    assert torch.equal(out, torch.zeros(2, 16))
    assert cpu_fused.rms_norm(torch.zeros(0, 16), torch.ones(16), 1e-5).shape == (0, 16)


def test_results_do_not_depend_on_the_thread_count():
    x, w = rand(4096, 64, dtype=torch.float32), rand(64, dtype=torch.float32, seed=1)
    q, k = rand(4096, 8, 64, dtype=torch.float32, seed=2), rand(4096, 2, 64, dtype=torch.float32, seed=3)
    cos, sin = rope_cos_sin(torch.arange(4096), 64, 10000.0, torch.float32)
    logits = [rand(64, 49152, dtype=dtype, seed=4) for dtype in (torch.float32, torch.bfloat16)]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            qq, kk, xx = q.clone(), k.clone(), x.clone()
            cpu_fused.rope_(qq, kk, cos, sin)
            normed = cpu_fused.add_rms_norm_(xx, q[:, 0].contiguous(), w, 1e-6)
            outs.append((cpu_fused.rms_norm(x, w, 1e-6), qq, kk, xx, normed,
                         cpu_fused.silu_mul(q.view(4096, 512), 256),
                         *(cpu_fused.argmax(lg) for lg in logits)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    # the argmax of SmolLM2-sized logits (64 x 49,152: enough to split over threads) is torch's too
    assert all(torch.equal(a, torch.max(lg, dim=-1).indices) for a, lg in zip(outs[1][-2:], logits))


def test_bad_inputs_are_refused_before_c_reads_them():
    x, w = torch.zeros(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_fused.rms_norm(x.double(), w.double(), 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_fused.rms_norm(x, w.to(torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused.rms_norm(torch.zeros(8, 4).T, w, 1e-5)
    with pytest.raises(ValueError, match="does not match"):
        cpu_fused.rms_norm(x, torch.ones(7), 1e-5)
    q, k = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    cos = sin = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        cpu_fused.rope_(q, k, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="inconsistent shapes"):
        cpu_fused.rope_(q, torch.zeros(3, 2, 6), cos, sin)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused.rope_(q.transpose(0, 1).contiguous().transpose(0, 1), k, cos, sin)
    with pytest.raises(ValueError, match="contiguous"):                # rows overlapping each other
        cpu_fused.rope_(q.flatten().as_strided((3, 4, 8), (16, 8, 1)), k, cos, sin)
    with pytest.raises(ValueError, match="contiguous"):                # cos may not be strided
        cpu_fused.rope_(q, k, torch.zeros(3, 16)[:, :8], sin)
    with pytest.raises(ValueError, match="do not match"):
        cpu_fused.add_rms_norm_(x, torch.zeros(4, 7), w, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused.add_rms_norm_(torch.zeros(8, 16)[:, :8], x, w, 1e-5)    # x is written whole
    with pytest.raises(ValueError, match=r"not \[N, 2 \* 3\]"):
        cpu_fused.silu_mul(torch.zeros(4, 8), 3)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_fused.silu_mul(torch.zeros(4, 8, dtype=torch.float64), 4)


@pytest.mark.parametrize("module,source",
                         [(m, m.SOURCE) for m in (cpu_fused, cpu_paged, skinny_gemm, layer_stack, int8_gemm,
                                                    greedy_head)]
                         + [(cpu_paged, cpu_paged.PROMPT_SOURCE)], ids=lambda x: getattr(x, "name", ""))
def test_c_sources_compile_cleanly_with_openmp(module, source, tmp_path):
    """``ckernels.build`` falls back to a build without ``-fopenmp`` when the first one fails, which
    would hide a mistake in an OpenMP pragma behind a slower single-threaded library: so compile each
    source once with OpenMP and every warning an error."""
    cc = ckernels.compiler()
    cmd = [*cc, *ckernels.FLAGS, *getattr(module, "EXTRA_FLAGS", ()), ckernels.OPENMP, "-Wall", "-Wextra",
           "-Werror", str(source), "-o", str(tmp_path / "lib.so"), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode and "openmp" in proc.stderr.lower() and "pragma" not in proc.stderr.lower():
        unavailable(f"{shlex.join(cc)} has no OpenMP: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr


def test_an_edited_header_rebuilds_the_kernels_that_include_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICB_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "h.h").write_text("static inline int seven(void) { return 7; }\n")
    src = tmp_path / "k.c"
    src.write_text('#include "h.h"\nint minicb_k(void) { return seven(); }\n')
    first = ckernels.build(src)
    assert ckernels.build(src) == first                                  # cached
    (tmp_path / "h.h").write_text("static inline int seven(void) { return 8; }\n")
    second = ckernels.build(src)
    assert second != first
    import ctypes
    assert ctypes.CDLL(str(second)).minicb_k() == 8


# --- the model ---------------------------------------------------------------------------------------
def test_fuse_elementwise_switches_classes_keeps_weights_and_logits():
    model = LlamaForCausalLM.random(TINY, seed=4, dtype=torch.float32, std=0.3)
    ref = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = TINY.num_hidden_layers
    assert cpu_fused.fuse_elementwise(model) == 2 * layers + 1 + layers + layers + layers
    assert cpu_fused.fuse_elementwise(model) == 0                         # idempotent
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.model.norm, cpu_fused.FusedRMSNorm)
    b = pack_prompts([[5, 9, 11, 4, 20], [7, 7, 30]])
    got = model(b.input_ids, b.positions, ReferenceAttention(None), b.attn)
    want = ref(b.input_ids, b.positions, ReferenceAttention(None), b.attn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        cpu_fused.fuse_elementwise(LlamaForCausalLM.random(TINY, seed=4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_engine_gives_the_reference_tokens(dtype):
    prompts = random_prompts(12, 3, 40, TINY.vocab_size, seed=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = LlamaForCausalLM.random(TINY, seed=5, dtype=dtype, std=0.3)
    fused = copy.deepcopy(ref)
    cpu_fused.fuse_elementwise(fused)
    runs = [[o.token_ids for o in LLM(m, dtype=dtype, max_num_seqs=5, max_num_batched_tokens=32,
                                      block_size=4, num_blocks=256).generate(prompts, params)]
            for m in (ref, fused)]
    same = sum(a == b for a, b in zip(*runs))
    assert same == len(prompts) if dtype == torch.float32 else same >= len(prompts) - 2, runs


def test_llm_fast_paths_for_a_loaded_model(monkeypatch, caplog):
    monkeypatch.setenv("MINICB_PACKED_LM_HEAD", "0")     # the packed head: tests/model/test_cpu_linear.py
    model = LlamaForCausalLM.random(TINY, seed=6, dtype=torch.float32)
    assert cpu_fast_paths(model, "cpu") == ["fused-ops"]
    assert type(model.model.layers[0].mlp) is cpu_fused.FusedMLP
    assert cpu_fast_paths(LlamaForCausalLM.random(TINY, dtype=torch.float64), "cpu") == []
    monkeypatch.setenv("MINICB_FUSED_OPS", "0")
    assert cpu_fast_paths(LlamaForCausalLM.random(TINY, dtype=torch.float32), "cpu") == []
    monkeypatch.delenv("MINICB_FUSED_OPS")
    monkeypatch.setattr(cpu_fused, "unavailable_reason", lambda: "no C compiler found (stand-in)")
    with caplog.at_level(logging.WARNING, logger="minicb"):
        plain = LlamaForCausalLM.random(TINY, dtype=torch.float32)
        assert cpu_fast_paths(plain, "cpu") == []
    assert type(plain.model.norm) is RMSNorm
    assert "fused CPU ops unavailable" in caplog.text and "stand-in" in caplog.text


SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-39, -1e-39, 1e-45, -1e-45, 3e38, -3e38, float("inf"), float("-inf"),
           float("nan"), -float("nan"), 2.5, -2.5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_argmax_is_torch_max_indices_with_ties_zeros_nans_and_denormals(dtype, seed):
    """``argmax``: the first maximum of each row, the first NaN where there is one, -0 equal to +0:
    ``torch.max``'s indices, on rows drawn mostly from a few special values (so ties, signed zeros,
    denormals, infinities and NaNs of both signs meet), and on a strided view of wider rows."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(SPECIAL + torch.randn(8, generator=g).tolist(), dtype=torch.float32)
    for rows, n in ((1, 1), (3, 7), (17, 64), (5, 4099)):
        x = pool[torch.randint(0, len(pool), (rows, n + 5), generator=g)].to(dtype)
        for row in x[: rows // 2]:                  # some rows without NaN, so a maximum must win
            row[row.isnan()] = -1.0
        view = x[:, 2:n + 2]
        assert torch.equal(cpu_fused.argmax(view), torch.max(view, dim=-1).indices), (rows, n)
        assert torch.equal(cpu_fused.argmax(x.contiguous()), torch.max(x, dim=-1).indices)
        # the sampler's hook: the same tokens, and unscorable_rows's answer from the same pass (rows
        # whose maximum is a NaN, +inf, or -inf because nothing else is there)
        x[rows - 1, :] = float("-inf")
        tokens, broken = cpu_fused.greedy_argmax(x)
        assert tokens == torch.max(x, dim=-1).indices.tolist()
        assert broken == unscorable_rows(x) == unscorable_rows(x.double()), (rows, n)
        assert rows - 1 in broken
    zeros = torch.tensor([[-1.0, -0.0, 0.0, -0.0], [-0.0, -1e-39, 0.0, 0.0]], dtype=dtype)   # -0 == +0
    assert cpu_fused.argmax(zeros).tolist() == torch.max(zeros, dim=-1).indices.tolist() == [1, 0]
    with pytest.raises(ValueError, match="not \\[rows, n > 0\\]"):
        cpu_fused.argmax(torch.zeros(2, 0, dtype=dtype))
