"""vLLM's request fields on a real server (the tiny GGUF in float64): each one honoured with an effect
a client sees, or refused with a 400 naming it; none silently ignored.

``stop_reason`` on every choice, ``stop_token_ids``' text (vLLM leaves the stop token's text out),
``stream_options.continuous_usage_stats`` (guidellm sends it), ``return_tokens_as_token_ids``,
``request_id``, ``priority`` (priority scheduling only), ``cache_salt`` (no cached block shared across
salts), beam search's fields refused, a forced tool call cut short by ``max_tokens``."""

from __future__ import annotations

import json
import urllib.request

import pytest

from serve_helpers import MODEL, http, metrics, running_server, tiny_server_fixtures

SMALL = dict(max_num_seqs=4, num_blocks=256, block_size=4, max_num_batched_tokens=64, max_n=4)
PROMPT = [5, 6, 7, 8, 9, 10, 11]

gguf, reference, url = tiny_server_fixtures("vllm_fields", **SMALL)


def post(url: str, path: str, body: dict) -> dict:
    status, _, out = http("POST", url + path, {"model": MODEL, **body}, timeout=120)
    assert status == 200, out
    return out


def sse(url: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url + path, data=json.dumps({"model": MODEL, **body}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = [ln.decode()[6:] for ln in r if ln.startswith(b"data: ")]
    assert lines[-1].strip() == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def greedy(url: str, max_tokens: int = 12) -> dict:
    return post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True})["choices"][0]


def test_stop_token_ids_end_with_that_id_as_stop_reason_and_without_its_text(url, reference):
    free = greedy(url)
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    ids = free["token_ids"]
    stop = ids[3]
    cut = ids[:ids.index(stop) + 1]                    # up to its first occurrence, the stop id included
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stop_token_ids": [stop]}
    c = post(url, "/v1/completions", body)["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop and c["token_ids"] == cut
    assert c["text"] == reference.tokenizer.decode(cut[:-1])       # the stop token's text left out
    c = post(url, "/v1/completions", body | {"include_stop_str_in_output": True})["choices"][0]
    assert c["text"] == reference.tokenizer.decode(cut) and c["stop_reason"] == stop
    chunks = sse(url, "/v1/completions", body | {"stream": True})
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == reference.tokenizer.decode(cut[:-1])
    assert [ch["choices"][0]["stop_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + [stop]
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}],
                                               "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert chat["choices"][0]["stop_reason"] is None and chat["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_is_the_stop_reason(url):
    text = greedy(url)["text"]
    stop = text[4:6]
    c = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                      "ignore_eos": True, "stop": ["never-there", stop]})["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop and c["text"] == text[:text.index(stop)]


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                "content": "ab"}]})])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(url, path, base):
    """guidellm's request shape: stream, include_usage and continuous_usage_stats."""
    chunks = sse(url, path, base | {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                                    "return_token_ids": True,
                                    "stream_options": {"include_usage": True,
                                                       "continuous_usage_stats": True}})
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    prompt = last["usage"]["prompt_tokens"]
    seen = 0
    for ch in chunks[:-1]:
        seen += len(ch["choices"][0].get("token_ids", []))
        assert ch["usage"] == {"prompt_tokens": prompt, "completion_tokens": seen,
                               "total_tokens": prompt + seen}, ch
    assert seen == 6
    plain = sse(url, path, base | {"max_tokens": 3, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert all(ch["usage"] is None for ch in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 3


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(url):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    c = post(url, "/v1/completions", body)["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in c["logprobs"]["top_logprobs"])
    echo = post(url, "/v1/completions", body | {"echo": True, "max_tokens": 1})["choices"][0]
    assert echo["logprobs"]["tokens"][:len(PROMPT)] == [f"token_id:{t}" for t in PROMPT]
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}],
                                              "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                              "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
                                              "return_tokens_as_token_ids": True})["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(x["token"].startswith("token_id:") for e in content for x in e["top_logprobs"])
    named = post(url, "/v1/completions", body | {"return_tokens_as_token_ids": False})["choices"][0]
    assert not any(t.startswith("token_id:") for t in named["logprobs"]["tokens"])


def test_request_id_is_the_responses_id(url):
    got = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "request_id": "my-req-1"})
    assert got["id"] == "cmpl-my-req-1"
    got = post(url, "/v1/completions", {"prompt": [PROMPT, PROMPT], "max_tokens": 1, "request_id": "two"})
    assert got["id"] == "cmpl-two" and len(got["choices"]) == 2
    got = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 1,
                                             "request_id": "my-chat"})
    assert got["id"] == "chatcmpl-my-chat"
    chunks = sse(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True,
                                          "request_id": "s-1"})
    assert {ch["id"] for ch in chunks} == {"cmpl-s-1"}


