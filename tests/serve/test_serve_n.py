"""``n`` choices from ``minicb serve`` (parallel sampling: the engine forks the request after its
prompt): choice ``i`` of a request with ``seed=s`` equals the offline ``LLM.generate`` of the same
prompt with ``n=1, seed=s + i``; streaming chunks carry each choice's ``index``; usage counts the
prompt once and every choice's completion tokens; a stop string ends only the choice that produced
it; ``n`` beyond the engine's ``max_n`` is a 400 naming ``n``."""

from __future__ import annotations

import json
import urllib.request

from minicb.core.sampling_params import SamplingParams
from serve_helpers import MODEL, http, tiny_server_fixtures

SMALL = dict(max_num_seqs=4, num_blocks=48, block_size=4, max_num_batched_tokens=32, max_n=6)
PROMPT = "The quick brown fox"
KNOBS = dict(max_tokens=12, temperature=0.9, top_k=30, ignore_eos=True)


gguf, reference, url = tiny_server_fixtures("serve_n", **SMALL)


def alone(reference, seed: int, n: int, prompt=PROMPT):
    """Each choice's answer from its own n=1 request with seed + i (the offline API)."""
    return [reference.generate(prompt, SamplingParams(seed=seed + i, **KNOBS))[0] for i in range(n)]


def sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [ln.decode()[6:] for ln in r if ln.startswith(b"data: ")]
    assert lines[-1].strip() == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_completions_n_choices_equal_their_seeds_alone(url, reference):
    s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 4, "seed": 11,
                                                     "return_token_ids": True, **KNOBS})
    assert s == 200, b
    want = alone(reference, 11, 4)
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in b["choices"]] == [o.token_ids for o in want]
    assert [c["text"] for c in b["choices"]] == [o.text for o in want]
    assert len({c["text"] for c in b["choices"]}) > 1, "the choices must differ"
    assert all(c["finish_reason"] == "length" for c in b["choices"])
    prompt_tokens = len(want[0].prompt_token_ids)
    assert b["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4 * 12,
                          "total_tokens": prompt_tokens + 48}


def test_streaming_chat_chunks_carry_each_choices_index(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 3, **KNOBS}
    s, _, whole = http("POST", url + "/v1/chat/completions", body)
    assert s == 200, whole
    chunks = sse(url + "/v1/chat/completions",
                 {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts, roles, reasons = {i: "" for i in range(3)}, set(), {}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        texts[c["index"]] += c["delta"].get("content", "")
        roles |= {c["index"]} if c["delta"].get("role") == "assistant" else set()
        if c["finish_reason"]:
            reasons[c["index"]] = c["finish_reason"]
    assert roles == {0, 1, 2} and reasons == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 3 * 12


def test_a_stop_string_ends_only_the_choice_that_produced_it(url, reference):
    want = alone(reference, 21, 3)
    stop = want[1].text[3:6]                          # a piece of choice 1's text
    assert stop and stop.strip()
    s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 3, "seed": 21,
                                                     "stop": [stop], **KNOBS})
    assert s == 200, b
    for c, o in zip(b["choices"], want):              # each choice: cut at its own first match
        cut = o.text.find(stop)
        assert (c["text"], c["finish_reason"]) == ((o.text, "length") if cut < 0 else (o.text[:cut], "stop"))
    assert b["choices"][1]["finish_reason"] == "stop"


def test_n_beyond_max_n_is_a_400_naming_n_before_anything_is_made_per_choice(url, monkeypatch):
    """A million choices were once a 22-second 400: a decoder and a stop matcher were made for each on
    the event loop before the engine thread looked at ``max_n``. Now nothing per choice is made."""
    from minicb.entrypoints.serve import app

    made = []
    real = app._request_text
    monkeypatch.setattr(app, "_request_text", lambda *a, **k: made.append(1) or real(*a, **k))
    for n in (7, 10**6):
        s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": n})
        assert s == 400 and b["error"]["param"] == "n" and "max_n=6" in b["error"]["message"]
        s, _, b = http("POST", url + "/v1/chat/completions",
                       {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": n})
        assert s == 400 and b["error"]["param"] == "n" and "max_n=6" in b["error"]["message"]
    assert made == []
    s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 6,
                                                     "max_tokens": 2})
    assert s == 200 and len(b["choices"]) == 6 and len(made) == 6      # the spy sees what is made


def test_a_prompt_list_with_n_numbers_choices_prompt_index_times_n_plus_child(url, reference):
    prompts = [PROMPT, "Hello there"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "seed": 5, "logprobs": 1, **KNOBS}
    s, _, b = http("POST", url + "/v1/completions", body)
    assert s == 200, b
    want = [o for p in prompts for o in alone(reference, 5, 2, prompt=p)]
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in b["choices"]] == [o.text for o in want]
    assert all(len(c["logprobs"]["tokens"]) == 12 for c in b["choices"])
    prompt_tokens = len(want[0].prompt_token_ids) + len(want[2].prompt_token_ids)     # each prompt once
    assert b["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4 * 12,
                          "total_tokens": prompt_tokens + 48}
    chunks = sse(url + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts = {i: "" for i in range(4)}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        texts[c["index"]] += c["text"]
    assert [texts[i] for i in range(4)] == [o.text for o in want]
    assert chunks[-1]["usage"] == b["usage"]


def test_the_generation_token_counter_counts_every_choice(url):
    """``vllm:generation_tokens_total`` grows by every choice's tokens: ``n=3`` x 10 tokens is 30 (as the
    usage says), not one child's 10."""
    from serve_helpers import metrics

    key = ("vllm:generation_tokens_total", ())
    before = metrics(url)[key]
    status, _, got = http("POST", url + "/v1/completions",
                          {"model": MODEL, "prompt": PROMPT, "n": 3, "seed": 1, **KNOBS, "max_tokens": 10})
    assert status == 200 and got["usage"]["completion_tokens"] == 30, got
    assert metrics(url)[key] - before == 30


def test_more_prompts_than_the_server_ever_holds_is_a_400_not_a_503(url):
    """An idle server with 4 slots and --max-waiting 256 can never take 600 prompts at once: a 400 (a
    503 would have an SDK retry in vain); 260 = 4 + 256 prompts fit."""
    too_many = {"model": MODEL, "prompt": [[5, 6]] * 600, "max_tokens": 1}
    status, headers, got = http("POST", url + "/v1/completions", too_many)
    assert status == 400 and got["error"]["param"] == "prompt" and "--max-waiting" in got["error"]["message"]
    assert "retry-after" not in headers
    status, _, got = http("POST", url + "/v1/completions", too_many | {"prompt": [[5, 6]] * 260})
    assert status == 200 and len(got["choices"]) == 260, got
