"""``minicb serve`` against hostile and unlucky clients, on a real server (uvicorn, 127.0.0.1, a free
port, in a thread; the tiny GGUF in float64).

* A hypothesis fuzz of request bodies (types, sizes, nesting, numbers at every boundary, bad
  unicode, raw bytes): never a 500, always OpenAI's error object, nothing logged at ERROR, healthy
  afterwards.
* The bounds of a request and a connection: 413 by Content-Length and as a chunked body arrives, 415,
  408 for a slow body, silent and slowloris connections closed, live watchers capped.
* The doors: the Host allow-list, opt-in CORS, the API key.
* An innocent stream keeps its pace while large-but-legal requests arrive: its longest gap between
  chunks, as a ratio to the step time measured in the same run.
* A dead engine: every open request and every new one gets a 503 with the reason, /health says 503.
"""

from __future__ import annotations

import http.client as httpc
import json
import logging
import socket
import statistics
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minicb.core.errors import EngineDeadError
from minicb.entrypoints.serve.limits import ServeLimits
from serve_helpers import MODEL, client, health, http, running_server, wait_for
from tiny_files import write_gguf

SMALL = dict(max_num_seqs=4, num_blocks=48, block_size=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("serve-hostile") / "tiny.gguf")


class Errors(logging.Handler):
    """Every record at ERROR or above from the server's and uvicorn's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def served(gguf):
    errors = Errors()
    loggers = [logging.getLogger(n) for n in ("minicb", "uvicorn", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(errors)
    limits = ServeLimits(header_timeout=1.0, body_timeout=1.0, max_live_watchers=2)
    try:
        with running_server(gguf, limits=limits, **SMALL) as (server, url):
            yield server, url, errors
    finally:
        for lg in loggers:
            lg.removeHandler(errors)


def post(url: str, path: str, raw: bytes, headers: dict | None = None, timeout: float = 30):
    """(status, parsed JSON or text) of a raw POST."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    c = httpc.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request("POST", path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        payload = r.read().decode("utf-8", "replace")
    finally:
        c.close()
    try:
        return r.status, json.loads(payload)
    except json.JSONDecodeError:
        return r.status, payload


def is_error_object(body) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and \
        set(body["error"]) == {"message", "type", "param", "code"} \
        and isinstance(body["error"]["message"], str)


# --- the fuzz --------------------------------------------------------------------------------------
BOUNDARY_INTS = [0, 1, -1, 2, 16, 255, 256, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1,
                 10**29, -10**29]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-320, 5e-324, 1e-6, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 1e308, float("inf"),
                   float("-inf"), float("nan")]
ODD_TEXT = ["", "\ud800", "x\udfffy", "\x00", "<|im_start|>", "\u202e", "a" * 5000, "é" * 100]

scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(BOUNDARY_INTS), st.integers(),
                    st.sampled_from(BOUNDARY_FLOATS), st.floats(), st.sampled_from(ODD_TEXT),
                    st.text(max_size=20))
values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "n",
          "logprobs", "min_p", "min_tokens", "skip_special_tokens", "return_token_ids", "guided_json"]
good_prompt = st.one_of(st.text(max_size=30), st.lists(st.integers(0, 300), max_size=12))
good_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": st.one_of(st.text(max_size=20), values)}),
                         max_size=3)


@st.composite
def bodies(draw):
    """A request body: a mostly-sane base with fields replaced by anything, or no object at all."""
    kind = draw(st.sampled_from(["completion", "chat"]))
    if draw(st.integers(0, 9)) == 0:
        return kind, draw(values)                         # not an object
    body = {"model": MODEL, "max_tokens": 2}
    body |= {"prompt": draw(good_prompt)} if kind == "completion" else {"messages": draw(good_messages)}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(values)
    return kind, body


def encode(body, how: str) -> bytes:
    text = json.dumps(body, allow_nan=True)               # lone surrogates become \\udXXX escapes
    if how == "truncated":
        return text[: len(text) // 2].encode()
    if how == "nested":
        return b'{"prompt": "x", "stop": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    if how == "bytes":
        return text.encode() + b"\xff\xfe"
    return text.encode()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=bodies(), how=st.sampled_from(["json"] * 7 + ["truncated", "nested", "bytes"]))
