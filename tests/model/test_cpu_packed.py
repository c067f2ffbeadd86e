"""``minicb.fastpaths.cpu_linear``: every linear layer packed for oneDNN (q/k/v and gate/up stacked), in
float32 and bfloat16, and the choice of path at load (``choose_path``, ``MINICB_LINEAR``)."""

import copy
import logging

import pytest
import torch
from torch import nn

from helpers import TINY, random_prompts
from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM, cpu_fast_paths
from minicb.fastpaths import cpu_fused, skinny_gemm
from minicb.fastpaths import cpu_linear as cl
from minicb.model.attention import ReferenceAttention
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.packer import pack_prompts
from preconditions import unavailable


@pytest.fixture(autouse=True)
def packing(monkeypatch):
    if not cl.can_pack():
        unavailable("this torch has no oneDNN packed linear ops (torch.ops.mkldnn._reorder_linear_weight)")
    monkeypatch.delenv("MINICB_LINEAR", raising=False)
    monkeypatch.delenv("MINICB_PACKED_LM_HEAD", raising=False)
    monkeypatch.delenv("MINICB_SKINNY_ROWS", raising=False)


def _linear(out_f: int, in_f: int, seed: int, dtype=torch.float32) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.2)
    return lin.to(dtype)


def _bf16_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the bfloat16 values and how far a correct bfloat16 result may be from it:
    one rounding of the output (unit roundoff 2^-8 of its size) plus float32 summation error (k * 2^-24 of
    the sum of the products' sizes, generous)."""
    exact = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    return exact, exact.abs() * 2 ** -8 + size * x.shape[-1] * 2 ** -24


def _refused_without_bf16_products(make) -> bool:
    """On a CPU where oneDNN has no bfloat16 products, ``make()`` (packing a bfloat16 weight) must be
    refused with the reason, and the caller's test ends there (True); elsewhere False."""
    if cl.no_bf16_packing_reason() is None:
        return False
    with pytest.raises(ValueError, match="cannot pack a bfloat16 weight: oneDNN has no bfloat16 products"):
        make()
    return True


def _bf16_compute() -> torch.dtype:
    """What a bfloat16 model is packed in here: bfloat16 where oneDNN has its products, else float32."""
    return torch.bfloat16 if cl.no_bf16_packing_reason() is None else torch.float32


@pytest.mark.parametrize("rows", [0, 1, 5, 16, 64, 300])
def test_float32_packed_products_match_float64(rows):
    lin = _linear(200, 48, seed=rows)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(100 + rows))
    y = cl.PackedLinear(lin)(x)
    assert y.shape == (rows, 200) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ lin.weight.double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_bfloat16_packed_products_are_one_rounding_from_float64(rows, compute):
    lin = _linear(200, 48, seed=rows, dtype=torch.bfloat16)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(7 + rows)).to(torch.bfloat16)
    if compute == torch.bfloat16 and _refused_without_bf16_products(lambda: cl.PackedLinear(lin, compute)):
        return
    packed = cl.PackedLinear(lin, compute)
    assert packed.compute_dtype == compute and packed.weight is lin.weight
    y = packed(x)
    assert y.dtype == torch.bfloat16
    exact, bound = _bf16_bound(x, lin.weight)
    assert ((y.double() - exact).abs() <= bound).all()


def test_a_float32_layer_keeps_float32_products():
    assert cl.PackedLinear(_linear(8, 8, 0), torch.bfloat16).compute_dtype == torch.float32
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cl.PackedLinear(_linear(8, 8, 0, torch.float64))


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_stacked_projections_are_the_layers_side_by_side(compute):
    dtype = torch.bfloat16 if compute == torch.bfloat16 else torch.float32
    layers = [_linear(n, 40, seed=n, dtype=dtype) for n in (24, 8, 8)]
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    if compute == torch.bfloat16 and _refused_without_bf16_products(
            lambda: cl.PackedProjections(layers, compute)):
        return
    stacked = cl.PackedProjections(layers, compute)
    y = stacked(x)
    assert stacked.sizes == [24, 8, 8] and y.shape == (9, 40) and list(stacked.state_dict()) == []
    for part, lin in zip(y.split(stacked.sizes, dim=-1), layers):
        exact, bound = _bf16_bound(x, lin.weight)
        if dtype == torch.float32:
            torch.testing.assert_close(part.double(), exact, rtol=1e-5, atol=1e-5)
        else:
            assert ((part.double() - exact).abs() <= bound).all()
    with pytest.raises(ValueError, match="one input size"):
        cl.PackedProjections([_linear(4, 8, 0), _linear(4, 6, 0)])


