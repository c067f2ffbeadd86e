"""``ModelConfig``'s and ``SchedulerConfig``'s checks (``core/config.py``): every rule refuses what
breaks it and accepts its boundary. The values are the rules' edges worked out by hand (a LLaMA head
needs an even head_dim for RoPE's pairs; query heads come in whole groups per KV head)."""

from __future__ import annotations

import dataclasses

import pytest

from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.errors import InvalidArgument

BASE = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def model(**kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **kw})


def test_the_base_config_and_its_derived_head_dim():
    c = model()
    assert c.head_dim == 8                                  # hidden_size / num_attention_heads
    assert model(head_dim=6).head_dim == 6                  # an explicit head_dim is kept


@pytest.mark.parametrize("name", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"])
def test_every_size_must_be_at_least_one(name):
    with pytest.raises(InvalidArgument, match=name):
        model(**{name: 0})
    with pytest.raises(InvalidArgument, match=name):
        model(**{name: 2.0})


def test_query_heads_come_in_whole_groups_per_kv_head():
    with pytest.raises(InvalidArgument, match="multiple of num_key_value_heads"):
        model(num_attention_heads=4, num_key_value_heads=3)
    assert model(num_attention_heads=4, num_key_value_heads=4).num_key_value_heads == 4
    assert model(num_attention_heads=4, num_key_value_heads=1).num_key_value_heads == 1


def test_hidden_size_must_split_into_the_heads_when_head_dim_is_derived():
    with pytest.raises(InvalidArgument, match="hidden_size must be divisible"):
        model(hidden_size=30)
    assert model(hidden_size=30, head_dim=8).head_dim == 8  # an explicit head_dim needs no split


def test_head_dim_must_be_even_and_at_least_two():
    with pytest.raises(InvalidArgument, match="head_dim must be even"):
        model(head_dim=7)
    with pytest.raises(InvalidArgument, match="head_dim"):
        model(head_dim=0)
    with pytest.raises(InvalidArgument, match="head_dim"):
        model(hidden_size=4)                                 # 4 heads of width 1
    assert model(head_dim=2).head_dim == 2
    assert model(hidden_size=8).head_dim == 2


@pytest.mark.parametrize("theta, ok", [(1.0, False), (1.0001, True), (1e12, True), (1e13, False),
                                       (float("inf"), False), (float("nan"), False)])
def test_rope_theta_bounds(theta, ok):
    if ok:
        assert model(rope_theta=theta).rope_theta == theta
    else:
        with pytest.raises(InvalidArgument, match="rope_theta"):
            model(rope_theta=theta)


@pytest.mark.parametrize("eps, ok", [(0.0, True), (1e-6, True), (1.0, True), (1.5, False), (-1e-9, False)])
def test_rms_norm_eps_bounds(eps, ok):
    if ok:
        assert model(rms_norm_eps=eps).rms_norm_eps == eps
    else:
        with pytest.raises(InvalidArgument, match="rms_norm_eps"):
            model(rms_norm_eps=eps)


@pytest.mark.parametrize("name", ["bos_token_id", "eos_token_id"])
def test_special_token_ids_are_optional_non_negative_integers(name):
    assert getattr(model(**{name: None}), name) is None
    assert getattr(model(**{name: 0}), name) == 0
    for bad in (-1, 1.5):
        with pytest.raises(InvalidArgument, match=name):
            model(**{name: bad})


def test_num_params_counts_the_embedding_once_when_tied():
    c = model()
    h, i, d, v, layers = 32, 64, 8, 61, 2
    attn = h * d * (4 * 2 + 2 * 2)
    per_layer = attn + 3 * h * i + 2 * h
    tied = layers * per_layer + v * h + h
    assert c.num_params == tied
    assert dataclasses.replace(c, tie_word_embeddings=False).num_params == tied + v * h


def test_flops_per_token_is_twice_the_matmul_weights_plus_attention():
    c = model()
    h, v, layers, heads, d = 32, 61, 2, 4, 8
    body = c.num_params - v * h                             # without the (tied) embedding ...
    matmuls = body + v * h                                  # ... but with the LM head's matmul
    assert c.flops_per_token() == 2.0 * matmuls
    assert c.flops_per_token(10) == 2.0 * matmuls + 4 * layers * heads * d * 10
    untied = dataclasses.replace(c, tie_word_embeddings=False)
    assert untied.flops_per_token() == c.flops_per_token()  # the lookup table is no matmul


# --- SchedulerConfig -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, lo", [("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("block_size", 1),
                                      ("num_blocks", 1), ("num_host_blocks", 0), ("max_model_len", 1),
                                      ("priority_aging", 0)])