def test_fuzzed_bodies_never_get_a_500(served, req, how):
    _, url, errors = served
    kind, body = req
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    status, got = post(url, path, encode(body, how))
    assert status in (200, 400, 404, 413, 503), (status, got, body)
    if status == 200:
        if isinstance(body, dict) and body.get("stream") is True:
            assert "data: [DONE]" in got
        else:
            assert got["choices"][0]["finish_reason"] in ("stop", "length"), got
    else:
        assert is_error_object(got), got
        assert "Traceback" not in got["error"]["message"]
    assert not errors.records, [r.getMessage() for r in errors.records]


def test_after_the_fuzz_the_server_is_healthy_and_exact(served):
    _, url, errors = served
    h = health(url)
    assert h["status"] == "ok" and h["num_requests_running"] == 0 and h["num_free_blocks"] == h["num_blocks"]
    r = client(url).completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and not errors.records


@pytest.mark.parametrize("raw, needle", [
    (b'{"prompt": "x", "max_tokens": 2, "top_k": ' + b"[" * 1000 + b"]" * 1000 + b"}",
     "nests deeper than 32"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"model": "\\ud800", "prompt": "x"}', "does not exist"),
    (json.dumps({"prompt": "x", "max_tokens": 2**63}).encode(), "max_tokens must be in"),
    (json.dumps({"prompt": "x", "top_k": 10**29}).encode(), "top_k must be in"),
    (json.dumps({"prompt": "x", "stop_token_ids": [10**29]}).encode(), "stop_token_ids[i] must be in"),
    (json.dumps({"prompt": "x", "temperature": 1e-320}).encode(), "at least 1e-05"),
    (json.dumps({"prompt": "x", "temperature": 1e-6}).encode(), "at least 1e-05"),
], ids=["nested-1000", "5000-digits", "lone-surrogate-model", "max_tokens-2**63", "top_k-10**29",
        "stop_token_ids-10**29", "temperature-1e-320", "temperature-1e-6"])
def test_the_issues_500s_are_400s_or_404s(served, raw, needle):
    status, got = post(served[1], "/v1/completions", raw)
    assert status in (400, 404) and is_error_object(got) and needle in got["error"]["message"], got


