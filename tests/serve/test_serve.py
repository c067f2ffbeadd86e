"""``minicb serve`` end to end: a real server (uvicorn, 127.0.0.1, a free port) in a thread, driven by
the official ``openai`` client and by raw HTTP.

The model is the tiny GGUF of ``tiny_files`` (a random one-layer LLaMA with a real byte-level BPE and a
ChatML chat template) in float64, so the server's answers can be compared *exactly* with
``LLM.generate`` on the same file: the server's batches (4 slots, a 192-token KV pool, 32 tokens per
step: queueing, chunked prompts and preemption) never change a request's tokens.
"""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM
from serve_helpers import MODEL, client, families, health, http, metrics, running_server, wait_for
from tiny_files import write_gguf

SMALL = dict(max_num_seqs=4, num_blocks=48, block_size=4, max_num_batched_tokens=32)   # 192 KV tokens


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf")


@pytest.fixture(scope="module")
def reference(gguf):
    """The offline API on the same file, default limits (16 slots, a large pool): the oracle."""
    return LLM(str(gguf), dtype="float64")


@pytest.fixture(scope="module")
def served(gguf):
    with running_server(gguf, **SMALL) as (server, url):
        yield server, url


@pytest.fixture
def url(served):
    return served[1]


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# --- answers ---------------------------------------------------------------------------------------
def test_16_concurrent_streaming_chats_equal_llm_generate(url, reference):
    messages = [[{"role": "user", "content": f"Question {i}: " + "why? " * (i % 5)}] for i in range(16)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0 if i % 2 == 0 else 0.9,
                             top_k=0 if i % 4 else 20, seed=None if i % 2 == 0 else 100 + i)
              for i in range(16)]
    steps_before = health(url)["num_steps"]

    async def one(i: int, c) -> dict:
        p = params[i]
        extra = {"return_token_ids": True, "top_k": p.top_k}
        stream = await c.chat.completions.create(
            model=MODEL, messages=messages[i], stream=True, stream_options={"include_usage": True},
            max_completion_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, extra_body=extra)
        got = {"text": "", "ids": [], "reason": None, "usage": None, "roles": []}
        async for chunk in stream:
            if chunk.usage is not None:
                got["usage"] = chunk.usage
            for ch in chunk.choices:
                got["roles"].append(ch.delta.role)
                got["text"] += ch.delta.content or ""
                got["ids"] += ids_of(ch)
                got["reason"] = ch.finish_reason or got["reason"]
        return got

    async def all_of_them():
        c = client(url, async_=True)
        return await asyncio.gather(*(one(i, c) for i in range(16)))

    got = asyncio.run(all_of_them())
    tok = reference.tokenizer
    want = reference.generate([tok.apply_chat_template(m) for m in messages], params)
    for g, w in zip(got, want):
        assert g["ids"] == w.token_ids and g["text"] == w.text and g["reason"] == w.finish_reason
        assert g["roles"][0] == "assistant" and set(g["roles"][1:]) == {None}
        assert (g["usage"].prompt_tokens, g["usage"].completion_tokens) == (len(w.prompt_token_ids),
                                                                           len(w.token_ids))
    tokens = sum(len(w.token_ids) for w in want)
    steps = health(url)["num_steps"] - steps_before
    assert steps < 0.6 * tokens, (steps, tokens)       # they were batched together, not served in turn


def test_completions_with_token_id_prompts_stream_or_not(url, reference):
    prompts = [[5 + (7 * i + 3 * k) % 250 for k in range(3 + 5 * i)] for i in range(4)]
    want = reference.generate(prompts, SamplingParams(max_tokens=12))
    c = client(url)
    for p, w in zip(prompts, want):
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                 extra_body={"return_token_ids": True})
        assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
        assert ids_of(r.choices[0]) == w.token_ids and r.choices[0].text == w.text
        assert r.model_extra["prompt_token_ids"] == p
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
            (len(p), len(w.token_ids), len(p) + len(w.token_ids))
        chunks = list(c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == w.text
        assert chunks[-1].choices[0].finish_reason == w.finish_reason
        assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_default_max_tokens_is_16_for_completions_and_the_room_left_for_chat(url, served):
    c = client(url)
    r = c.completions.create(model=MODEL, prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                  extra_body={"ignore_eos": True})
    pool = SMALL["num_blocks"] * SMALL["block_size"]                  # 192 < max_model_len
    assert r.usage.prompt_tokens + r.usage.completion_tokens == pool
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"


def first_ascii_pair(text: str, start: int = 2) -> str | None:
    for j in range(start, len(text) - 1):
        pair = text[j:j + 2]
        if pair.isascii() and pair.isprintable() and text.find(pair) == j:
            return pair
    return None


def test_stop_strings_end_the_text_before_them_and_are_never_sent(url, reference):
    tok = reference.tokenizer
    for seed in range(20):                       # a prompt whose greedy text has a printable pair
        prompt = [40 + (seed * 11 + 5 * k) % 200 for k in range(6)]
        w = reference.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
        stop = first_ascii_pair(w.text)
        if stop:
            break
    assert stop, "no prompt gave a text with a printable pair to stop on"
    cut = w.text.find(stop)
    dec, text, k = tok.incremental_decoder(), "", 0       # the token that completes the stop string
    while stop not in text:
        text += dec.push(w.token_ids[k])
        k += 1
    c = client(url)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00never"],
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = c.completions.create(**kw)
    assert r.choices[0].text == w.text[:cut] and r.choices[0].finish_reason == "stop"
    assert ids_of(r.choices[0]) == w.token_ids[:k] and r.usage.completion_tokens == k
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw)]
    assert "".join(ch.text for ch in chunks) == w.text[:cut]
    assert chunks[-1].finish_reason == "stop"
    assert sum(map(len, (ids_of(ch) for ch in chunks))) == k


