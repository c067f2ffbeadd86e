"""``minicb.fastpaths.cpu_linear``: bfloat16 linear layers computed in float32 (same values, float32
speed), and the LM head packed once for oneDNN (the same product to a float32 rounding)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import TINY, random_prompts
from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM, cpu_fast_paths
from minicb.fastpaths.cpu_linear import (
    Float32ComputeLinear,
    PackedLinear,
    can_pack,
    compute_linears_in_float32,
    needs_float32_compute,
    pack_lm_head,
)
from minicb.model.attention import ReferenceAttention
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.packer import pack_prompts
from preconditions import unavailable


def test_product_is_the_bfloat16_product_summed_in_float32():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(40, 24, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 40, generator=g))
    x = torch.randn(7, 40, generator=g).to(torch.bfloat16)
    fast = Float32ComputeLinear(lin)
    y = fast(x)
    assert y.dtype == torch.bfloat16 and fast.weight is lin.weight
    # widening is exact, so this is the float32 sum of the bfloat16 products, rounded once
    want = (x.double() @ lin.weight.double().T).to(torch.bfloat16)
    assert (y.double() - want.double()).abs().max() <= want.double().abs().max() * 2 ** -8
    assert torch.equal(y, F.linear(x.float(), lin.weight.float()).to(torch.bfloat16))


def test_model_swap_keeps_weights_and_tying():
    model = LlamaForCausalLM.random(TINY, seed=3, dtype=torch.bfloat16, std=0.3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = [5, 9, 11, 4, 20]
    b = pack_prompts([ids])
    native = model(b.input_ids, b.positions, ReferenceAttention(None), b.attn)
    assert compute_linears_in_float32(model) == 7 * TINY.num_hidden_layers + 1
    assert compute_linears_in_float32(model) == 0                         # idempotent
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight        # still tied
    mixed = model(b.input_ids, b.positions, ReferenceAttention(None), b.attn)
    ref = LlamaForCausalLM.random(TINY, seed=3, dtype=torch.float64, std=0.3)   # the same weights
    exact = ref(b.input_ids, b.positions, ReferenceAttention(None), b.attn)
    scale = exact.abs().max()
    # both bfloat16 runs are within bfloat16 noise of float64 and of each other
    assert (mixed.double() - exact).abs().max() < 0.05 * scale
    assert (mixed.double() - native.double()).abs().max() < 0.05 * scale


def test_when_it_applies():
    assert not needs_float32_compute(torch.float32, "cpu")
    assert not needs_float32_compute(torch.bfloat16, "cuda")
    import minicb.fastpaths.cpu_linear as mod

    assert needs_float32_compute(torch.bfloat16, "cpu") == (not mod.fast_bf16_matmul())


# --- the LM head packed once for oneDNN (PackedLinear) ---------------------------------------------------

@pytest.fixture
def packing():
    if not can_pack():
        unavailable("this torch has no oneDNN packed linear ops (torch.ops.mkldnn._reorder_linear_weight)")


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_packed_product_is_the_float32_product(packing, rows):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 1000, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1000, 96, generator=g) * 0.1)
    x = torch.randn(rows, 96, generator=g)
    packed = PackedLinear(lin)
    y = packed(x)
    assert y.shape == (rows, 1000) and y.dtype == torch.float32 and packed.weight is lin.weight
    exact = x.double() @ lin.weight.double().T        # oneDNN sums in its own order: a float32 rounding
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed(x.view(1, rows, 96)), y.view(1, rows, 1000))     # leading dims kept


def test_packed_bfloat16_head_rounds_the_float32_product(packing):
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 500, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(500, 64, generator=g))
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    y = PackedLinear(Float32ComputeLinear(lin))(x)
    assert y.dtype == torch.bfloat16
    want = (x.double() @ lin.weight.double().T).to(torch.bfloat16)
    # float32 sums in another order than MKL's, rounded once to bfloat16: at most one bfloat16 step apart
    assert (y.double() - want.double()).abs().max() <= want.double().abs().max() * 2 ** -7


def test_pack_lm_head_when_it_applies(packing, monkeypatch):
    f32 = LlamaForCausalLM.random(TINY, seed=4, dtype=torch.float32, std=0.3)
    before = {k: v.clone() for k, v in f32.state_dict().items()}
    b = pack_prompts([[5, 9, 11, 4, 20], [7, 3]])
    logits = f32(b.input_ids, b.positions, ReferenceAttention(None), b.attn)
    assert pack_lm_head(f32) and type(f32.lm_head) is PackedLinear
    assert not pack_lm_head(f32)                                          # idempotent
    assert f32.lm_head.weight is f32.model.embed_tokens.weight            # still tied
    after = f32.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    packed = f32(b.input_ids, b.positions, ReferenceAttention(None), b.attn)
    torch.testing.assert_close(packed, logits, rtol=1e-5, atol=1e-5)
    assert packed.argmax(-1).tolist() == logits.argmax(-1).tolist()

    assert not pack_lm_head(LlamaForCausalLM.random(TINY, dtype=torch.float64))     # no oneDNN float64
    bf16 = LlamaForCausalLM.random(TINY, dtype=torch.bfloat16)
    assert not pack_lm_head(bf16)                       # a bfloat16 product: not this path's business
    compute_linears_in_float32(bf16)
    assert pack_lm_head(bf16) and bf16.lm_head.weight is bf16.model.embed_tokens.weight
    monkeypatch.setenv("MINICB_PACKED_LM_HEAD", "0")
    assert not pack_lm_head(LlamaForCausalLM.random(TINY, dtype=torch.float32))


def test_llm_packs_the_head_of_a_float32_model_and_keeps_its_tokens(packing, monkeypatch):
    monkeypatch.setenv("MINICB_LINEAR", "mkl")          # the head alone (every layer: test_cpu_packed.py)
    prompts = random_prompts(10, 3, 30, TINY.vocab_size, seed=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = LlamaForCausalLM.random(TINY, seed=7, dtype=torch.float32, std=0.3)
    fast = copy.deepcopy(ref)
    assert "packed-lm-head" in cpu_fast_paths(fast, "cpu")
    runs = [[o.token_ids for o in LLM(m, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                                      num_blocks=256).generate(prompts, params)] for m in (ref, fast)]
    assert runs[0] == runs[1]
