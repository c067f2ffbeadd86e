"""``SamplingParams``' checks and normal forms (``core/sampling_params.py``), boundary by boundary."""

from __future__ import annotations

import numpy as np
import pytest

from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import MIN_TEMPERATURE, SamplingParams

MAX_INT = MAX_SEED = 2**63 - 1          # written out: a mutated constant in the module must not move the test


def test_defaults_are_greedy_and_unfiltered():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 0.0, 0, 1.0, None)
    assert p.greedy and p.stop_token_ids == () and p.ignore_eos is False
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


def test_max_tokens_from_one_to_the_64_bit_limit():
    assert SamplingParams(max_tokens=1).max_tokens == 1
    assert SamplingParams(max_tokens=MAX_INT).max_tokens == MAX_INT
    assert type(SamplingParams(max_tokens=np.int64(3)).max_tokens) is int
    for bad in (0, MAX_INT + 1, 2.0, True):
        with pytest.raises(InvalidArgument, match="max_tokens"):
            SamplingParams(max_tokens=bad)


def test_temperature_is_zero_or_at_least_the_smallest_usable_value():
    assert SamplingParams(temperature=0).temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    for bad in (MIN_TEMPERATURE / 2, 1e-300):
        with pytest.raises(InvalidArgument, match="temperature must be 0"):
            SamplingParams(temperature=bad)
    for bad in (-0.5, float("inf"), float("nan"), "1"):
        with pytest.raises(InvalidArgument, match="temperature"):
            SamplingParams(temperature=bad)
    assert type(SamplingParams(temperature=np.float32(0.5)).temperature) is float


def test_top_k_and_top_p_ranges():
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(top_k=MAX_INT).top_k == MAX_INT
    for bad in (-1, MAX_INT + 1):
        with pytest.raises(InvalidArgument, match="top_k"):
            SamplingParams(top_k=bad)
    assert SamplingParams(top_p=1.0).top_p == 1.0 and SamplingParams(top_p=1e-9).top_p == 1e-9
    for bad in (0.0, -0.1, 1.0001):
        with pytest.raises(InvalidArgument, match="top_p"):
            SamplingParams(top_p=bad)


def test_seeds_from_zero_to_the_generator_s_limit():
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=MAX_SEED).seed == MAX_SEED
    for bad in (-1, MAX_SEED + 1, 1.5):
        with pytest.raises(InvalidArgument, match="seed"):
            SamplingParams(seed=bad)


def test_stop_token_ids_become_a_tuple_of_non_negative_ints():
    p = SamplingParams(stop_token_ids=[5, np.int64(7)])
    assert p.stop_token_ids == (5, 7) and all(type(t) is int for t in p.stop_token_ids)
    assert SamplingParams(stop_token_ids=(0,)).stop_token_ids == (0,)
    for bad in ([-1], [MAX_INT + 1], [1.0]):
        with pytest.raises(InvalidArgument, match=r"stop_token_ids\[i\]"):
            SamplingParams(stop_token_ids=bad)
    for bad in (5, "5", {5}):
        with pytest.raises(InvalidArgument, match="stop_token_ids must be a tuple"):
            SamplingParams(stop_token_ids=bad)


def test_ignore_eos_is_a_bool():
    assert SamplingParams(ignore_eos=True).ignore_eos is True
    for bad in (1, "yes", None):
        with pytest.raises(InvalidArgument, match="ignore_eos must be a bool"):
            SamplingParams(ignore_eos=bad)
