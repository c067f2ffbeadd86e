"""The flat forward: several sequences at once equal each alone and the padded forward (float64)."""

import pytest
import torch

from minicb.config import ModelConfig
from minicb.model.attention import ReferenceAttention, StaticCacheAttention, StaticMeta
from minicb.model.llama import LlamaForCausalLM
from minicb.packer import pack_prompts


def tiny_config(group: int, **kw) -> ModelConfig:
    kv = 2
    return ModelConfig(vocab_size=97, hidden_size=16 * group * kv // 2 if group > 1 else 32,
                       intermediate_size=48, num_hidden_layers=2, num_attention_heads=kv * group,
                       num_key_value_heads=kv, head_dim=8, rope_theta=10000.0, **kw)


def run_flat(model, prompts):
    b = pack_prompts(prompts)
    return model(b.input_ids, b.positions, ReferenceAttention(None), b.attn, b.logits_indices)


def run_padded(model, prompts):
    cfg = model.config
    bsz, t = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(bsz, t, dtype=torch.long)
    valid = torch.ones(bsz, t, dtype=torch.bool)
    pos = torch.zeros(bsz, t, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, t - len(p):] = torch.tensor(p)
        valid[r, : t - len(p)] = False
        pos[r, t - len(p):] = torch.arange(len(p))
    backend = StaticCacheAttention(cfg.num_hidden_layers, bsz, t, cfg.num_key_value_heads, cfg.head_dim,
                                   model.dtype)
    logits = model(ids.flatten(), pos.flatten(), backend, StaticMeta(bsz, t, 0, valid))
    logits = logits.view(bsz, t, -1)
    return [logits[r, t - len(p):] for r, p in enumerate(prompts)]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_flat_equals_alone_and_padded(group, tied):
    cfg = tiny_config(group, tie_word_embeddings=tied)
    model = LlamaForCausalLM.random(cfg, seed=group)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 1, 17, 9)]
    flat = run_flat(model, prompts)
    padded = run_padded(model, prompts)
    off = 0
    for p, pad in zip(prompts, padded):
        alone = run_flat(model, [p])
        mine = flat[off: off + len(p)]
        off += len(p)
        assert (mine - alone).abs().max() < 1e-9
        assert (mine - pad).abs().max() < 1e-9
    # and the check is not vacuous: different prompts give different logits
    assert (flat[:5] - flat[6:11]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_close_to_float64(dtype):
    cfg = tiny_config(3)
    ref = LlamaForCausalLM.random(cfg, seed=1)
    low = LlamaForCausalLM.random(cfg, seed=1, dtype=dtype)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    a, b = run_flat(ref, prompts), run_flat(low, prompts).to(torch.float64)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (a - b).abs().max() / a.abs().max() < tol