def test_stop_token_ids_and_ignore_eos_reach_the_engine(url, reference):
    prompt = [9, 8, 7, 6]
    base = reference.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_id = base.token_ids[5]
    want = reference.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True,
                                                       stop_token_ids=(stop_id,)))[0]
    r = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                                   "return_token_ids": True})
    assert ids_of(r.choices[0]) == want.token_ids and r.choices[0].finish_reason == "stop"
    assert len(want.token_ids) <= 6


# --- the engine's side: disconnects, metrics ------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_gives_back_every_block(gguf):
    """A stream of up to 180 tokens is closed after 3 chunks: the request is aborted, every block and
    slot comes back, and the metrics count one abort and 3 or 4 tokens. The count does not depend on
    how fast the machine is: the engine's 4th step, if the abort has not already been taken before it,
    waits (a server of its own, with a gate on ``engine.step``) until the server has posted the abort,
    which the engine thread takes before its 5th step. (Without the gate the tiny model could finish
    all 180 tokens on a busy machine before the disconnect was noticed.) The 3rd step reads the
    scheduler's counts itself: ``/health`` asks the engine thread, which may be held at the gate."""
    aborted, steps, busy = threading.Event(), [], []

    def gate(engine):
        inner = engine.step

        def step():
            steps.append(1)
            if len(steps) == 3:           # the step of the 3rd token: the client has not closed yet
                snap = engine.snapshot()
                busy.append((len(snap.running), snap.num_free_blocks, snap.num_blocks))
            if len(steps) == 4:           # (if the abort is not already taken before it)
                aborted.wait(60)          # a hang guard: the abort is posted milliseconds after the close
            return inner()

        engine.step = step

    with running_server(gguf, engine_hook=gate, **SMALL) as (server, url):
        post_abort = server.engine_thread.abort

        def abort(*args, **kwargs):
            post_abort(*args, **kwargs)
            aborted.set()

        server.engine_thread.abort = abort
        before = metrics(url)
        stream = client(url).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=180, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        for _, chunk in zip(range(3), stream):
            assert chunk.choices[0].finish_reason is None
        stream.close()
        idle = wait_for(lambda: (h := health(url))["num_free_blocks"] == h["num_blocks"] and h,
                        what="every block back")
        assert aborted.is_set() and len(busy) == 1
        running, free, blocks = busy[0]
        assert running == 1 and free < blocks           # at the 3rd step: the request held blocks
        assert idle["num_requests_running"] == idle["num_requests_waiting"] == 0
        assert idle["num_free_slots"] == idle["num_slots"] == SMALL["max_num_seqs"]
        # the gauges are set on the engine thread right after it handled the abort: wait for that moment
        after = wait_for(lambda: (m := metrics(url))[("vllm:num_requests_running", ())] == 0
                         and m[("vllm:kv_cache_usage_perc", ())] == 0 and m, what="gauges back to idle")
    key = ("vllm:request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before.get(key, 0.0) == 1
    generated = after[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())]
    assert generated in (3, 4)                      # 3 read, perhaps the gated 4th, then the abort


