"""The error contract (docs/errors.md), row by row: bad input raises ``ValueError`` (or a documented
subclass from ``minicb.core.errors``) whose one-line message names the argument and the accepted range.

Besides each row, two promises of the contract are checked as behaviour:

* ``LLM.generate`` validates every prompt and every ``SamplingParams`` before any work: with one bad
  prompt among good ones nothing runs (no step, nothing queued, every block free);
* ``LLMEngine.add_request`` rejects only the bad request: the engine keeps serving the others, token
  for token as if the bad one had never been offered.

The rows use the tiny random model of ``helpers`` (vocabulary 61, so token ids 0..60).
"""

from __future__ import annotations

import math

import pytest

from drain import drain, finals
from helpers import TINY, assert_drained, baseline_tokens, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, ModelLoadError, RequestRejected
from minicb.core.sampling_params import SamplingParams
from minicb.engine.llm_engine import LLMEngine
from minicb.entrypoints.llm import LLM
from minicb.runtime.runner import engine_for

V = TINY.vocab_size   # 61


def assert_contract(excinfo, exc_type, *needles) -> None:
    """The exception is ``exc_type`` (a ValueError) and its single-line message holds every needle."""
    err = excinfo.value
    assert isinstance(err, ValueError), type(err)
    assert isinstance(err, exc_type), (type(err), exc_type)
    msg = str(err)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def tiny_llm(**config) -> LLM:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=32, max_model_len=128)
    base.update(config)
    return LLM(tiny_model(), **base)


def text_llm() -> LLM:
    """The tiny model with a (tiny, 266-token) tokenizer: only for rows about text prompts."""
    from minicb.model.text.tokenizer import Tokenizer
    from tokenizer_fixtures import tiny_gguf_tokenizer_metadata

    return LLM(tiny_model(), tokenizer=Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata()),
               max_num_seqs=2, num_blocks=32, block_size=4)


# --- SamplingParams ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, needles", [
    (dict(max_tokens=0), ["max_tokens", "[1, inf]", "got 0"]),
    (dict(max_tokens=-3), ["max_tokens", "[1, inf]"]),
    (dict(max_tokens=2.5), ["max_tokens", "integer"]),
    (dict(max_tokens="8"), ["max_tokens", "integer"]),
    (dict(max_tokens=True), ["max_tokens", "integer"]),
    (dict(temperature=-0.1), ["temperature", "[0.0, inf]", "-0.1"]),
    (dict(temperature=math.nan), ["temperature", "[0.0, inf]", "nan"]),
    (dict(temperature="hot"), ["temperature", "number"]),
    (dict(top_p=0.0), ["top_p", "(0.0, 1.0]", "got 0.0"]),
    (dict(top_p=1.5), ["top_p", "(0.0, 1.0]", "1.5"]),
    (dict(top_p=-1), ["top_p", "(0.0, 1.0]"]),
    (dict(top_k=-1), ["top_k", "[0, inf]", "-1"]),
    (dict(top_k=2.5), ["top_k", "integer"]),
    (dict(seed=1.5), ["seed", "integer", "1.5"]),
    (dict(seed="7"), ["seed", "integer"]),
    (dict(seed=-1), ["seed", f"[0, {2**63 - 1}]"]),
    (dict(stop_token_ids=[-1]), ["stop_token_ids", "[0, inf]"]),
    (dict(stop_token_ids=5), ["stop_token_ids", "tuple"]),
    (dict(ignore_eos="yes"), ["ignore_eos", "bool"]),
])
def test_sampling_params(kwargs, needles):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kwargs)
    assert_contract(e, InvalidArgument, *needles)


def test_sampling_params_accepts_the_edges():
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    SamplingParams(temperature=2.0, top_p=1e-9, top_k=1, seed=2**63 - 1, stop_token_ids=[0, 3])


