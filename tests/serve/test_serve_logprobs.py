"""Logprobs, echo and batched prompts through ``minicb serve`` (the tiny GGUF in float64), against
``LLM.generate`` on the same engine settings: the HTTP shapes carry exactly what the engine computed.

The engine's numbers themselves are checked against a plain forward in tests/runtime/test_logprobs.py,
and the real model's against transformers in tests/serve/test_serve_oracle.py."""

from __future__ import annotations

import json
import math

import pytest

from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM
from minicb.entrypoints.serve.limits import ServeLimits
from serve_helpers import MODEL, client, http, running_server
from tiny_files import write_gguf

SMALL = {"max_num_seqs": 4, "num_blocks": 256, "block_size": 4, "max_num_batched_tokens": 6}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf")


@pytest.fixture(scope="module")
def reference(gguf):
    return LLM(str(gguf), dtype="float64", **SMALL)


@pytest.fixture(scope="module")
def url(gguf):
    with running_server(gguf, limits=ServeLimits(max_prompt_chars=200, max_prompt_tokens=40), **SMALL) \
            as (_server, url):
        yield url


def post(url, path, body):
    status, _, out = http("POST", url + path, body)
    assert status == 200, out
    return out


def sse(url, path, body) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [ln.decode()[6:] for ln in r if ln.startswith(b"data: ")]
    assert lines[-1].strip() == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_echo_with_logprobs_is_lm_evals_shape_and_the_engines_numbers(url, reference):
    ids = [5, 9, 11, 4, 20, 7, 30]
    body = {"model": MODEL, "prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234}
    out = post(url, "/v1/completions", body)
    (choice,) = out["choices"]
    ref = reference.generate([ids], SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == ref.prompt_logprobs[j][ids[j]].logprob
        assert max(lp["top_logprobs"][j].values()) == max(e.logprob for e in ref.prompt_logprobs[j].values())
    assert lp["token_logprobs"][-1] == ref.logprobs[0][ref.token_ids[0]].logprob
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert choice["text"] == reference.tokenizer.decode(ids) + ref.text          # echo: prompt + completion
    assert "prompt_logprobs" not in choice                                      # not asked for
    # lm-eval's own reading of it: the continuation [3:] and whether it is greedy
    ctxlen = 3
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(
        sum(ref.prompt_logprobs[j][ids[j]].logprob for j in range(ctxlen, len(ids))), abs=1e-12)


def test_a_list_of_prompts_is_answered_in_order_with_summed_usage(url, reference):
    prompts = [[5, 9, 11], [7, 7, 30, 4, 2, 9], [12]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "temperature": 0, "logprobs": 2,
            "echo": True, "return_token_ids": True}
    out = post(url, "/v1/completions", body)
    refs = reference.generate(prompts, SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2))
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for choice, ref, p in zip(out["choices"], refs, prompts):
        assert choice["token_ids"] == ref.token_ids and choice["prompt_token_ids"] == p
        got = choice["logprobs"]["token_logprobs"]
        want = [None] + [ref.prompt_logprobs[j][p[j]].logprob for j in range(1, len(p))] + \
            [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)]
        assert got == want
    n_out = sum(len(r.token_ids) for r in refs)
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": n_out, "total_tokens": 10 + n_out}
    # text prompts too, and the same answers streamed (chunks of every choice, by index)
    texts = ["hello", "a b c"]
    whole = post(url, "/v1/completions", {"prompt": texts, "max_tokens": 4, "temperature": 0, "logprobs": 1})
    chunks = sse(url, "/v1/completions", {"prompt": texts, "max_tokens": 4, "temperature": 0, "logprobs": 1,
                                          "stream": True, "stream_options": {"include_usage": True}})
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        streamed = sum((c["logprobs"]["token_logprobs"] for c in mine), [])
        assert streamed == choice["logprobs"]["token_logprobs"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]


def test_chat_logprobs_and_top_logprobs_streamed_and_whole(url, reference):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, "prompt_logprobs": 0}
    out = post(url, "/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for e in content:
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"]
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted((t["logprob"] for t in e["top_logprobs"]),
                                                                   reverse=True)
        assert e["bytes"] == list(e["token"].encode())
    assert e["top_logprobs"][0]["token"] == e["token"]            # greedy: the top token
    prompt = out["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == out["usage"]["prompt_tokens"]
    assert all(len(p) == 1 and next(iter(p.values()))["rank"] >= 1 for p in prompt[1:])
    chunks = sse(url, "/v1/chat/completions", body | {"stream": True})
    streamed = sum((c["choices"][0]["logprobs"]["content"] for c in chunks
                    if c["choices"][0]["logprobs"]), [])
    assert streamed == content
    assert sum(1 for c in chunks if "prompt_logprobs" in c) == 1


def test_the_openai_client_reads_logprobs(url):
    c = client(url)
    r = c.completions.create(model=MODEL, prompt="hello there", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  temperature=0, logprobs=True, top_logprobs=2)
    assert len(r.choices[0].logprobs.content) == 2
    assert all(math.isfinite(t.logprob) for t in r.choices[0].logprobs.content)


@pytest.mark.parametrize("body, param, needle", [
    ({"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "must be an integer"),
    ({"prompt": "x", "echo": 1}, "echo", "true or false"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    ({"prompt": ["a", [1, 2]]}, "prompt", "of one kind"),
    ({"prompt": ["a" * 150, "b" * 60]}, "prompt", "the 2 prompts have 210 characters"),
    ({"prompt": [[1] * 30, [2] * 20]}, "prompt", "the 2 prompts have 50 token ids"),
    ({"prompt": ["hello", ""]}, "prompt", "must not be empty"),
])
def test_bad_logprob_and_prompt_fields_are_400(url, body, param, needle):
    status, _, out = http("POST", url + "/v1/completions", {"model": MODEL, "max_tokens": 1, **body})
    assert status == 400 and out["error"]["param"] == param and needle in out["error"]["message"], out


@pytest.mark.parametrize("body, param, needle", [
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"logprobs": 1}, "logprobs", "true or false"),
    ({"echo": True}, "echo", "not supported"),
])
def test_bad_chat_logprob_fields_are_400(url, body, param, needle):
    status, _, out = http("POST", url + "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **body})
    assert status == 400 and out["error"]["param"] == param and needle in out["error"]["message"], out