def test_metrics_use_vllms_names_and_agree_with_the_requests_served(url):
    names = families(url)
    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:num_preemptions", "counter"),
                       ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
                       ("vllm:request_success", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:request_queue_time_seconds", "histogram")]:
        assert names.get(name) == kind, (name, names.get(name))
    before = metrics(url)
    c = client(url)
    usages = [c.completions.create(model=MODEL, prompt=[4 + i] * (3 + i), max_tokens=5 + i, temperature=0,
                                   extra_body={"ignore_eos": True}).usage for i in range(5)]
    after = metrics(url)

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 5
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds"):
        assert delta(h + "_count") == 5, h
    # load-independent: a count of samples
    assert delta("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert delta("vllm:iteration_tokens_total_count") >= max(u.completion_tokens for u in usages)
    for g in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[(g, ())] == 0.0, g


def test_preemptions_are_counted(gguf, reference):
    """A pool of 12 blocks x 4 for four 30-token requests: the scheduler must preempt; the counter
    says so, and the answers are still exact."""
    with running_server(gguf, max_num_seqs=4, num_blocks=12, block_size=4) as (_, url):
        prompts = [[10 + i, 20 + i] for i in range(4)]

        def one(p, out):
            out.append(client(url).completions.create(model=MODEL, prompt=p, max_tokens=28, temperature=0,
                                                      extra_body={"ignore_eos": True,
                                                                  "return_token_ids": True}))

        results: list = []
        threads = [threading.Thread(target=one, args=(p, results)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert metrics(url)[("vllm:num_preemptions_total", ())] > 0
        want = reference.generate(prompts, SamplingParams(max_tokens=28, ignore_eos=True))
        by_prompt = {tuple(r.model_extra["prompt_token_ids"]): ids_of(r.choices[0]) for r in results}
        assert [by_prompt[tuple(p)] for p in prompts] == [w.token_ids for w in want]


# --- errors ----------------------------------------------------------------------------------------
def assert_error(status, body, code: int, kind: str, needle: str, param=None):
    assert status == code, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == kind and needle in body["error"]["message"], body
    assert body["error"]["param"] == param
    assert "Traceback" not in body["error"]["message"]


def test_bad_fields_are_400_with_openais_error_object(url):
    s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1})
    assert_error(s, b, 400, "invalid_request_error", "temperature must be in [0.0, 2.0]", "temperature")
    s, _, b = http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": [], "n": 1})
    assert_error(s, b, 400, "invalid_request_error", "messages must be a non-empty list", "messages")
    s, _, b = http("POST", url + "/v1/completions", raw=b"{not json")
    assert_error(s, b, 400, "invalid_request_error", "not valid JSON")
    s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": [1, 999999]})
    assert_error(s, b, 400, "invalid_request_error", "[0, 265]", "prompt")
    with pytest.raises(openai.BadRequestError, match="max_n=16"):
        client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17)


def test_prompts_over_the_limits_are_400_naming_the_limit(url):
    s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": [7] * 300, "max_tokens": 4})
    assert_error(s, b, 400, "invalid_request_error", "num_blocks=48", "prompt")
    assert b["error"]["code"] == "context_length_exceeded"
    s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": [7] * 10, "max_tokens": 4090})
    assert_error(s, b, 400, "invalid_request_error", "max_model_len=4096", "prompt")
    s, _, b = http("POST", url + "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]})
    assert_error(s, b, 400, "invalid_request_error", "the limit is 192 tokens", "messages")


def test_unknown_model_route_and_method_are_404_and_405(url):
    s, _, b = http("POST", url + "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert_error(s, b, 404, "invalid_request_error", "the model `gpt-4` does not exist", "model")
    assert b["error"]["code"] == "model_not_found"
    s, _, b = http("GET", url + "/v1/nothing")
    assert_error(s, b, 404, "not_found_error", "/v1/nothing")
    s, _, b = http("GET", url + "/v1/completions")
    assert_error(s, b, 405, "invalid_request_error", "Method Not Allowed")
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="gpt-4", prompt="x")


def test_past_max_waiting_requests_get_503_with_retry_after(gguf):
    """Nine requests reach an idle engine at once: 4 slots are free, so 4 start at the next step and
    --max-waiting 2 lets two more wait; the last three are refused. ``max_waiting`` counts requests
    that actually wait: a burst is never refused while slots are free."""
    with running_server(gguf, max_waiting=2, **SMALL) as (server, url):
        gate = threading.Event()
        held = server.engine_thread.call(lambda engine: gate.wait(900))   # the engine thread is busy...
        # ...from now on: a message taken beside the call would sit in the thread's hands, not its inbox
        wait_for(held.running, what="the engine thread held")
        results = []

        def one(i):
            results.append(http("POST", url + "/v1/completions",
                                {"model": MODEL, "prompt": [5, i + 6], "max_tokens": 2, "temperature": 0},
                                timeout=900))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(9)]
        for t in threads:
            t.start()
        wait_for(lambda: server.engine_thread.num_pending == 9, timeout=900, what="9 requests in the inbox")
        gate.set()                                                     # ...and sees all nine at once
        for t in threads:
            t.join()
        ok = [r for r in results if r[0] == 200]
        busy = [r for r in results if r[0] == 503]
        assert len(ok) == SMALL["max_num_seqs"] + 2 and len(busy) == 3, [r[0] for r in results]
        for s, headers, b in busy:
            assert_error(s, b, 503, "service_unavailable_error", "--max-waiting 2")
            assert int(headers["retry-after"]) >= 1 and b["error"]["code"] == "server_overloaded"


@pytest.mark.timing
def test_a_burst_on_busy_slots_is_admitted_up_to_max_waiting(gguf):
    """Two slots busy, two free, --max-waiting 3: of 8 new requests 2 start and 3 wait; 3 refused.
    (A pool of 800 tokens: the two long ones are still running, and nobody is preempted.)"""
    with running_server(gguf, max_waiting=3, **(SMALL | {"num_blocks": 200})) as (server, url):
        c = client(url)
        busy = [c.completions.create(model=MODEL, prompt=[5, 6 + i], max_tokens=300, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True}) for i in range(2)]
        for s in busy:
            next(iter(s))
        # The engine thread is held until all 8 are in its inbox (not for a fixed time: a busy machine
        # can take long to deliver them, and a gate that opened early would admit them one by one).
        # The clients wait as long as the gate may: under a CPU hog the frontend's worker processes (nice
        # +10) once took more than the default 30 s to start, the clients left, and fewer than 8 arrived.
        gate = threading.Event()
        held = server.engine_thread.call(lambda engine: gate.wait(900))
        # Held before the clients start: the thread takes its whole inbox at once, and an "add" taken
        # beside the call (a step that ended after the first requests arrived) would never be counted
        # below; once it is held, every "add" stays in the inbox until the gate opens.
        wait_for(held.running, timeout=900, what="the engine thread held")
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(http(
            "POST", url + "/v1/completions", {"model": MODEL, "prompt": [7, i + 6], "max_tokens": 2},
            timeout=900)[0])) for i in range(8)]
        try:
            for t in threads:
                t.start()
            # the 8 "add" messages (other messages may sit beside them: a watcher's snapshot call)
            et = server.engine_thread

            def adds():
                with et._cond:
                    return sum(1 for m in et._inbox if m[0] == "add")
            wait_for(lambda: adds() == 8, timeout=900, what="8 requests in the inbox")
        finally:
            gate.set()
        for t in threads:
            t.join()
        for s in busy:
            s.close()
        assert sorted(results) == [200] * 5 + [503] * 3, results