def test_priority_is_refused_without_priority_scheduling(url):
    status, _, got = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                            "max_tokens": 1, "priority": 3})
    assert status == 400 and got["error"]["param"] == "priority", got
    assert "--scheduling-policy priority" in got["error"]["message"]
    assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "priority": 0})["choices"]


def test_priority_reaches_the_engines_priority_scheduling(gguf):
    seen = []

    def spy(engine):
        add = engine.add_request

        def recording(rid, prompt, params=None, arrival_time=None, priority=0):
            seen.append(priority)
            return add(rid, prompt, params, arrival_time=arrival_time, priority=priority)

        engine.add_request = recording

    with running_server(gguf, engine_hook=spy, scheduling_policy="priority", **SMALL) as (_, url):
        for p in (-5, 0, 7):
            assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "priority": p})["choices"]
    assert seen == [-5, 0, 7]


def test_two_cache_salts_never_share_a_cached_block(url):
    """The same 24-token prompt: a second request with the same salt finds its blocks in the prefix cache
    (hits grow), one with another salt or none does not."""
    prompt = list(range(30, 54))
    hits = ("vllm:prefix_cache_hits_total", ())

    def run(salt) -> float:
        before = metrics(url)[hits]
        body = {"prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        post(url, "/v1/completions", body)
        return metrics(url)[hits] - before

    assert run("tenant-a") == 0              # first of its salt: nothing cached
    assert run("tenant-a") == 20             # its 5 full blocks before the last token: found
    assert run("tenant-b") == 0              # another salt: nothing shared
    assert run(None) == 0                    # nor without a salt
    assert run(None) == 20


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("length_penalty", 0.5),
                                          ("prompt_embeds", "AAAA"), ("logits_processors", ["a.b"]),
                                          ("vllm_xargs", {"k": 1}), ("kv_transfer_params", {"k": 1}),
                                          ("guided_whitespace_pattern", " ")])
def test_unimplemented_fields_are_a_400_naming_them(url, field, value):
    for path, base in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]})):
        status, _, got = http("POST", url + path, {"model": MODEL, "max_tokens": 1, "n": 2, **base,
                                                   field: value})
        assert status == 400 and got["error"]["param"] == field and field in got["error"]["message"], got


def test_a_forced_tool_call_cut_short_is_plain_text_without_the_wrapper(url):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 4, "temperature": 0,
            "tools": [tool], "tool_choice": "required"}
    c = post(url, "/v1/chat/completions", body)["choices"][0]
    assert c["finish_reason"] == "length" and not c["message"].get("tool_calls")
    assert "<tool_call>" not in c["message"]["content"] and c["message"]["content"]
    chunks = sse(url, "/v1/chat/completions", body | {"stream": True})
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert "<tool_call>" not in text and text == c["message"]["content"]


@pytest.mark.parametrize("path, shape", [
    ("/v1/completions", {"prompt": "one two three four", "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                          "text": "one two three"}]}],
                              "max_completion_tokens": 5}),
])
def test_guidellms_exact_request_shapes_are_answered(url, path, shape):
    """What guidellm 0.8's request handlers send for a streaming benchmark (``bench/guidellm_check.py``
    runs guidellm itself): every one must succeed, with the usage guidellm reads from each chunk."""
    body = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "stop": None, "ignore_eos": True, **shape}
    chunks = sse(url, path, body)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(ch["usage"] is not None for ch in chunks)
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"


def test_openapi_json_shows_the_request_bodies_fields_types_and_ranges(url):
    status, _, spec = http("GET", url + "/openapi.json")
    assert status == 200
    schemas = {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        schemas[path] = body
        props = body["properties"]

        def bounds(name, props=props):
            (kind,) = [x for x in props[name]["anyOf"] if x.get("type") != "null"]
            return kind

        assert bounds("temperature") == {"type": "number", "minimum": 0.0, "maximum": 2.0}
        assert bounds("top_p")["exclusiveMinimum"] == 0.0 and bounds("n")["minimum"] == 1
        assert {"cache_salt", "priority", "request_id", "return_tokens_as_token_ids"} <= set(props)
    assert schemas["/v1/completions"]["required"] == ["prompt"]
    assert schemas["/v1/chat/completions"]["required"] == ["messages"]
