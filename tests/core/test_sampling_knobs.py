"""The sampling knobs' fields of ``SamplingParams`` (vLLM's names) boundary by boundary, and the one
place the scheduler reads one of them: ``min_tokens`` in ``Sequence.append_token``."""

from __future__ import annotations

import numpy as np
import pytest

from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.core.sequence import FinishReason, Sequence

MAX_INT = 2**63 - 1


def test_the_knobs_are_off_by_default():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == \
        (0.0, 0.0, 1.0, 0.0, 0)
    assert p.logit_bias == () and p.bad_words == ()
    assert p.include_stop_str_in_output is False and p.skip_special_tokens is True


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_in_openais_range(name):
    for ok in (-2, -2.0, 0, 1.5, 2.0, np.float32(0.5)):
        v = getattr(SamplingParams(**{name: ok}), name)
        assert v == float(ok) and type(v) is float
    for bad in (-2.0001, 2.0001, float("nan"), float("inf"), "1", None):
        with pytest.raises(InvalidArgument, match=name):
            SamplingParams(**{name: bad})


def test_repetition_penalty_is_positive_and_finite_and_min_p_a_fraction():
    assert SamplingParams(repetition_penalty=1e-9).repetition_penalty == 1e-9
    assert SamplingParams(repetition_penalty=50).repetition_penalty == 50.0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(min_p=0).min_p == 0.0 and SamplingParams(min_p=1).min_p == 1.0
    for bad in (-0.01, 1.01, float("nan")):
        with pytest.raises(InvalidArgument, match="min_p"):
            SamplingParams(min_p=bad)


def test_min_tokens_from_zero_to_max_tokens():
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(max_tokens=5, min_tokens=0).min_tokens == 0
    with pytest.raises(InvalidArgument, match=r"min_tokens must be at most max_tokens \(5\), got 6"):
        SamplingParams(max_tokens=5, min_tokens=6)
    for bad in (-1, 1.0, True, MAX_INT + 1):
        with pytest.raises(InvalidArgument, match="min_tokens"):
            SamplingParams(max_tokens=MAX_INT, min_tokens=bad)


def test_logit_bias_becomes_sorted_pairs_and_stays_hashable():
    a = SamplingParams(logit_bias={9: 1, 2: -100, 5: 100.0})
    b = SamplingParams(logit_bias=[(5, 100), (2, -100.0), (9, 1.0)])
    assert a.logit_bias == ((2, -100.0), (5, 100.0), (9, 1.0)) == b.logit_bias
    assert a == b and hash(a) == hash(b) and all(type(t) is int and type(v) is float for t, v in a.logit_bias)
    assert SamplingParams(logit_bias={np.int64(3): np.float32(0.5)}).logit_bias == ((3, 0.5),)
    bad_values = [{1: 100.5}, {1: -100.5}, {1: float("nan")}, {-1: 1.0}, {MAX_INT + 1: 1.0}, {1.0: 1},
                  {1: "x"}, [(1, 1.0), (1, 2.0)], [(1,)], [1], 5, "ab"]
    for bad in bad_values:
        with pytest.raises(InvalidArgument, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_bad_words_are_a_tuple_of_strings_and_the_text_switches_are_bools():
    assert SamplingParams(bad_words=["a", " b"]).bad_words == ("a", " b")
    assert hash(SamplingParams(bad_words=["a"])) == hash(SamplingParams(bad_words=("a",)))
    for bad in ("ab", [1], ["a", None], 3):
        with pytest.raises(InvalidArgument, match="bad_words"):
            SamplingParams(bad_words=bad)
    for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos"):
        for bad in (1, 0, "yes", None):
            with pytest.raises(InvalidArgument, match=name):
                SamplingParams(**{name: bad})


def fed(params: SamplingParams, tokens: list[int], eos: int | None = 0) -> tuple[int, FinishReason | None]:
    """Tokens appended until the sequence finishes: (how many, why)."""
    seq = Sequence("r", [5, 6], params, eos_token_id=eos)
    for t in tokens:
        if seq.append_token(t, 0.0):
            break
    return seq.num_output_tokens, seq.finish_reason


def test_a_stop_id_ends_the_request_only_after_min_tokens_tokens():
    p = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=(7,))
    assert fed(p, [0, 7, 0, 0, 9]) == (4, FinishReason.STOP)         # the 4th token may stop it
    assert fed(p, [1, 1, 1, 7]) == (4, FinishReason.STOP)
    assert fed(p, [1, 1, 7, 1, 1]) == (5, None)                      # the 3rd may not
    assert fed(SamplingParams(max_tokens=10), [1, 7 - 7]) == (2, FinishReason.STOP)
    assert fed(SamplingParams(max_tokens=3, min_tokens=3), [0, 0, 0, 0]) == (3, FinishReason.LENGTH)
    ignore = SamplingParams(max_tokens=10, min_tokens=1, ignore_eos=True, stop_token_ids=(7,))
    assert fed(ignore, [0, 0, 7]) == (3, FinishReason.STOP)


def test_token_id_zero_may_be_biased():
    assert SamplingParams(logit_bias={0: -100}).logit_bias == ((0, -100.0),)