class FailingAttention:
    """Wraps the attention backend: while ``armed``, every forward raises (a broken kernel)."""

    def __init__(self, inner):
        self.inner, self.armed = inner, False

    def prepare(self, meta):
        return self.inner.prepare(meta)

    def attend(self, layer, q, k, v, state):
        if self.armed:
            raise RuntimeError("injected kernel fault")
        return self.inner.attend(layer, q, k, v, state)


def test_a_failed_step_ends_its_requests_with_500_and_the_server_keeps_serving(gguf, reference):
    box = {}

    def wrap(engine):
        box["fault"] = engine.runner.backend = FailingAttention(engine.runner.backend)

    with running_server(gguf, engine_hook=wrap, **SMALL) as (_, url):
        box["fault"].armed = True
        s, _, b = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": [5, 6], "max_tokens": 3})
        assert_error(s, b, 500, "server_error", "injected kernel fault")
        with pytest.raises(openai.APIError, match="injected kernel fault"):
            for _ in client(url).completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, stream=True):
                pass
        box["fault"].armed = False
        r = client(url).completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, temperature=0,
                                           extra_body={"return_token_ids": True})
        assert ids_of(r.choices[0]) == reference.generate([[5, 6]], SamplingParams(max_tokens=3))[0].token_ids
        h = health(url)
        assert h["num_free_blocks"] == h["num_blocks"]
        assert metrics(url)[("vllm:request_success_total", (("finished_reason", "error"),))] == 2


# --- the small endpoints ---------------------------------------------------------------------------
def test_models_health_and_the_page(url):
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "minicb"
    h = health(url)
    assert h["status"] == "ok" and h["num_slots"] == SMALL["max_num_seqs"] and h["num_blocks"] == 48
    s, headers, page = http("GET", url + "/")
    assert s == 200 and headers["content-type"].startswith("text/html")
    assert 'new EventSource("live/events")' in page and 'id="slots"' in page and 'id="blocks"' in page
    assert "://" not in page.replace("http://www.w3.org", "")        # nothing fetched from elsewhere


