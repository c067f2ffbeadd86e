"""Structured outputs on a tiny random model: the grammar's mask per row, token-exact with the mask off.

A random model has no idea of JSON, so whatever it emits under a grammar is the grammar's doing: the
output must satisfy the constraint (checked with ``re``, ``json`` and ``jsonschema``, independently of
the engine), end with EOS exactly when the grammar is complete, and leave the rows without a
grammar of the same batch with exactly the tokens they get alone.
"""

import json
import re

import jsonschema
import pytest
import torch

from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.core.structured_outputs import StructuredOutputsParams as S
from minicb.entrypoints.llm import LLM
from minicb.runtime import grammar
from minicb.runtime.sampling import Sampler
from tiny_files import write_gguf

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["ok", "n", "color", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(write_gguf(tmp_path_factory.mktemp("grammar") / "tiny.gguf")), dtype="float64",
               max_num_seqs=8)


@pytest.fixture(scope="module")
def eos(llm):
    return llm.tokenizer.eos_token_id


def generate(llm, params_list, prompts=None):
    prompts = prompts or ["ab"] * len(params_list)
    return llm.generate(prompts, params_list)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 7)])
def test_outputs_satisfy_their_constraints_and_end_with_eos(llm, eos, temperature, seed):
    specs = [S(json=SCHEMA), S(regex="[ab]{2,4}c"), S(choice=("yes", "no", "maybe")), S(json_object=True),
             S(grammar='start: "(" "x"+ ")"')]
    outs = generate(llm, [SamplingParams(max_tokens=80, temperature=temperature, seed=seed,
                                         structured_outputs=s) for s in specs])
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] == eos, (o.text, o.finish_reason)
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert re.fullmatch("[ab]{2,4}c", outs[1].text)
    assert outs[2].text in ("yes", "no", "maybe")
    assert isinstance(json.loads(outs[3].text), dict)
    assert re.fullmatch(r"\(x+\)", outs[4].text)


def test_rows_without_a_grammar_get_the_tokens_they_get_alone(llm):
    """Token-exact with the mask off: a plain request's tokens do not change when constrained
    requests share its batch (greedy and seeded), nor when it runs with nothing else."""
    plain = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=1.0, seed=3)]
    alone = [o.token_ids for o in generate(llm, plain, ["ab", "ba"])]
    mixed = plain[:1] + [SamplingParams(max_tokens=12, structured_outputs=S(regex="[ab]+c"))] + plain[1:] \
        + [SamplingParams(max_tokens=12, temperature=1.0, seed=5, structured_outputs=S(json=SCHEMA))]
    outs = generate(llm, mixed, ["ab", "ab", "ba", "ba"])
    assert [outs[0].token_ids, outs[2].token_ids] == alone


