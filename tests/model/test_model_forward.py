"""The flat forward: several sequences at once equal each alone and the padded forward (float64)."""

import pytest
import torch

from minicb.core.config import ModelConfig
from minicb.model.attention import ReferenceAttention, StaticCacheAttention, StaticMeta
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.packer import pack_prompts


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


def _naive_attention(q, kc, vc, table, start, n, block_size):
    """One sequence by the textbook formula: its keys read slot by slot, causal, GQA by repetition."""
    ctx = start + n
    slots = [table[j // block_size] * block_size + j % block_size for j in range(ctx)]
    k, v = kc[slots], vc[slots]                                   # [ctx, Hkv, D]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    allowed = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_reference_groups_decodes_by_context_and_never_pads_prompt_chunks():
    """A mixed step: three decodes (contexts 5, 6, 300) and two prompt chunks (7 new tokens, and 20 after
    16 cached). Decodes of similar context share a padded group, each chunk is a group of its own with
    exactly its own queries, and every row equals the textbook attention over its keys."""
    from minicb.model.attention import AttentionMetadata
    from minicb.model.kv_cache import KVCache

    bs, hkv, hq, d = 4, 2, 6, 8
    g = torch.Generator().manual_seed(0)
    cache = KVCache(1, 128, bs, hkv, d, dtype=torch.float64)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g, dtype=torch.float64))
    starts, q_lens = [4, 5, 299, 0, 16], [1, 1, 1, 7, 20]
    tables, free = [], iter(torch.randperm(128, generator=g).tolist())
    for s, n in zip(starts, q_lens):
        tables.append([next(free) for _ in range(-(-(s + n) // bs))])
    width = max(map(len, tables))
    slot_mapping = [tables[i][p // bs] * bs + p % bs
                    for i, (s, n) in enumerate(zip(starts, q_lens)) for p in range(s, s + n)]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = [s + n for s, n in zip(starts, q_lens)]
    meta = AttentionMetadata(
        cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, *torch.tensor(ctx).cumsum(0).tolist()]).int(),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx), start_pos=torch.tensor(starts),
        context_lens=torch.tensor(ctx, dtype=torch.int32), slot_mapping=torch.tensor(slot_mapping),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=bs, q_lens=tuple(q_lens), start_positions=tuple(starts))
    backend = ReferenceAttention(cache)
    state = backend.prepare(meta)
    shapes = sorted((tuple(gr.q_index.shape), tuple(gr.key_index.shape)) for gr in state.groups)
    assert shapes == [((1, 1), (1, 300)), ((1, 7), (1, 7)), ((1, 20), (1, 36)), ((2, 1), (2, 6))]

    n = sum(q_lens)
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    out = backend.attend(0, q, k, v, state)
    kc, vc = cache.layer(0)                       # now holding this step's K/V as well
    assert torch.equal(kc[slot_mapping], k)
    for i, (s, m) in enumerate(zip(starts, q_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        expected = _naive_attention(q[rows], kc, vc, tables[i], s, m, bs)
        assert (out[rows] - expected).abs().max() < 1e-12


def test_folded_mask_gives_the_same_attention():
    from minicb.model.attention import fold_mask, grouped_sdpa

    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 5, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3, 9, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(3, 9, 2, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, 9, generator=g) < 0.6
    mask[..., 0] = True                            # every query sees at least one key
    folded = fold_mask(mask, 3, torch.float64)
    assert folded.shape == (3, 1, 15, 9)
    assert torch.equal(folded.isfinite()[:, 0, :5], mask[:, :, :])     # head 0 of each group
    assert torch.equal(grouped_sdpa(q, k, v, mask), grouped_sdpa(q, k, v, folded))