def _logits(model, prompts):
    b = pack_prompts(prompts)
    return model(b.input_ids, b.positions, ReferenceAttention(None), b.attn)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_linears_keeps_weights_tying_and_logits(dtype, keep):
    model = LlamaForCausalLM.random(TINY, seed=3, dtype=dtype, std=0.3)
    exact_model = LlamaForCausalLM.random(TINY, seed=3, dtype=torch.float64, std=0.3)   # same weights
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [[5, 9, 11, 4, 20], [7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    reference = _logits(model, prompts)
    # bfloat16 products where oneDNN has them; on a CPU without, a bfloat16 model is packed in float32
    compute = _bf16_compute() if dtype == torch.bfloat16 else torch.float32
    assert cl.pack_linears(model, compute, keep_unpacked=keep) == 4 * TINY.num_hidden_layers + 1
    assert cl.pack_linears(model, compute, keep_unpacked=keep) == 0        # idempotent
    after = model.state_dict()
    # kept: the state_dict as it was; dropped: everything but the layers' projections, unchanged
    kept = before.keys() if keep else {k for k in before if k.split(".")[-2] not in PROJECTIONS}
    assert after.keys() == kept and all(torch.equal(before[k], after[k]) for k in kept)
    assert model.lm_head.weight is model.model.embed_tokens.weight       # still tied
    assert cl.linear_path(model) == ("onednn-bf16" if compute == torch.bfloat16 else "onednn-f32")
    packed = _logits(model, prompts)
    exact = _logits(exact_model, prompts)
    if dtype == torch.float32:
        torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed.double(), exact, rtol=1e-4, atol=1e-4)
    else:      # both bfloat16 runs are within bfloat16 noise of float64 and of each other
        scale = exact.abs().max()
        assert (packed.double() - exact).abs().max() < 0.05 * scale
        assert (packed.double() - reference.double()).abs().max() < 0.05 * scale


def test_packing_after_the_fused_ops_keeps_both():
    model = LlamaForCausalLM.random(TINY, seed=2, dtype=torch.float32, std=0.3)
    if cpu_fused.unavailable_reason() is not None:
        unavailable(f"the fused CPU ops: {cpu_fused.unavailable_reason()}")
    plain = copy.deepcopy(model)
    cpu_fused.fuse_elementwise(model)
    cl.pack_linears(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn, cpu_fused.FusedAttention) and isinstance(attn, cl.PackedQKV)
    assert isinstance(mlp, cpu_fused.FusedMLP) and isinstance(mlp, cl.PackedGateUp)
    torch.testing.assert_close(_logits(model, [[4, 5, 6, 7]]), _logits(plain, [[4, 5, 6, 7]]),
                               rtol=1e-4, atol=1e-4)


def test_choose_path(monkeypatch):
    assert cl.choose_path(torch.float64)[0] == "torch"
    monkeypatch.setattr(cl, "onednn_speedup", lambda *a, **k: 2.5)    # the micro-check, stood in
    path, why = cl.choose_path(torch.float32)
    assert path == "onednn-f32" and "2.50x" in why
    for skinny_rows, tie in ((0, "mkl"), (16, "onednn-f32")):      # a near tie: the skinny kernel decides
        monkeypatch.setattr(cl.skinny_gemm, "choose_rows", lambda d, s=None, r=skinny_rows: (r, "stood in"))
        monkeypatch.setattr(cl, "onednn_speedup", lambda *a, **k: 1.0)
        assert cl.choose_path(torch.float32)[0] == tie
        monkeypatch.setattr(cl, "onednn_speedup", lambda *a, **k: 0.8)
        path, why = cl.choose_path(torch.float32)
        assert path == "mkl" and "0.80x" in why and ("skinny" in why) == bool(skinny_rows)
    monkeypatch.setattr(cl, "fast_bf16_matmul", lambda: False)
    assert cl.choose_path(torch.bfloat16)[0] == "mkl"                 # no bf16 instructions, MKL faster
    monkeypatch.setattr(cl, "fast_bf16_matmul", lambda: True)
    assert cl.choose_path(torch.bfloat16)[0] == "onednn-bf16"
    monkeypatch.setenv("MINICB_PACKED_LM_HEAD", "0")
    assert cl.choose_path(torch.bfloat16)[0] == "mkl"
    for path in cl.PATHS:
        monkeypatch.setenv("MINICB_LINEAR", path)
        assert cl.choose_path(torch.float32) == (path, f"MINICB_LINEAR={path}")
    monkeypatch.setenv("MINICB_LINEAR", "fast")
    with pytest.raises(ValueError, match="MINICB_LINEAR"):
        cl.choose_path(torch.float32)


def test_the_micro_check_measures_both_products():
    calls = []
    real = cl._packed_matmul

    def counting(*args):
        calls.append(1)
        return real(*args)

    cl.onednn_speedup.cache_clear()
    try:
        cl._packed_matmul = counting
        ratio = cl.onednn_speedup(32, 48, rows=4, rounds=3)
    finally:
        cl._packed_matmul = real
        cl.onednn_speedup.cache_clear()
    assert ratio > 0 and len(calls) == 1 + 3 * 3        # one warm-up, then 3 calls in each of 3 rounds


@pytest.mark.parametrize("path,dtype,want", [
    ("torch", torch.float32, []), ("mkl", torch.float32, ["packed-lm-head"]),
    ("onednn-f32", torch.float32, ["packed-linears-f32"]),
    ("onednn-bf16", torch.float32, ["packed-linears-f32"]),         # float32 products stay float32
    ("torch", torch.bfloat16, []), ("mkl", torch.bfloat16, ["float32-linears", "packed-lm-head"]),
    ("onednn-f32", torch.bfloat16, ["packed-linears-f32"]),
    ("onednn-bf16", torch.bfloat16, ["packed-linears-bf16"]),
    ("onednn-bf16", torch.float64, []),                             # float64: no oneDNN GEMM
])
def test_apply_path(path, dtype, want):
    model = LlamaForCausalLM.random(TINY, seed=1, dtype=dtype)
    if path == "onednn-bf16" and dtype == torch.bfloat16 and cl.no_bf16_packing_reason():
        with pytest.raises(ValueError, match="cannot pack a bfloat16 weight: oneDNN has no bfloat16"):
            cl.apply_path(model, path)          # a CPU without them: refused, and the model left as it was
        assert cl.linear_path(model) == "torch"
        return
    assert cl.apply_path(model, path) == want
    expected = {"onednn-bf16": "onednn-f32"} if dtype == torch.float32 else {}
    assert cl.linear_path(model) == (expected.get(path, path) if dtype != torch.float64 else "torch")


@pytest.mark.parametrize("path", ["mkl", "onednn-f32", "onednn-bf16"])
def test_llm_float32_tokens_unchanged_on_every_path(path, monkeypatch):
    prompts = random_prompts(10, 3, 30, TINY.vocab_size, seed=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = LlamaForCausalLM.random(TINY, seed=7, dtype=torch.float32, std=0.3)
    fast = copy.deepcopy(ref)
    monkeypatch.setenv("MINICB_LINEAR", path)
    applied = cpu_fast_paths(fast, "cpu")
    assert cl.linear_path(fast) == ("mkl" if path == "mkl" else "onednn-f32"), applied
    runs = [[o.token_ids for o in LLM(m, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                                      num_blocks=256).generate(prompts, params)] for m in (ref, fast)]
    assert runs[0] == runs[1]


def test_llm_bfloat16_tokens_on_native_bfloat16(monkeypatch):
    """Where oneDNN has bfloat16 products, on them; on a CPU without, pinning them is refused with the
    reason, and the bfloat16 model's float32 products (with the skinny kernel's bfloat16 panels for the
    steps of few rows, as ``LLM()`` gives them) stand in."""
    prompts = random_prompts(12, 3, 30, TINY.vocab_size, seed=5)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = LlamaForCausalLM.random(TINY, seed=8, dtype=torch.bfloat16, std=0.3)
    fast = copy.deepcopy(ref)
    path = "onednn-bf16" if cl.no_bf16_packing_reason() is None else "onednn-f32"
    if path == "onednn-f32":
        monkeypatch.setenv("MINICB_LINEAR", "onednn-bf16")
        refused = copy.deepcopy(ref)
        with pytest.raises(ValueError, match="MINICB_LINEAR=onednn-bf16: oneDNN has no bfloat16 products"):
            cpu_fast_paths(refused, "cpu")
        assert [type(m) for m in refused.modules()] == [type(m) for m in ref.modules()]   # left as it was
    monkeypatch.setenv("MINICB_LINEAR", path)
    cpu_fast_paths(fast, "cpu")
    assert cl.linear_path(fast) == path
    runs = [[o.token_ids for o in LLM(m, dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=32,
                                      block_size=4, num_blocks=256).generate(prompts, params)]
            for m in (ref, fast)]
    # bfloat16 sums in another order can flip a near-tie: most requests agree token for token
    assert sum(a == b for a, b in zip(*runs)) >= len(prompts) - 3, runs


@pytest.mark.parametrize("rows, says", [
    ("8", "; steps of up to 8 rows on the skinny kernel (MINICB_SKINNY_ROWS=8)"),
    ("0", "; no skinny kernel (MINICB_SKINNY_ROWS=0)")])
def test_one_logged_line_per_load_names_the_path(monkeypatch, caplog, rows, says):
    if rows != "0" and skinny_gemm.unavailable_reason():
        unavailable(f"the skinny kernel: {skinny_gemm.unavailable_reason()}")
    monkeypatch.setenv("MINICB_LINEAR", "onednn-f32")
    monkeypatch.setenv("MINICB_SKINNY_ROWS", rows)
    with caplog.at_level(logging.INFO, logger="minicb"):
        for _ in range(2):
            cpu_fast_paths(LlamaForCausalLM.random(TINY, dtype=torch.float32), "cpu")
    lines = [r.getMessage() for r in caplog.records if "linear layers on" in r.getMessage()]
    assert lines == ["minicb: float32 linear layers on onednn-f32: MINICB_LINEAR=onednn-f32" + says] * 2


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_drops_the_unpacked_weights(dtype, tied):
    """After packing, the layers' weights live once, packed: what is left unpacked is the embedding,
    the norms and, untied, nothing of the LM head; the logits are the reference's (float32: to float32
    rounding, as ``bench/agreement.py``'s 16/16; bfloat16: within bfloat16 noise)."""
    import dataclasses

    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = LlamaForCausalLM.random(cfg, seed=4, dtype=dtype, std=0.3)
    plain = copy.deepcopy(model)
    cl.pack_linears(model, _bf16_compute() if dtype == torch.bfloat16 else dtype)
    h, v = cfg.hidden_size, cfg.vocab_size
    norms = (2 * cfg.num_hidden_layers + 1) * h
    left = v * h + norms              # the embedding and the norms; an untied head's weight is dropped
    assert _param_bytes(model) == left * dtype.itemsize < _param_bytes(plain)
    assert not [n for n, _ in model.named_parameters() if n.split(".")[-2] in PROJECTIONS]
    assert (getattr(model.lm_head, "weight", None) is model.model.embed_tokens.weight) == tied
    prompts = [[5, 9, 11, 4, 20], [7, 3, 8]]
    packed, reference = _logits(model, prompts), _logits(plain, prompts)
    if dtype == torch.float32:
        torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-4)
    else:
        assert (packed.double() - reference.double()).abs().max() < 0.05 * reference.double().abs().max()
