"""Wrong answers must not look like right ones (issue 46): a request whose row cannot be sampled ends
with ``finish_reason == "error"`` and a message, never with a token drawn from a fallback or an EOS
forced in.

* A forward that returns NaN (damaged weights, an overflow): every request whose row is NaN fails,
  with a message saying its logits are not finite; a request whose row is fine, in the same step,
  gets exactly the tokens it gets alone.
* A grammar whose matcher breaks while masking: ``start: "a" start`` has no finite string (llguidance
  gives up with "Too many items" after the first token) and ends "error" with the matcher's message;
  a JSON schema that only refers to itself fails its very first mask, which ``compile`` computes, so
  it is refused before any work (``InvalidArgument``, a 400 through the server).
"""

from __future__ import annotations

import pytest
import torch

from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.core.structured_outputs import StructuredOutputsParams as S
from minicb.entrypoints.llm import LLM
from tiny_files import write_gguf

SELF_REF = '{"$defs":{"a":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"}'


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(write_gguf(tmp_path_factory.mktemp("rows") / "tiny.gguf")), max_num_seqs=4)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(max_tokens=6, ignore_eos=True), **kw})


def test_a_forward_that_returns_nan_fails_its_requests_with_a_message(llm, monkeypatch):
    model = llm.engine.runner.model
    real = type(model).forward

    def nan_forward(self, *args, **kwargs):
        return torch.full_like(real(self, *args, **kwargs), float("nan"))

    monkeypatch.setattr(type(model), "forward", nan_forward)
    outs = llm.generate(["ab", "ba"], [params(), params(temperature=0.8, seed=1)])
    for o in outs:
        assert o.finish_reason == "error" and o.token_ids == [], (o.finish_reason, o.token_ids)
        assert "logits for this request are not finite" in o.error
    monkeypatch.undo()
    assert all(o.finish_reason == "length" for o in llm.generate(["ab"], params()))   # the engine lives on


def test_only_the_rows_that_are_nan_fail(llm, monkeypatch):
    """Row 0 of every step is poisoned: the request that owns it fails at its first token; the other
    request, in the same steps, gets its tokens as alone."""
    (want,) = llm.generate(["ba"], [params(temperature=0.8, seed=1)])
    model = llm.engine.runner.model
    real = type(model).forward

    def first_row_nan(self, *args, **kwargs):
        out = real(self, *args, **kwargs).clone()
        if out.shape[0] == 2:
            out[0] = float("nan")
        return out

    monkeypatch.setattr(type(model), "forward", first_row_nan)
    bad, good = llm.generate(["ab", "ba"], [params(), params(temperature=0.8, seed=1)])
    assert bad.finish_reason == "error" and "not finite" in bad.error and bad.token_ids == []
    assert good.finish_reason == "length" and good.token_ids == want.token_ids


def test_a_grammar_without_a_finite_string_ends_with_the_matchers_error(llm):
    plain = params(temperature=0.8, seed=3)
    (want,) = llm.generate(["ab"], [plain])
    broken, neighbour = llm.generate(["ab", "ab"], [SamplingParams(max_tokens=20, structured_outputs=S(
        grammar='start: "a" start')), plain])
    assert broken.finish_reason == "error", (broken.finish_reason, broken.text)
    assert broken.error.startswith("structured output failed: ") and "Too many items" in broken.error
    assert broken.text == "a"                          # the one token the grammar allowed before it broke
    assert neighbour.token_ids == want.token_ids       # the other row of the same steps is untouched


def test_a_schema_that_only_refers_to_itself_is_refused_before_any_work(llm):
    with pytest.raises(InvalidArgument, match="structured_outputs.json cannot be compiled: NoExtensionBias"):
        llm.generate(["ab"], [SamplingParams(max_tokens=5, structured_outputs=S(json=SELF_REF))])
    assert not llm.engine.has_unfinished_requests()


def test_every_child_of_a_request_whose_grammar_breaks_ends_with_the_error(llm):
    """``n = 3``: the children fork after the prompt and each has its own matcher; each breaks at its
    second token and ends "error" alone; the scheduler is left consistent, nothing held."""
    (out,) = llm.generate(["ab"], [SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=5,
                                                  structured_outputs=S(grammar='start: "a" start'))])
    assert [c.finish_reason for c in out.outputs] == ["error"] * 3
    assert all("Too many items" in c.error and c.text == "a" for c in out.outputs)
    sched = llm.engine.scheduler
    sched.check_integrity()
    assert len(sched.running) == len(sched.waiting) == 0 and sched.block_manager.num_free_blocks == \
        sched.block_manager.num_blocks