# --- SchedulerConfig, and the same keywords through LLM(...) ------------------------------------------------
CONFIG_ROWS = [
    (dict(block_size=0), ["block_size", "[1, inf]", "got 0"]),
    (dict(block_size=-4), ["block_size", "[1, inf]"]),
    (dict(block_size=2.0), ["block_size", "integer"]),
    (dict(max_num_seqs=0), ["max_num_seqs", "[1, inf]"]),
    (dict(num_blocks=0), ["num_blocks", "[1, inf]"]),
    (dict(max_num_seqs=8, num_blocks=7), ["num_blocks must be at least max_num_seqs", "num_blocks=7",
                                          "max_num_seqs=8"]),
    (dict(max_num_batched_tokens=0), ["max_num_batched_tokens", "[1, inf]"]),
    (dict(max_num_batched_tokens=64, long_prefill_chunk=65), ["long_prefill_chunk", "[1, 64]", "65"]),
    (dict(long_prefill_chunk=0), ["long_prefill_chunk", "[1, 512]"]),
    (dict(num_host_blocks=-1), ["num_host_blocks", "[0, inf]"]),
    (dict(max_model_len=0), ["max_model_len", "[1, inf]"]),
    (dict(policy="fifo"), ["policy", "'continuous', 'dynamic', 'static'", "'fifo'"]),
    (dict(preemption_mode="drop"), ["preemption_mode", "'recompute', 'swap'", "'drop'"]),
    (dict(scheduling_policy="lifo"), ["scheduling_policy", "'fcfs' or 'priority'", "'lifo'"]),
]


@pytest.mark.parametrize("kwargs, needles", CONFIG_ROWS)
def test_scheduler_config(kwargs, needles):
    with pytest.raises(InvalidArgument) as e:
        SchedulerConfig(**kwargs)
    assert_contract(e, InvalidArgument, *needles)


@pytest.mark.parametrize("kwargs, needles", CONFIG_ROWS)
def test_llm_config_is_checked_before_the_model_loads(kwargs, needles, monkeypatch):
    import minicb.model.weights.loader as loader

    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(loader, "load_model", must_not_load)
    with pytest.raises(InvalidArgument) as e:
        LLM("/does/not/matter.gguf", **kwargs)
    assert_contract(e, InvalidArgument, *needles)


@pytest.mark.parametrize("kwargs, exc, needles", [
    (dict(max_num_seq=4), InvalidArgument, ["unknown LLM argument", "max_num_seq", "max_num_seqs"]),
    (dict(dtype="int8"), InvalidArgument, ["dtype", "'float32'", "'int8'"]),
    (dict(attn_backend="flash9"), InvalidArgument, ["attn_backend", "'reference'", "'flash9'"]),
    (dict(device="tpu"), InvalidArgument, ["device must be 'cpu', 'cuda' or 'cuda:N'", "'tpu'"]),
    (dict(seed=1.5), InvalidArgument, ["seed", "integer"]),
    (dict(seed=-2), InvalidArgument, ["seed", "[0,"]),
])
def test_llm_arguments(kwargs, exc, needles):
    with pytest.raises(ValueError) as e:
        LLM(tiny_model(), **kwargs)
    assert_contract(e, exc, *needles)


def test_llm_missing_model_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        LLM(str(tmp_path / "nonexistent.gguf"))
    assert_contract(e, ModelLoadError, "nonexistent.gguf", "does not exist", ".gguf file or a Hugging Face")