def test_scheduler_limits_and_their_lowest_values(name, lo):
    kw = dict(max_num_seqs=1, num_blocks=1) if name in ("max_num_seqs", "num_blocks") else {}
    assert getattr(SchedulerConfig(**{**kw, name: lo}), name) == lo
    with pytest.raises(InvalidArgument, match=name):
        SchedulerConfig(**{**kw, name: lo - 1})


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks",
                                  "num_host_blocks", "max_model_len", "priority_aging", "long_prefill_chunk",
                                  "max_prefill_tokens_while_decoding"])
@pytest.mark.parametrize("bad", [2.5, "4", True])
def test_every_limit_must_be_an_integer(name, bad):
    with pytest.raises(InvalidArgument, match=name):
        SchedulerConfig(**{name: bad})


def test_integers_of_other_types_are_stored_as_plain_ints():
    import numpy as np

    c = SchedulerConfig(max_num_seqs=np.int64(4), block_size=np.int32(8))
    assert type(c.max_num_seqs) is int and type(c.block_size) is int and c.max_num_seqs == 4


def test_the_prefill_chunk_lies_between_one_and_the_step_budget():
    assert SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=64).chunk_cap == 64
    assert SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=1).chunk_cap == 1
    assert SchedulerConfig(max_num_batched_tokens=64).chunk_cap == 64
    for bad in (0, 65):
        with pytest.raises(InvalidArgument, match="long_prefill_chunk"):
            SchedulerConfig(max_num_batched_tokens=64, long_prefill_chunk=bad)


def test_the_stall_free_cap_is_a_positive_count_and_zero_turns_it_off():
    import numpy as np

    assert SchedulerConfig().max_prefill_tokens_while_decoding is None              # off unless asked
    assert SchedulerConfig(max_prefill_tokens_while_decoding=0).max_prefill_tokens_while_decoding is None
    c = SchedulerConfig(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=np.int64(100))
    assert c.max_prefill_tokens_while_decoding == 100       # above the budget: allowed (the budget binds)
    assert type(c.max_prefill_tokens_while_decoding) is int
    with pytest.raises(InvalidArgument, match="max_prefill_tokens_while_decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=-1)
    assert SchedulerConfig(prefill_tokens_per_seq=np.int32(4)).prefill_tokens_per_seq == 4
    for bad in (-1, 1.5, None):
        with pytest.raises(InvalidArgument, match="prefill_tokens_per_seq"):
            SchedulerConfig(prefill_tokens_per_seq=bad)


@pytest.mark.parametrize("name, good, bad", [
    ("policy", "static", "lifo"), ("preemption_mode", "swap", "drop"),
    ("scheduling_policy", "priority", "random"), ("enable_prefix_caching", False, 1),
])
def test_the_named_choices(name, good, bad):
    assert getattr(SchedulerConfig(**{name: good}), name) == good
    for wrong in (bad, None):
        with pytest.raises(InvalidArgument, match=name):
            SchedulerConfig(**{name: wrong})


def test_the_pool_needs_a_block_per_slot():
    assert SchedulerConfig(max_num_seqs=4, num_blocks=4).num_blocks == 4
    with pytest.raises(InvalidArgument, match="num_blocks must be at least max_num_seqs"):
        SchedulerConfig(max_num_seqs=4, num_blocks=3)


def test_prefix_caching_is_in_effect_only_for_the_continuous_policy():
    assert SchedulerConfig().prefix_caching is True
    assert SchedulerConfig(enable_prefix_caching=False).prefix_caching is False
    assert SchedulerConfig(policy="dynamic").prefix_caching is False
    assert SchedulerConfig(policy="static").prefix_caching is False
