"""The sampling knobs through ``minicb serve`` (the tiny GGUF, float64): sent by the ``openai`` client
with OpenAI's names (``presence_penalty``, ``frequency_penalty``, ``logit_bias``) and vLLM's
(``extra_body``), concurrently, each answer equal to ``LLM.generate`` with the same ``SamplingParams``
(the server's small pool batches, chunks and preempts them); the text-side knobs
(``include_stop_str_in_output``, ``min_tokens`` with stop strings, ``skip_special_tokens``) too."""

from __future__ import annotations

import asyncio

from minicb.core.sampling_params import SamplingParams
from serve_helpers import MODEL, client, http, tiny_server_fixtures

SMALL = dict(max_num_seqs=4, num_blocks=48, block_size=4, max_num_batched_tokens=32)   # 192 KV tokens
OPENAI = ("presence_penalty", "frequency_penalty", "logit_bias", "seed", "temperature", "top_p")


gguf, reference, url = tiny_server_fixtures("knobs", **SMALL)


def body_of(p: SamplingParams) -> tuple[dict, dict]:
    """(OpenAI keyword arguments, vLLM's extra_body) for ``p``."""
    std = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
           "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
           "logit_bias": {str(t): b for t, b in p.logit_bias}, "seed": p.seed}
    extra = {"return_token_ids": True, "top_k": p.top_k, "repetition_penalty": p.repetition_penalty,
             "min_p": p.min_p, "min_tokens": p.min_tokens, "bad_words": list(p.bad_words),
             "stop_token_ids": list(p.stop_token_ids)}
    return {k: v for k, v in std.items() if v is not None}, extra


KNOBS = [
    SamplingParams(max_tokens=12, presence_penalty=1.5, frequency_penalty=1.0),
    SamplingParams(max_tokens=12, repetition_penalty=2.0),
    SamplingParams(max_tokens=12, logit_bias={100: 8.0, 101: 6.0}),
    SamplingParams(max_tokens=12, min_tokens=12, bad_words=("the", "a")),
    SamplingParams(max_tokens=12, temperature=0.8, seed=3, min_p=0.1, repetition_penalty=1.3),
    SamplingParams(max_tokens=12, temperature=1.0, seed=4, top_k=30, frequency_penalty=2.0,
                   logit_bias={100: -100.0}),
    SamplingParams(max_tokens=12),
    SamplingParams(max_tokens=12, temperature=1.0, seed=4, top_k=30),
]


def test_concurrent_knob_completions_equal_llm_generate(url, reference):
    prompts = [f"Request {i}: tell me about " + "cats and dogs " * (i % 3) for i in range(len(KNOBS))]
    want = reference.generate(prompts, KNOBS)

    async def one(c, prompt, p):
        std, extra = body_of(p)
        r = await c.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **std)
        return r.choices[0].model_extra["token_ids"], r.choices[0].text

    async def all_of_them():
        c = client(url, async_=True)
        return await asyncio.gather(*(one(c, pr, p) for pr, p in zip(prompts, KNOBS)))

    got = asyncio.run(all_of_them())
    for (ids, text), w, p in zip(got, want, KNOBS):
        assert ids == w.token_ids and text == w.text, p
    assert want[2].token_ids != want[6].token_ids         # the knobs bite (else this proves nothing)
    assert want[5].token_ids != want[7].token_ids


def test_chat_takes_the_knobs_too(url, reference):
    messages = [{"role": "user", "content": "hello there"}]
    p = SamplingParams(max_tokens=10, presence_penalty=-2.0, logit_bias={120: 5.0}, min_tokens=10)
    std, extra = body_of(p)
    std["max_completion_tokens"] = std.pop("max_tokens")
    r = client(url).chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **std)
    want = reference.generate(reference.tokenizer.apply_chat_template(messages), p)[0]
    assert r.choices[0].model_extra["token_ids"] == want.token_ids and len(want.token_ids) == 10


def post(url, **body):
    status, _, out = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "cats and dogs",
                                                            **body})
    assert status == 200, out
    return out["choices"][0]


def test_include_stop_str_in_output_and_min_tokens_hold_stop_strings(url, reference):
    base = post(url, max_tokens=12, temperature=0, return_token_ids=True)
    text = base["text"]
    stop = text[3:5]
    assert stop and text.find(stop) == 3
    assert post(url, max_tokens=12, temperature=0, stop=[stop])["text"] == text[:3]
    kept = post(url, max_tokens=12, temperature=0, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == text[:5] and kept["finish_reason"] == "stop"
    # min_tokens: no stop string matched before that many tokens (vLLM), so the first one is passed over
    ids = base["token_ids"]
    late = post(url, max_tokens=12, temperature=0, stop=[stop], min_tokens=len(ids), return_token_ids=True)
    assert late["token_ids"] == ids and late["text"] == text


def test_skip_special_tokens_false_shows_them(url):
    forced = {"max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}, "ignore_eos": True,
              "return_token_ids": True}
    hidden, shown = post(url, **forced), post(url, skip_special_tokens=False, **forced)
    assert hidden["token_ids"] == shown["token_ids"] == [1, 1, 1]
    assert hidden["text"] == "" and shown["text"] == "<|im_start|>" * 3


def test_a_knob_the_engine_refuses_is_a_400_naming_it(url):
    status, _, out = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "x",
                                                            "logit_bias": {"999999": 1}})
    assert status == 400 and out["error"]["param"] == "logit_bias", out
    assert "vocabulary" in out["error"]["message"]