# --- LLM.generate: every row, and nothing runs when any prompt is bad ----------------------------------
GOOD = [[5, 6, 7], [8, 9, 10, 11]]
GENERATE_ROWS = [
    # (prompts, sampling_params, exception, needles)
    ([], None, InvalidArgument, ["prompts must be a non-empty"]),
    (123, None, InvalidArgument, ["prompts must be", "str", "token-id lists"]),
    ({"a": 1}, None, InvalidArgument, ["prompts must be"]),
    ([[]], None, InvalidArgument, ["prompt must not be empty", "at least 1 token"]),
    ([[5, V]], None, InvalidArgument, ["prompt token ids", f"[0, {V - 1}]", f"got {V}", "index 1"]),
    ([[-1]], None, InvalidArgument, ["prompt token ids", f"[0, {V - 1}]", "got -1"]),
    ([[5, 1.5]], None, InvalidArgument, ["prompt token ids", "integers", "1.5"]),
    ([[5, "6"]], None, InvalidArgument, ["prompt token ids", "integers", "'6'"]),
    ([[5, True]], None, InvalidArgument, ["prompt token ids", "integers", "True"]),
    ([None], None, InvalidArgument, ["prompt must be a str or a list of token ids", "NoneType"]),
    ([3.5], None, InvalidArgument, ["prompt must be a str or a list of token ids", "float"]),
    (["some text"], None, InvalidArgument, ["no tokenizer", "token ids"]),
    ([[5] * 10], SamplingParams(max_tokens=200), RequestRejected,
     ["prompt (10) + max_tokens (200) = 210", "max_model_len=128"]),
    ([[5] * 100], SamplingParams(max_tokens=28), RequestRejected,
     ["needs 32 KV blocks", "num_blocks=16"]),
    ([[5]], "greedy", InvalidArgument, ["sampling_params must be SamplingParams", "str"]),
    ([[5]], [SamplingParams(), SamplingParams()], InvalidArgument, ["sampling_params has 2 entries",
                                                                     "1 prompts"]),
    ([[5]], [{"max_tokens": 3}], InvalidArgument, ["sampling_params entries must be SamplingParams", "dict"]),
]


@pytest.mark.parametrize("prompts, sp, exc, needles", GENERATE_ROWS)
def test_generate_rejects(prompts, sp, exc, needles):
    llm = tiny_llm(num_blocks=16)
    with pytest.raises(ValueError) as e:
        llm.generate(prompts, sp)
    assert_contract(e, exc, *needles)
    assert_nothing_ran(llm.engine)


def assert_nothing_ran(eng: LLMEngine) -> None:
    s = eng.scheduler
    assert s.stats.num_steps == 0, "a step ran before validation finished"
    assert not eng.has_unfinished_requests() and not s.has_unfinished()
    assert (len(s.waiting), len(s.running), len(s.swapped)) == (0, 0, 0)
    assert s.block_manager.num_free_blocks == s.config.num_blocks
    assert s.slot_table.num_free == s.config.max_num_seqs
    assert s.arrivals_open
    s.check_integrity()


