"""Helpers of the server tests: a real ``minicb serve`` on 127.0.0.1 (a free port) in a thread, raw
HTTP calls, and /metrics parsed with prometheus_client's own parser."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minicb.entrypoints.llm import LLM
from minicb.entrypoints.serve.server import Server, listen

MODEL = "tiny"
SERVER_OPTIONS = ("limits", "allowed_hosts", "allowed_origins", "api_key", "open_metrics",
                  "allow_control_text",
                  "frontend_workers", "exit_on_engine_death")


def tiny_server_fixtures(name: str, **limits):
    """The three module fixtures a server test file most often starts from: ``gguf`` (a tiny random
    GGUF, written once), ``reference`` (the offline ``LLM`` on it in float64 with default limits: the
    oracle) and ``url`` (a running server on it with ``limits``). A test module binds them by name::

        gguf, reference, url = tiny_server_fixtures("knobs", **SMALL)
    """
    from tiny_files import write_gguf

    @pytest.fixture(scope="module", name="gguf")
    def gguf_(tmp_path_factory):
        return write_gguf(tmp_path_factory.mktemp(name) / "tiny.gguf")

    @pytest.fixture(scope="module", name="reference")
    def reference_(gguf):
        return LLM(str(gguf), dtype="float64")

    @pytest.fixture(scope="module", name="url")
    def url_(gguf):
        with running_server(gguf, **limits) as (_, url):
            yield url

    return gguf_, reference_, url_


@contextlib.contextmanager
def running_server(gguf, *, max_waiting: int = 256, shutdown_timeout: float = 5.0, engine_hook=None,
                   **config):
    """The tiny GGUF in float64 behind a real server (uvicorn in a thread); yields (server, url).
    ``config`` holds the engine's settings and any of ``SERVER_OPTIONS`` (``Server``'s)."""
    options = {k: config.pop(k) for k in SERVER_OPTIONS if k in config}
    llm = LLM(str(gguf), dtype="float64", **config)
    if engine_hook is not None:
        engine_hook(llm.engine)
    server = Server(llm.engine, model_name=MODEL, max_waiting=max_waiting, shutdown_timeout=shutdown_timeout,
                    **options)
    url = server.start_in_thread(listen("127.0.0.1", 0))
    try:
        yield server, url
    finally:
        server.stop()
        assert not server.engine_thread.is_alive, "the engine thread outlived the server"


def client(url: str, async_: bool = False):
    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def http(method: str, url: str, body=None, raw: bytes | None = None, timeout: float = 30):
    """(status, headers (lower-case names), parsed JSON or text) of one request; error statuses are
    returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, payload = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, headers, payload = e.code, e.headers, e.read()
    headers = {k.lower(): v for k, v in headers.items()}
    text = payload.decode()
    try:
        return status, headers, json.loads(text)
    except json.JSONDecodeError:
        return status, headers, text


def health(url: str) -> dict:
    status, _, body = http("GET", url + "/health")
    assert status == 200, body
    return body


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    """Poll ``predicate`` until it is true; return its value. The deadline only ends a wait that would
    never end (what is waited for takes milliseconds): a slow machine makes the wait longer, not a fail."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            # load-independent: a hang guard (60 s by default) on conditions met in milliseconds
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: ``{(name, sorted labels without model_name): value}``."""
    status, _, text = http("GET", url + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def families(url: str) -> dict[str, str]:
    """Metric family name -> type, as /metrics declares them."""
    _, _, text = http("GET", url + "/metrics")
    return {f.name: f.type for f in text_string_to_metric_families(text)}
