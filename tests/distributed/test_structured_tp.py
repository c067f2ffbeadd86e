"""Structured outputs under tensor parallelism: rank 0 samples, so the grammar's mask lives there only
and the constrained tokens equal those of one process."""

import re

import pytest

from minicb.core.sampling_params import SamplingParams
from minicb.core.structured_outputs import StructuredOutputsParams as S
from minicb.entrypoints.llm import LLM
from tiny_files import write_gguf


@pytest.mark.slow
def test_tp2_constrained_tokens_equal_tp1(tmp_path):
    gguf = str(write_gguf(tmp_path / "tiny.gguf"))
    params = [SamplingParams(max_tokens=30, structured_outputs=S(regex="[ab]{2,5}c")),
              SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                             structured_outputs=S(choice=("x", "yz"))),
              SamplingParams(max_tokens=8)]
    want = LLM(gguf, dtype="float64").generate(["ab", "ba", "ab"], params)
    with LLM(gguf, dtype="float64", tensor_parallel_size=2) as llm:
        got = llm.generate(["ab", "ba", "ab"], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch("[ab]{2,5}c", got[0].text) and got[1].text in ("x", "yz")