@pytest.mark.timing
def test_the_live_feed_is_throttled_and_loses_no_step(url):
    """Watch /live/events while 8 requests run: at most ~10 frames a second, and the columns they
    carry are every step, in order, without a gap (coalesced, not dropped)."""
    import json
    import time
    import urllib.request

    frames, stop = [], threading.Event()
    connected = time.monotonic()      # before the server can have sent any frame of this feed

    def watch():
        with urllib.request.urlopen(url + "/live/events", timeout=30) as r:
            for line in r:
                if line.startswith(b"data: "):
                    frames.append((time.monotonic(), json.loads(line[6:])))
                if stop.is_set():
                    return

    watcher = threading.Thread(target=watch)
    watcher.start()
    wait_for(lambda: frames, what="the init frame")
    c = client(url)
    threads = [threading.Thread(target=c.completions.create,
                                kwargs=dict(model=MODEL, prompt=[5, 6 + i], max_tokens=40, temperature=0,
                                            extra_body={"ignore_eos": True})) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last = health(url)["num_steps"]
    wait_for(lambda: any(c["step"] == last - 1 for _, f in frames for c in f.get("columns", ())),
             what="the last step's column")
    stop.set()
    c.completions.create(model=MODEL, prompt=[5], max_tokens=1)      # one more frame: the watcher ends
    watcher.join(timeout=30)
    assert not watcher.is_alive()  # load-independent: a 30 s hang guard (join) on a closing feed
    # load-independent: frame contents
    assert frames[0][1]["type"] == "init" and frames[0][1]["max_num_seqs"] == SMALL["max_num_seqs"]
    steps = [c["step"] for _, f in frames[1:] for c in f["columns"]]
    # load-independent: step numbers
    assert steps == list(range(steps[0], steps[0] + len(steps)))        # every step, once, in order
    busy = [c for _, f in frames[1:] for c in f["columns"] if c["rows"]]
    # load-independent: frame contents
    assert {r[1] for c in busy for r in c["rows"]} and any(len(c["rows"]) >= 2 for c in busy)
    # Throttled to one frame per 0.1 s: the server sleeps 0.1 s after each frame, so n frames need at
    # least 0.1 * (n - 1) s between the connection and the last frame's arrival. A busy machine only
    # lengthens that span (the gaps the client sees can bunch up when it reads late, so they are not
    # what is checked).
    span = frames[-1][0] - connected
    # load-independent: a lower bound on the span (load only lengthens it)
    assert len(frames) - 1 <= span / 0.1 + 1, (len(frames), span)
    # load-independent: a frame carries every step since the last one and the server sleeps 0.1 s after each
    # frame, so this fails only if every one of ~45 tiny-model steps (~1 ms each) took over 0.1 s
    assert len(steps) > len(frames)                                   # several steps per frame


def test_a_request_that_arrives_mid_run_joins_the_batch_at_the_next_step(url, served):
    """Hold the engine thread between two steps, let a request arrive, release: the very next step
    computes its prompt beside the running request's decode (read back from the live feed)."""
    import json
    import urllib.request

    server = served[0]
    c = client(url)
    running = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=150, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    first = next(iter(running))
    gate = threading.Event()
    held = server.engine_thread.call(lambda engine: (engine.snapshot().step, gate.wait(30))[0])
    wait_for(held.running, what="the engine thread held between two steps")
    late = {}

    def arrive():
        stream = c.completions.create(model=MODEL, prompt=[8, 9], max_tokens=3, temperature=0, stream=True)
        late["id"] = next(iter(stream)).id
        late["rest"] = list(stream)

    t = threading.Thread(target=arrive)
    t.start()
    wait_for(lambda: server.engine_thread.num_pending == 1, what="the new request in the inbox")
    gate.set()
    t.join(timeout=30)
    next_step = held.result()
    running.close()
    with urllib.request.urlopen(url + "/live/events", timeout=30) as feed:
        for line in feed:
            frame = json.loads(line[6:]) if line.startswith(b"data: ") else {}
            if frame.get("type") == "steps":
                break
    by_step = {col["step"]: {row[1]: row[2] for row in col["rows"]} for col in frame["columns"]}
    joined = min(step for step, rows in by_step.items() if late["id"] in rows)
    assert joined == next_step                                     # the first step after its arrival
    assert by_step[joined][late["id"]] == "prefill" and by_step[joined][first.id] == "decode"