@pytest.mark.parametrize("bad, sp_bad", [
    ([[5, V + 3]], None),                                      # out of the vocabulary
    ([[]], None),                                              # empty
    ([[5] * 120], None),                                       # never fits the pool / max_model_len
    ([[5, 6]], "bad-params"),                                  # a bad entry in the params list
])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_generate_validates_everything_before_any_work(bad, sp_bad, position):
    llm = tiny_llm(num_blocks=16)
    prompts = list(GOOD)
    prompts.insert(position, bad[0])
    params = [SamplingParams(max_tokens=4)] * 3
    if sp_bad:
        params[position] = sp_bad
    with pytest.raises(ValueError):
        llm.generate(prompts, params)
    assert_nothing_ran(llm.engine)
    # ... and the LLM still works afterwards, for exactly the good prompts' baseline tokens
    outs = llm.generate(GOOD, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == baseline_tokens(tiny_model(), GOOD, SamplingParams(max_tokens=4),
                                                          TINY.eos_token_id)


def test_generate_text_rows():
    llm = text_llm()
    with pytest.raises(InvalidArgument) as e:
        llm.generate("")
    assert_contract(e, InvalidArgument, "prompt must not be empty", "at least 1 token")
    with pytest.raises(InvalidArgument) as e:
        llm.generate(["!#0", "", "0!"])      # these characters encode to ids below 61
    assert_contract(e, InvalidArgument, "prompt must not be empty")
    assert_nothing_ran(llm.engine)
    with pytest.raises(InvalidArgument) as e:   # the 266-token tokenizer does not match the 61-token model
        llm.generate("!! the")
    assert_contract(e, InvalidArgument, "vocabulary [0, 60]", "tokenizer does not match the model")


def test_generate_accepts_numpy_and_torch_token_ids():
    import numpy as np
    import torch

    llm = tiny_llm()
    sp = SamplingParams(max_tokens=3)
    want = llm.generate([[5, 6, 7]], sp)[0].token_ids
    assert llm.generate(list(np.array([5, 6, 7])), sp)[0].token_ids == want
    assert llm.generate([torch.tensor([5, 6, 7]).tolist()], sp)[0].token_ids == want
    assert llm.generate([[np.int32(5), torch.tensor(6), 7]], sp)[0].token_ids == want


# --- add_request: reject that request only --------------------------------------------------------------
ADD_ROWS = [
    # (request_id, prompt, params, priority, exception, needles)
    ("a", [5, 6], None, 0, InvalidArgument, ["request_id 'a' is already in use"]),
    ("", [5, 6], None, 0, InvalidArgument, ["request_id must be a non-empty str"]),
    (7, [5, 6], None, 0, InvalidArgument, ["request_id must be a non-empty str", "7"]),
    ("x", [], None, 0, InvalidArgument, ["prompt must not be empty"]),
    ("x", [5, 99], None, 0, InvalidArgument, ["prompt token ids", f"[0, {V - 1}]", "99"]),
    ("x", 5, None, 0, InvalidArgument, ["prompt must be a str or a list of token ids", "int"]),
    ("x", "text", None, 0, InvalidArgument, ["no tokenizer"]),
    ("x", [5], {"max_tokens": 2}, 0, InvalidArgument, ["sampling_params must be SamplingParams", "dict"]),
    ("x", [5], None, 1.5, InvalidArgument, ["priority", "integer"]),
    ("x", [5] * 10, SamplingParams(max_tokens=200), 0, RequestRejected, ["max_model_len=128"]),
    ("x", [5] * 60, SamplingParams(max_tokens=20), 0, RequestRejected, ["needs 20 KV blocks",
                                                                         "num_blocks=16"]),
]


@pytest.mark.parametrize("rid, prompt, sp, priority, exc, needles", ADD_ROWS)
def test_add_request_rejects_only_that_request(rid, prompt, sp, priority, exc, needles):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_blocks=16,
                          max_model_len=128)
    eng = engine_for(tiny_model(), cfg)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eng.add_request("a", GOOD[0], params)
    eng.step()                                                        # "a" is mid-flight
    with pytest.raises(ValueError) as e:
        eng.add_request(rid, prompt, sp, priority=priority)
    assert_contract(e, exc, *needles)
    eng.scheduler.check_integrity()
    eng.add_request("b", GOOD[1], params)
    outs = finals(drain(eng, check=True))
    assert set(outs) == {"a", "b"}
    assert all(o.finish_reason == "length" and o.error is None for o in outs.values())
    assert [outs["a"].token_ids, outs["b"].token_ids] == baseline_tokens(tiny_model(), GOOD, params, None)
    assert_drained(eng)


def test_a_request_id_is_free_again_once_its_request_ended():
    eng = engine_for(tiny_model(), SchedulerConfig(max_num_seqs=2, num_blocks=8, block_size=4))
    eng.add_request("a", [5, 6], SamplingParams(max_tokens=1))
    drain(eng)
    eng.add_request("a", [5, 6], SamplingParams(max_tokens=1))     # reuse after the end is allowed
    assert eng.abort_request("a").finish_reason == "abort"
    assert eng.abort_request("a") is None                            # unknown ids: None, no error
    assert_drained(eng)


def test_scheduler_validate_raises_without_changing_state():
    from minicb.core.scheduler import Scheduler
    from minicb.core.sequence import Sequence

    sched = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=4, max_model_len=64))
    ok = Sequence("ok", [1, 2], SamplingParams(max_tokens=2))
    sched.validate(ok)                                               # fine, and not queued
    assert not sched.has_unfinished()
    sched.add(ok)
    for seq, exc, needle in [
        (Sequence("ok", [1], SamplingParams()), InvalidArgument, "already in use"),
        (Sequence("big", [1] * 10, SamplingParams(max_tokens=10)), RequestRejected, "num_blocks=4"),
        (Sequence("long", [1] * 60, SamplingParams(max_tokens=10)), RequestRejected, "max_model_len=64"),
        (Sequence("empty", [], SamplingParams()), RequestRejected, "empty prompt"),
        ("not a sequence", InvalidArgument, "must be a Sequence"),
    ]:
        with pytest.raises(exc, match=needle):
            sched.validate(seq)
    assert len(sched.waiting) == 1 and sched.stats.num_steps == 0
    sched.check_integrity()
