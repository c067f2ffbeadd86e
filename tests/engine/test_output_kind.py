"""``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``): a ``FINAL_ONLY`` request gets no
output until it has finished, and then the same final output a streamed (``CUMULATIVE``) request gets:
the same tokens, times, finish reasons and text (decoded once, at the end, here).

A plain-Python runner stands in for the model: it samples, for every sequence, the tokens of a text
with multi-byte characters in turn (so the incremental decoder has partial characters to hold back),
and a stop token at a chosen count for some sequences (so a request's ``n`` children finish at
different steps).
"""

from __future__ import annotations

import pytest

from drain import drain
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import RequestOutputKind, SamplingParams
from minicb.engine.llm_engine import LLMEngine
from tokenizer_fixtures import tiny_tokenizer

TEXT = "héllo 😀 wörld the end"
STOP = 36                                       # the tiny tokenizer's "!"
STOP_AT = {"1_b": 2, "0_b": 5, "c": 3}         # sequence id -> which of its tokens is the stop token


class ScriptedRunner:
    """Sequence ``r``'s ``k``-th token is ``TEXT``'s ``k``-th token (cycling), or ``STOP`` at
    ``STOP_AT[r]``; no torch."""

    eos_token_id = None
    failure = None
    vocab_size = 300

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.count: dict[str, int] = {}
        self.steps = 0

    def run(self, plan, params):
        self.steps += 1
        out = {}
        for s in plan.seqs:
            for r in (s.request_id, *s.forks) if s.sample else ():
                k = self.count[r] = self.count.get(r, 0) + 1
                out[r] = STOP if STOP_AT.get(r) == k else self.tokens[(k - 1) % len(self.tokens)]
        return out

    def register(self, request_id, params, prompt_token_ids=(), **kwargs) -> None:
        pass

    def release(self, request_id) -> None:
        pass

    def close(self) -> None:
        pass


def serve(kinds: dict[str, RequestOutputKind]) -> list[list]:
    """Requests a (n=1, 12 tokens), b (n=3: child 1 stops at its 2nd token, child 0 at its 5th, child 2
    runs to 12) and c (n=1, stops at its 3rd), with the given output kinds; every step's outputs."""
    tok = tiny_tokenizer()
    runner = ScriptedRunner(tok.encode(TEXT))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_blocks=64,
                             max_model_len=64)
    eng = LLMEngine(runner, config, tok, clock=lambda: float(runner.steps))
    n = {"a": 1, "b": 3, "c": 1}
    for rid in ("a", "b", "c"):
        eng.add_request(rid, tok.encode(f"prompt of {rid} is longer"),
                        SamplingParams(max_tokens=12, n=n[rid], stop_token_ids=(STOP,),
                                       output_kind=kinds[rid]))
    steps = []
    drain(eng, lambda e: steps.append(e.step()))
    return steps


def final(outs) -> tuple:
    """What a final output says (all but the per-step deltas)."""
    return (outs.request_id, outs.token_ids, outs.text, outs.finish_reason, outs.token_times,
            outs.first_token_time, outs.finish_time, outs.prompt_token_ids,
            [(c.index, c.token_ids, c.text, c.finish_reason) for c in outs.outputs])


CUMULATIVE, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def test_final_only_requests_get_their_final_output_alone_and_the_same_one():
    streamed = serve(dict.fromkeys("abc", CUMULATIVE))
    quiet = serve(dict.fromkeys("abc", FINAL_ONLY))
    assert len(streamed) == len(quiet)                           # the same steps: scheduling is unchanged
    last = {o.request_id: o for outs in streamed for o in outs}
    assert all(o.finished for o in last.values()) and len(last) == 3
    assert sum(len(outs) for outs in streamed) > 3                 # streaming made intermediate outputs
    got = [o for outs in quiet for o in outs]
    assert all(o.finished for o in got)                            # FINAL_ONLY: none before the end
    assert sorted(o.request_id for o in got) == ["a", "b", "c"]    # exactly one each
    for o in got:
        assert final(o) == final(last[o.request_id])
        assert o.new_token_ids == o.token_ids and o.new_text == o.text   # its delta is everything
    # b's children finished at different steps: its one output came in the step its last child did
    when = {o.request_id: k for k, outs in enumerate(quiet) for o in outs}
    assert when == {o.request_id: k for k, outs in enumerate(streamed) for o in outs if o.finished}
    b = next(o for o in got if o.request_id == "b")
    assert [c.finish_reason for c in b.outputs] == ["stop", "stop", "length"]
    assert "😀" in b.outputs[2].text                                # a whole character, decoded once


def test_a_streamed_request_beside_final_only_ones_streams_as_before():
    alone = serve(dict.fromkeys("abc", CUMULATIVE))
    mixed = serve({"a": CUMULATIVE, "b": FINAL_ONLY, "c": FINAL_ONLY})

    def of_a(steps):
        return [[(o.new_token_ids, o.new_text, o.text, o.finished) for o in outs if o.request_id == "a"]
                for outs in steps]

    assert of_a(mixed) == of_a(alone) and sum(map(len, of_a(alone))) == 12


@pytest.mark.parametrize("bad", ["final", 3, -1, None, True, 2.5])
def test_output_kind_takes_a_request_output_kind(bad):
    assert SamplingParams(output_kind=2).output_kind is FINAL_ONLY       # vLLM's values are accepted
    with pytest.raises(InvalidArgument, match="output_kind"):
        SamplingParams(output_kind=bad)
