"""``minicb.model.cpu_linear``: bfloat16 linear layers computed in float32 (same values, float32 speed)."""

import torch
import torch.nn.functional as F
from torch import nn

from helpers import TINY
from minicb.model.attention import ReferenceAttention
from minicb.model.cpu_linear import Float32ComputeLinear, compute_linears_in_float32, needs_float32_compute
from minicb.model.llama import LlamaForCausalLM
from minicb.packer import pack_prompts


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
    import minicb.model.cpu_linear as mod

    assert needs_float32_compute(torch.bfloat16, "cpu") == (not mod.fast_bf16_matmul())