class AllowAll:
    """A processor whose mask is all ones: it returns its row unchanged (as a new tensor)."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def process(self, logits):
        return logits.clone()

    def accept(self, token_id):
        self.accepted.append(token_id)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=11)])
def test_a_mask_of_all_ones_leaves_the_tokens_unchanged(params):
    torch.manual_seed(0)
    steps = [torch.randn(3, 300, dtype=torch.float64) for _ in range(6)]
    ids = ("a", "b", "c")
    plain, masked = Sampler(0), Sampler(0)
    for s in (plain, masked):
        for rid in ids:
            s.register(rid, params)
    procs = {rid: AllowAll() for rid in ids[:2]}
    masked._processors.update({rid: [p] for rid, p in procs.items()})
    got_plain = [plain.sample(x, ids, [params] * 3) for x in steps]
    got_masked = [masked.sample(x, ids, [params] * 3) for x in steps]
    assert got_masked == got_plain
    assert procs["a"].accepted == [t[0] for t in got_plain]     # accept() sees each drawn token once


def test_eos_is_masked_until_the_grammar_is_complete_then_it_is_all_that_is_left(llm, eos):
    tok = llm.tokenizer
    v = llm.engine.runner.vocab_size
    proc = grammar.GrammarProcessor(grammar.new_matcher(S(regex="abc"), tok, v, eos), v, eos)
    text_ids = tok.encode("abc")
    for t in text_ids:
        allowed = proc.allowed()
        assert allowed[t] and not allowed[eos]
        proc.accept(t)
    allowed = proc.allowed()
    assert allowed[eos] and int(allowed.sum()) == 1 and proc.finished


def test_a_row_with_no_usable_logit_draws_among_the_allowed_tokens(llm, eos):
    tok, v = llm.tokenizer, llm.engine.runner.vocab_size
    proc = grammar.GrammarProcessor(grammar.new_matcher(S(choice=("a", "b")), tok, v, eos), v, eos)
    row = torch.full((v,), float("nan"), dtype=torch.float64)
    out = proc.process(row)
    allowed = proc.allowed()
    assert torch.equal(out > float("-inf"), allowed) and bool(torch.all(out[allowed] == 0))
    assert torch.isnan(row).all()                    # the input row is not modified


def test_a_bad_grammar_is_refused_at_add_request_and_changes_nothing(llm):
    eng = llm.engine
    free = eng.scheduler.block_manager.num_free_blocks
    for spec in (S(regex="("), S(grammar="start: undefined_rule"), S(json={"type": "no-such-type"})):
        with pytest.raises(InvalidArgument, match="cannot be compiled"):
            eng.add_request(None, "ab", SamplingParams(structured_outputs=spec))
    assert not eng.has_unfinished_requests() and eng.scheduler.block_manager.num_free_blocks == free
    assert not eng.runner.sampler._processors and not eng.runner.sampler._generators
    assert generate(llm, [SamplingParams(max_tokens=4)])[0].finish_reason in ("stop", "length")


def test_compiled_grammars_are_cached_per_constraint(llm, eos):
    tok, v = llm.tokenizer, llm.engine.runner.vocab_size
    grammar.compiled.cache_clear()
    for _ in range(3):
        grammar.new_matcher(S(json=dict(SCHEMA)), tok, v, eos)
    grammar.new_matcher(S(regex="x+"), tok, v, eos)
    info = grammar.compiled.cache_info()
    assert (info.misses, info.hits) == (2, 2)


def test_without_a_tokenizer_structured_outputs_are_refused():
    s = Sampler(0, vocab_size=300, eos_token_id=2)
    with pytest.raises(InvalidArgument, match="tokenizer"):
        s.register("r", SamplingParams(structured_outputs=S(regex="a")))
    assert not s._processors


def test_the_grammar_holds_whatever_the_sampling_knobs_ask(llm, eos):
    """The mask is the last processor: bad words covering every choice, EOS pushed down, penalties
    cannot take the output out of the grammar (the knobs only choose among what it allows)."""
    choices = ("yes", "no", "maybe")
    knobs = dict(bad_words=choices, logit_bias={eos: -100.0}, repetition_penalty=3.0, presence_penalty=2.0)
    outs = generate(llm, [SamplingParams(max_tokens=40, temperature=t, seed=s,
                                         structured_outputs=S(choice=choices), **knobs)
                          for t, s in [(0.0, None), (1.0, 3), (1.0, 4)]])
    for o in outs:
        assert o.text in choices and o.token_ids[-1] == eos and o.finish_reason == "stop", o.text
    with pytest.raises(InvalidArgument, match="min_tokens"):
        SamplingParams(max_tokens=9, min_tokens=2, structured_outputs=S(choice=choices))


def test_a_regex_digit_means_0_to_9_not_any_unicode_digit(llm, eos):
    """``\\d`` in a regex constraint is ``[0-9]`` (as in OpenAI's, JavaScript's and ``re.ASCII``'s
    regexes), not Rust's Unicode digit: the first token of "٣" (ARABIC-INDIC THREE) or "𝟕"
    (MATHEMATICAL BOLD SEVEN) is masked, "7"'s is allowed."""
    assert grammar.ascii_digits(r"\d+[\d_]\D\\d[^\d]") == r"[0-9]+[0-9_][^0-9]\\d[^0-9]"
    assert grammar.ascii_digits(r"[]\d]") == r"[]0-9]"
    tok, v = llm.tokenizer, llm.engine.runner.vocab_size
    for regex in (r"\d", r"[\d]"):
        proc = grammar.GrammarProcessor(grammar.new_matcher(S(regex=regex), tok, v, eos), v, eos)
        allowed = proc.allowed()
        assert allowed[tok.encode("7")[0]]
        for digit in ("\u0663", "\U0001d7d5"):
            assert re.fullmatch(r"\d", digit) and not re.fullmatch(r"\d", digit, re.ASCII)
            assert not allowed[tok.encode(digit)[0]], (regex, digit)
