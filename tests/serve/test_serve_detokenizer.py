"""The server's text, made on the event loop from token ids (``detokenizer.RequestText``), against the
tokenizer's own ``decode``: streamed ids concatenate to the final ids, the text is ``decode(ids)``
when no stop string appears, a stop string cuts the text before it and drops what the engine made
after it; and an engine with ``detokenize = False`` makes no text at all."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb.entrypoints.serve.detokenizer import RequestText
from minicb.entrypoints.serve.engine_thread import Delta
from minicb.entrypoints.serve.stops import StopMatcher
from minicb.model.text.tokenizer import Tokenizer
from tiny_files import write_gguf


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_gguf(write_gguf(tmp_path_factory.mktemp("detok") / "tiny.gguf"))


def run(tok, chunks, stops=(), reason="length"):
    aborted = []
    rt = RequestText(tok.incremental_decoder(), StopMatcher(tuple(stops)), lambda: aborted.append(True))
    out = []
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        d = rt.push(Delta("", list(ids), 3, sum(map(len, chunks[:i + 1])), last, reason if last else None))
        if d is not None:
            out.append(d)
    return out, aborted


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 265), max_size=30), cuts=st.lists(st.integers(0, 30), max_size=5))
def test_without_stops_the_text_is_the_decode_of_the_ids(tok, ids, cuts):
    bounds = sorted({0, len(ids), *[c for c in cuts if c <= len(ids)]})
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:])] or [[]]
    out, aborted = run(tok, chunks)
    assert [t for d in out for t in d.token_ids] == ids and not aborted
    assert "".join(d.text for d in out) == tok.decode(ids)
    assert out[-1].finished and out[-1].finish_reason == "length"


def test_a_stop_string_cuts_the_text_aborts_and_drops_the_rest(tok):
    ids = tok.encode("hello world and more")
    text = tok.decode(ids)
    chunks = [[i] for i in ids]
    out, aborted = run(tok, chunks, stops=["wor"])
    assert aborted == [True]                           # the engine was told once, then nothing more sent
    assert out[-1].finished and out[-1].finish_reason == "stop"
    assert "".join(d.text for d in out) == text[:text.index("wor")]
    sent = [t for d in out for t in d.token_ids]
    assert sent == ids[:len(sent)] and "wor" in tok.decode(sent) and "wor" not in tok.decode(sent[:-1])
    assert out[-1].num_output_tokens == len(sent)


def test_an_engine_without_detokenize_makes_token_ids_only(tmp_path):
    from minicb.core.sampling_params import SamplingParams
    from minicb.entrypoints.llm import LLM

    llm = LLM(str(write_gguf(tmp_path / "tiny.gguf")), dtype="float64")
    want = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert want.text == llm.tokenizer.decode(want.token_ids)
    llm.engine.detokenize = False
    got = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert got.token_ids == want.token_ids and got.text == ""


def test_the_tokenizers_decode_stream_would_lose_a_split_character_at_the_end(tok):
    """Why the server keeps the tokenizer's ``IncrementalDecoder`` rather than ``tokenizers``'
    ``DecodeStream``: over every prefix of a text with 2-, 3- and 4-byte characters, ours always equals
    ``decode`` (a request may end anywhere); ``DecodeStream`` agrees except where a prefix ends inside a
    character, whose bytes it never emits."""
    from tokenizers.decoders import DecodeStream

    ids = tok.encode("héllo 😀 wörld \u0663 ok")
    differ = []
    for cut in range(1, len(ids) + 1):
        want = tok.decode(ids[:cut])
        assert tok.incremental_decoder().push_many(ids[:cut], final=True) == want
        stream = DecodeStream(skip_special_tokens=True)
        theirs = "".join(x for t in ids[:cut] if (x := stream.step(tok._tk, t)) is not None)
        if theirs != want:
            assert want == theirs + "\ufffd" * (len(want) - len(theirs)), (theirs, want)
            differ.append(cut)
    assert differ and all(tok.decode(ids[:cut]).endswith("\ufffd") for cut in differ)
