"""Inputs at the edges of the Python API (issue 17): values that mean nothing are refused with
``InvalidArgument``, numbers are accepted in whatever scalar type they come (numpy, torch), one
request's extreme values or one row's broken logits never fail another request, and text is bounded
before the tokenizer library sees it.

* ``SamplingParams``: a temperature between 0 and ``MIN_TEMPERATURE`` (1e-320 used to be accepted and
  then failed every request of its step), ``10**400`` (used to raise ``OverflowError``), numpy
  ``float32`` / ``int64`` and 0-d tensors (used to be refused) normalised to plain Python numbers;
* the sampler: every row is sampled on its own from a distribution that is valid by construction;
  a row of NaN or infinite logits (hypothesis draws them) neither raises nor changes any other row's
  token, and inside the engine the other requests of the step finish token for token as alone;
* token ids: ``torch.tensor(True)`` and ``numpy.True_`` are not token ids; ``arrival_time`` must be a
  finite real number;
* text: a lone surrogate (undecodable bytes) is ``InvalidArgument``, not the tokenizer's
  ``TypeError``; text too long to encode, or too long to fit ``max_model_len``, is refused before
  encoding;
* the last partial UTF-8 character of a request cut by ``max_tokens`` is kept in its final text.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import TINY, tiny_model
from hypothesis_profiles import examples
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import MIN_TEMPERATURE, SamplingParams
from minicb.engine.llm_engine import LLMEngine
from minicb.entrypoints.llm import LLM
from minicb.model.text.tokenizer import MAX_TEXT_CHARS, Tokenizer
from minicb.runtime.runner import engine_for
from minicb.runtime.sampling import Sampler
from tokenizer_fixtures import tiny_gguf_tokenizer_metadata

V = TINY.vocab_size


def engine(**config) -> LLMEngine:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64, max_model_len=256)
    return engine_for(tiny_model(), SchedulerConfig(**{**base, **config}))


# --- SamplingParams: meaningless values refused, every scalar type accepted ---------------------------------
@pytest.mark.parametrize("t", [1e-320, 5e-324, 1e-6, MIN_TEMPERATURE / 2])
def test_a_temperature_too_small_to_sample_with_is_refused(t):
    with pytest.raises(InvalidArgument, match=r"temperature must be 0 \(greedy\) or at least 1e-05"):
        SamplingParams(temperature=t)


@pytest.mark.parametrize("value", [10**400, -(10**400), math.inf, float("nan"), 10**5000],
                         ids=["10**400", "-10**400", "inf", "nan", "10**5000"])
def test_a_temperature_beyond_floats_is_invalid_argument_not_overflow(value):
    with pytest.raises(InvalidArgument, match="temperature must be a finite number") as e:
        SamplingParams(temperature=value)
    assert len(str(e.value)) < 200          # 10**5000 is described by its size, not printed


def test_huge_integers_are_reported_not_printed():
    with pytest.raises(InvalidArgument, match="about 5001 digits"):
        SamplingParams(max_tokens=10**5000)
    with pytest.raises(InvalidArgument, match="seed"):
        SamplingParams(seed=10**23)


@pytest.mark.parametrize("make", [np.float32, np.float64, np.float16, lambda x: torch.tensor(x),
                                  lambda x: torch.tensor(x, dtype=torch.float16), lambda x: np.array(x)])
def test_float_scalars_of_any_library_are_accepted_and_normalised(make):
    p = SamplingParams(temperature=make(0.5), top_p=make(0.75))
    assert p == SamplingParams(temperature=0.5, top_p=0.75)
    assert type(p.temperature) is float and type(p.top_p) is float


@pytest.mark.parametrize("make", [np.int64, np.int32, np.uint8, lambda x: torch.tensor(x),
                                  lambda x: np.array(x)])
def test_integer_scalars_of_any_library_are_accepted_and_normalised(make):
    p = SamplingParams(max_tokens=make(7), top_k=make(3), seed=make(11), stop_token_ids=[make(5)])
    assert p == SamplingParams(max_tokens=7, top_k=3, seed=11, stop_token_ids=(5,))
    assert {type(p.max_tokens), type(p.top_k), type(p.seed), type(p.stop_token_ids[0])} == {int}


@pytest.mark.parametrize("value", [True, np.True_, torch.tensor(True), torch.tensor([3]), np.array([3]),
                                   3.0, np.float64(3.0), "3", 3 + 0j])
def test_flags_shapes_and_floats_are_not_counts(value):
    with pytest.raises(InvalidArgument, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=value)


def test_engine_limits_of_any_integer_type_are_stored_as_ints():
    """A config holding a tensor would turn every size computed from it into a tensor."""
    cfg = SchedulerConfig(max_num_seqs=np.int64(4), block_size=torch.tensor(4), num_blocks=np.int32(32),
                          max_num_batched_tokens=np.uint16(64), long_prefill_chunk=np.array(8))
    assert cfg == SchedulerConfig(max_num_seqs=4, block_size=4, num_blocks=32, max_num_batched_tokens=64,
                                  long_prefill_chunk=8)
    assert all(type(getattr(cfg, f)) is int for f in ("max_num_seqs", "block_size", "num_blocks",
                                                       "max_num_batched_tokens", "long_prefill_chunk"))
    with pytest.raises(InvalidArgument, match="block_size must be an integer"):
        SchedulerConfig(block_size=torch.tensor(True))
    llm = LLM(tiny_model(), max_num_seqs=np.int64(2), num_blocks=torch.tensor(16), block_size=np.int8(4),
              seed=np.int64(5))
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.5, seed=np.int64(1)))
    assert len(out.token_ids) == 3


# --- token ids and arrival times ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [torch.tensor(True), np.True_, True, torch.tensor([5]), 5.0, None])
def test_booleans_and_shaped_values_are_not_token_ids(bad):
    eng = engine()
    with pytest.raises(InvalidArgument, match="prompt token ids must be integers"):
        eng.add_request("x", [5, bad], SamplingParams(max_tokens=2))
    assert not eng.has_unfinished_requests()


def test_token_ids_of_any_integer_type_are_the_same_request():
    eng = engine()
    eng.add_request("a", [np.int64(5), torch.tensor(6), np.array(7), 8], SamplingParams(max_tokens=2))
    assert eng.snapshot() is not None
    outs = eng.run(["a"])
    assert outs[0].prompt_token_ids == [5, 6, 7, 8] and all(type(t) is int for t in outs[0].prompt_token_ids)


@pytest.mark.parametrize("bad, needle", [
    ("yesterday", "must be a number"), (math.nan, "finite"), (math.inf, "finite"), (-math.inf, "finite"),
    (True, "must be a number"), (10**400, "finite"), ([1.0], "must be a number")],
    ids=["str", "nan", "inf", "-inf", "bool", "10**400", "list"])
def test_arrival_time_must_be_a_finite_real_number(bad, needle):
    eng = engine()
    with pytest.raises(InvalidArgument, match=f"arrival_time.*{needle}"):
        eng.add_request("x", [5, 6], SamplingParams(max_tokens=2), arrival_time=bad)
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("t", [np.float32(2.5), torch.tensor(2.5), 2, np.int64(2)])
def test_arrival_time_of_any_real_scalar_type_is_a_float(t):
    eng = engine()
    eng.add_request("x", [5, 6], SamplingParams(max_tokens=1), arrival_time=t)
    (out,) = eng.run(["x"])
    # load-independent: a given arrival time, not a reading
    assert out.arrival_time == float(t) and type(out.arrival_time) is float


# --- the sampler: one row never fails or changes another ----------------------------------------------------
special_floats = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 0.0])
rows = st.lists(st.one_of(st.floats(-50, 50), special_floats), min_size=8, max_size=8)
params = st.builds(SamplingParams, temperature=st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, 100.0)),
                   top_k=st.integers(0, 10), top_p=st.floats(0.01, 1.0), seed=st.integers(0, 2**63 - 1))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(rows, params), min_size=1, max_size=5))
def test_every_row_samples_a_valid_token_whatever_its_logits_and_alone_or_not(batch):
    """Rows with NaN / inf logits and extreme temperatures: no exception; a row holding a NaN or a
    +inf, or no finite logit (a broken forward, issue 46) fails alone with an error; every other row
    gets a token in the vocabulary, the token that row draws when sampled alone with the same seed."""
    logits = torch.tensor([r for r, _ in batch], dtype=torch.float64)
    ids = tuple(f"r{i}" for i in range(len(batch)))
    together = Sampler()
    for rid, (_, p) in zip(ids, batch):
        together.register(rid, p)
    tokens = together.sample(logits, ids, [p for _, p in batch])
    for i, (row, p) in enumerate(batch):
        broken = any(math.isnan(x) or x == math.inf for x in row) or not any(math.isfinite(x) for x in row)
        alone = Sampler()
        alone.register("x", p)
        (by_itself,) = alone.sample(logits[i:i + 1], ("x",), [p])
        if broken:
            assert "not finite" in tokens[i].error and "not finite" in by_itself.error, (row, p)
            continue
        assert 0 <= tokens[i] < logits.shape[1]
        assert by_itself == tokens[i], (row, p)
        assert math.isfinite(row[tokens[i]])          # -inf logits are never drawn


def test_a_broken_row_in_the_engine_fails_no_one(monkeypatch):
    """One request's logits row turns NaN inside the step (as a broken forward could make it): before,
    ``torch.multinomial`` raised and every request of that step ended with an error; then the sampler
    drew from a fallback (garbage with "length", issue 46); now that request alone ends with an error
    and the healthy one gets exactly the tokens it gets alone."""
    good = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    bad = SamplingParams(max_tokens=6, temperature=MIN_TEMPERATURE, seed=4, ignore_eos=True)
    alone = engine()
    alone.add_request("good", [5, 6, 7], good)
    (want,) = alone.run(["good"])

    real = Sampler.sample

    def poisoned(self, logits, request_ids, params):
        if "bad" in request_ids:
            logits = logits.clone()
            logits[request_ids.index("bad")] = math.nan
        return real(self, logits, request_ids, params)

    monkeypatch.setattr(Sampler, "sample", poisoned)
    eng = engine()
    eng.add_request("good", [5, 6, 7], good)
    eng.add_request("bad", [9, 10, 11, 12], bad)
    outs = {o.request_id: o for o in eng.run()}
    assert outs["good"].error is None and outs["good"].token_ids == want.token_ids
    assert outs["bad"].finish_reason == "error" and "not finite" in outs["bad"].error
    assert outs["bad"].token_ids == []                  # it never got a token: the first row was NaN


# --- text --------------------------------------------------------------------------------------------------
def text_engine(**config) -> LLMEngine:
    cfg = SchedulerConfig(**{**dict(max_num_seqs=2, num_blocks=64, block_size=4, max_model_len=64), **config})
    tok = Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata())
    return engine_for(tiny_model(dataclasses.replace(TINY, vocab_size=tok.vocab_size)), cfg, tok)


@pytest.mark.parametrize("text", ["caf\udce9", "\ud800", "ok \udfff end"])
def test_a_lone_surrogate_is_invalid_argument(text):
    eng = text_engine()
    with pytest.raises(InvalidArgument, match="not valid Unicode.*lone surrogate"):
        eng.add_request("x", text, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match="not valid Unicode"):
        eng.tokenizer.encode(text)


def test_text_too_long_to_fit_is_refused_before_the_tokenizer_library_sees_it(monkeypatch):
    eng = text_engine(max_model_len=64)
    seen = []

    class Spy:                       # the Rust tokenizer, recording the length of every text it encodes
        def __init__(self, tk):
            self.tk = tk

        def encode(self, text, **kw):
            seen.append(len(text))
            return self.tk.encode(text, **kw)

        def encode_batch(self, texts, **kw):     # what Tokenizer.encode calls (it releases the GIL)
            seen.extend(len(t) for t in texts)
            return self.tk.encode_batch(texts, **kw)

        def __getattr__(self, name):
            return getattr(self.tk, name)

    monkeypatch.setattr(eng.tokenizer, "_tk", Spy(eng.tokenizer._tk))
    longest = eng.tokenizer.max_token_chars
    with pytest.raises(InvalidArgument, match="more than the 64 allowed"):
        eng.add_request("x", "a" * (64 * longest + 1), SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match=f"at most {MAX_TEXT_CHARS:,}"):
        eng.tokenizer.encode("a" * (MAX_TEXT_CHARS + 1))
    assert seen == []                              # nothing reached the Rust library
    eng.add_request("y", "a" * 10, SamplingParams(max_tokens=2))     # short text still encodes
    assert seen == [10]


def test_max_token_chars_bounds_every_token():
    tok = Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata())
    assert all(len(tok.decode([i], skip_special_tokens=False)) <= tok.max_token_chars
               for i in range(tok.vocab_size))


def test_the_last_partial_character_survives_in_the_final_text(tmp_path):
    """The model's head only scores the bytes 0xC3 and 0xE2 (lead bytes of 2- and 3-byte UTF-8
    characters), one for each sign of one hidden unit: every greedy token is the first byte of a
    character the next token never completes. With ``max_tokens=1`` the whole output is one such
    byte: the final text must show it (U+FFFD, as ``decode`` does), where it used to be empty because
    the incremental decoder was never flushed."""
    from tiny_files import TOKENIZER, tiny_weights, write_gguf

    weights = tiny_weights()
    head = weights["lm_head.weight"]
    head[:] = 0.0
    byte_token = {b: 3 + b for b in range(256)}     # 3 control tokens, then the 256 bytes
    assert TOKENIZER["tokenizer.ggml.tokens"][byte_token[0xC3]] == "Ã"
    head[byte_token[0xC3], 0] = 10.0
    head[byte_token[0xE2], 0] = -10.0
    llm = LLM(str(write_gguf(tmp_path / "lead_bytes.gguf", weights, quantize=False)), max_num_seqs=2,
              num_blocks=32, block_size=4)
    for n in (1, 2, 3):
        (out,) = llm.generate(["hello"], SamplingParams(max_tokens=n, ignore_eos=True))
        assert set(out.token_ids) <= {byte_token[0xC3], byte_token[0xE2]} and len(out.token_ids) == n
        assert out.text == llm.tokenizer.decode(out.token_ids) == "\ufffd" * n


# --- pools sized by the user, checked against the machine's memory before allocating ----------------------
def test_a_kv_pool_larger_than_the_machine_is_refused_before_allocating():
    from minicb.model.kv_cache import KVCache

    with pytest.raises(InvalidArgument, match=r"KV cache \(10,000,000,000 device \+ 0 host .*more than"):
        KVCache(2, 10**10, 16, 2, 8)
    with pytest.raises(InvalidArgument, match="lower num_blocks or block_size"):
        LLM(tiny_model(), num_blocks=10**10, max_num_seqs=4)
    with pytest.raises(InvalidArgument, match="or num_host_blocks"):
        KVCache(2, 16, 16, 2, 8, num_host_blocks=10**12)


def test_the_pool_check_compares_the_exact_size_with_what_is_available(monkeypatch):
    """2 layers x 2 (K, V) x 8 blocks x 4 tokens x 2 heads x 8 dims x 8 bytes (float64) = 16 KiB."""
    import minicb.model.kv_cache as kv

    need = 2 * 2 * 8 * 4 * 2 * 8 * 8
    monkeypatch.setattr(kv, "available_cpu_bytes", lambda: need)
    kv.KVCache(2, 8, 4, 2, 8, dtype=torch.float64)                      # exactly fits
    monkeypatch.setattr(kv, "available_cpu_bytes", lambda: need - 1)
    with pytest.raises(InvalidArgument, match=r"needs 16\.0 KiB, more than the 16\.0 KiB available"):
        kv.KVCache(2, 8, 4, 2, 8, dtype=torch.float64)


def test_the_machine_reports_its_available_memory():
    from minicb.core.memory import available_cpu_bytes, format_bytes

    avail = available_cpu_bytes()
    assert avail is None or avail > 0
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(10) == "10 B"
    assert format_bytes(2**70).endswith("PiB")


@pytest.mark.parametrize("field, value", [("step_overhead_s", math.nan), ("step_overhead_s", math.inf),
                                          ("seq_overhead_s", -1.0), ("op_launch_s", 1e9),
                                          ("compute_eff", math.nan), ("host_bw", 0.0)])
def test_a_cost_model_refuses_times_that_would_stop_or_break_the_clock(field, value):
    from minicb.simulate.simulator import preset

    with pytest.raises(InvalidArgument, match=field):
        preset("llama-3-8b", **{field: value})


@pytest.mark.parametrize("kwargs", [
    dict(dtype=np.array(3)), dict(dtype=[]), dict(attn_backend=np.array([1, 2])), dict(attn_backend={}),
    dict(device=10**30), dict(device=np.array([0, 1]))],
                         ids=["dtype-array", "dtype-list", "backend-array", "backend-dict", "device-huge",
                              "device-array"])
def test_unhashable_or_huge_choices_are_invalid_argument(kwargs):
    """Found by the fuzz (``test_fuzz_api.py``, a longer random run): these raised numpy's ValueError,
    ``TypeError: unhashable`` or torch's "Overflow when unpacking long long"."""
    with pytest.raises(InvalidArgument):
        LLM(tiny_model(), max_num_seqs=2, num_blocks=16, **kwargs)