# --- bounds of a request and a connection ------------------------------------------------------------
def test_bodies_over_the_limit_are_413_and_only_json_is_read(served):
    url = served[1]
    limit = ServeLimits().max_body_bytes
    status, got = post(url, "/v1/completions", b'{"prompt": "' + b"a" * limit + b'"}')
    assert status == 413 and "--max-body-bytes" in got["error"]["message"], got
    host, port = url.removeprefix("http://").rsplit(":", 1)
    c = httpc.HTTPConnection(host, int(port), timeout=30)        # chunked: no Content-Length to judge
    c.putrequest("POST", "/v1/completions")
    c.putheader("Content-Type", "application/json")
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    chunk = b"a" * 2**16
    try:
        for _ in range(limit // len(chunk) + 2):
            c.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except OSError:
        pass                                  # the server may close while we still send
    r = c.getresponse()
    assert r.status == 413 and "--max-body-bytes" in json.loads(r.read())["error"]["message"]
    c.close()
    status, got = post(url, "/v1/completions", b'{"prompt": "x"}', headers={"Content-Type": "text/plain"})
    assert status == 415 and got["error"]["code"] == "unsupported_media_type", got


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_silent_and_slowloris_connections_are_closed(served):
    """header_timeout and body_timeout are 1 s here: a connection that says nothing, one that never
    finishes its headers and one that never finishes its body are all closed (the last with a 408)."""
    url = served[1]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    head = socket.create_connection((host, int(port)))
    head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    body = socket.create_connection((host, int(port)))
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    for s in (silent, head):
        assert _closed_by_server(s, 20), "a connection without a request head stayed open"
    body.settimeout(20)
    answer = b""
    while chunk := body.recv(4096):                # until the server closes the connection
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer
    for s in (silent, head, body):
        s.close()


def test_live_watchers_are_capped(served):
    url = served[1]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conns = []
    for _ in range(2):
        c = httpc.HTTPConnection(host, int(port), timeout=10)
        c.request("GET", "/live/events")
        assert c.getresponse().status == 200
        conns.append(c)
    status, _, got = http("GET", url + "/live/events")
    assert status == 503 and "--max-live-watchers 2" in got["error"]["message"], got
    for c in conns:
        c.close()
    wait_for(lambda: served[0].live._reserved == 0, what="the watchers released")
    c = httpc.HTTPConnection(host, int(port), timeout=10)
    c.request("GET", "/live/events")
    assert c.getresponse().status == 200            # a closed page frees its place
    c.close()


# --- the doors ---------------------------------------------------------------------------------------
def test_host_allow_list_cors_and_api_key(gguf):
    with running_server(gguf, api_key="sesame", allowed_origins=("http://ok.example",), **SMALL) as (_, url):
        body = json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 1}).encode()
        status, got = post(url, "/v1/completions", body, {"Host": "evil.example"})
        assert status == 400 and got["error"]["code"] == "invalid_host", got
        status, got = post(url, "/v1/completions", body)
        assert status == 401 and got["error"]["code"] == "invalid_api_key", got
        status, got = post(url, "/v1/completions", body, {"Authorization": "Bearer wrong"})
        assert status == 401
        status, got = post(url, "/v1/completions", body,
                           {"Authorization": "Bearer sesame", "Host": "localhost"})
        assert status == 200 and got["usage"]["completion_tokens"] == 1
        r = client(url).models  # the openai client sends its api_key as a bearer token
        assert health(url)["status"] == "ok"                        # /health needs no key, as vLLM's
        host, port = url.removeprefix("http://").rsplit(":", 1)
        for origin, allowed in (("http://ok.example", True), ("http://evil.example", False)):
            c = httpc.HTTPConnection(host, int(port), timeout=10)
            c.request("OPTIONS", "/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type,authorization"})
            resp = c.getresponse()
            resp.read()
            assert (resp.getheader("access-control-allow-origin") == origin) is allowed, resp.getheaders()
            c.close()
        del r
    with running_server(gguf, **SMALL) as (_, url):                   # no --allowed-origins: no CORS at all
        host, port = url.removeprefix("http://").rsplit(":", 1)
        c = httpc.HTTPConnection(host, int(port), timeout=10)
        c.request("POST", "/v1/completions", body=body,
                  headers={"Origin": "http://ok.example", "Content-Type": "application/json"})
        resp = c.getresponse()
        resp.read()
        assert resp.status == 200 and resp.getheader("access-control-allow-origin") is None
        c.close()


# --- nothing blocks the loop or the engine thread ----------------------------------------------------
STEP_S = 0.02     # the tiny model steps in ~1 ms; a real one in tens (kernels release the GIL, as sleep does)


