"""``ModelConfig``'s checks (``core/config.py``): every shape rule refuses what breaks it and accepts its
boundary. The values are the rules' edges worked out by hand (a LLaMA head needs an even head_dim for
RoPE's pairs; query heads come in whole groups per KV head)."""

from __future__ import annotations

import dataclasses

import pytest

from minicb.core.config import ModelConfig
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