@pytest.mark.timing
def test_an_innocent_stream_keeps_its_pace_while_large_requests_arrive(gguf):
    """One stream of 60 tokens, while three clients keep sending the largest legal requests (1,024
    messages, 30,000 characters of text, stop strings of 4,096 characters, 4,096 token ids). The
    stream gets a token at every step, so its chunks come one step apart unless something holds the
    event loop or the engine thread. Each step is given a real model's duration (a GIL-free sleep of
    ``STEP_S``: the tiny model's millisecond is shorter than one GIL switch interval), and the longest
    gap between chunks is compared with the median step measured from the engine's step events in the
    same run. Rendering 1,024 messages on the loop (~0.15 s here) or tokenizing 30,000 characters on
    the engine thread (~0.08 s) would each be several steps."""
    steps: list[float] = []

    def hook(engine):
        inner = engine.step

        def slow_step():
            t0 = time.perf_counter()
            time.sleep(STEP_S)
            out = inner()
            steps.append(time.perf_counter() - t0)
            return out

        engine.step = slow_step

    cfg = dict(SMALL, max_num_seqs=2)
    with running_server(gguf, engine_hook=hook, **cfg) as (_, url):
        loads = [("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                           "messages": [{"role": "user", "content": "hello there"}] * 1024}),
                 ("/v1/completions", {"model": MODEL, "max_tokens": 1, "prompt": "word " * 6_000}),
                 ("/v1/completions", {"model": MODEL, "max_tokens": 1, "prompt": "x",
                                      "stop": ["ab" * 1024] * 2}),
                 ("/v1/completions", {"model": MODEL, "max_tokens": 1, "prompt": [7] * 4096})]
        raws = [(p, json.dumps(b).encode()) for p, b in loads]
        times: list[float] = []
        done = threading.Event()
        answered: list[int] = []

        def flood():
            while not done.is_set():
                for path, raw in raws:
                    answered.append(post(url, path, raw)[0])

        c = client(url)
        stream = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=60, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        floods = [threading.Thread(target=flood) for _ in range(3)]
        for f in floods:
            f.start()
        wait_for(lambda: len(answered) >= 3, what="the large requests flowing")
        first = len(steps)
        for _ in it:
            times.append(time.perf_counter())
        done.set()
        for f in floods:
            f.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    step = statistics.median(steps[first:])
    assert len(gaps) > 20 and len(answered) >= 8, (len(gaps), len(answered))  # load-independent: counts
    assert set(answered) <= {200, 400}, set(answered)
    ratio = max(gaps) / step
    print(f"longest gap {max(gaps) * 1e3:.1f} ms = {ratio:.2f} x the median step {step * 1e3:.1f} ms "
          f"(median gap {statistics.median(gaps) / step:.2f} steps); {len(answered)} large requests")
    # Measured on a 2-core machine shared with other work (and the test's clients share the server's
    # GIL): the longest gap 3-6 steps, the median gap 1.0-1.3 steps; the code before the frontend gave
    # 9-10 steps and a median gap of 2.1 steps (1,024 messages rendered on the event loop, the text
    # tokenized on the engine thread: the stream's chunks came in bursts).
    # load-independent: a ratio to the step time measured in the same test
    assert statistics.median(gaps) < 1.6 * step, (statistics.median(gaps), step)
    # load-independent: a ratio to the step time measured in the same test
    assert ratio < 15, (ratio, max(gaps), step)


# --- a dead engine -----------------------------------------------------------------------------------
def test_a_dead_engine_answers_503_with_the_reason_to_everyone_and_health_says_so(gguf):
    box = {"armed": False}

    def hook(engine):
        inner = engine.step

        def step():
            if box["armed"]:
                raise EngineDeadError("injected: the worker process exited")
            return inner()

        engine.step = step

    with running_server(gguf, engine_hook=hook, **SMALL) as (server, url):
        server.exit_on_engine_death = False          # stay up, so /health can be asked
        c = client(url)
        stream = c.completions.create(model=MODEL, prompt=[5, 6], max_tokens=150, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        whole: list = []
        t = threading.Thread(target=lambda: whole.append(http("POST", url + "/v1/completions", {
            "model": MODEL, "prompt": [7, 8], "max_tokens": 150, "ignore_eos": True})))
        t.start()
        wait_for(lambda: health(url)["num_requests_running"] == 2, what="both requests running")
        box["armed"] = True
        with pytest.raises(Exception, match="injected: the worker process exited"):
            for _ in it:
                pass
        t.join(30)
        status, _, got = whole[0]
        assert status == 503 and got["error"]["code"] == "engine_dead", got
        assert "EngineDeadError: injected: the worker process exited" in got["error"]["message"]
        status, _, got = http("POST", url + "/v1/completions",
                              {"model": MODEL, "prompt": [5], "max_tokens": 1})
        assert status == 503 and "injected" in got["error"]["message"]
        assert got["error"]["code"] == "engine_dead"
        status, _, got = http("GET", url + "/health")
        assert status == 503 and "injected" in got["error"]["message"], got
        assert server.exit_code == 1
