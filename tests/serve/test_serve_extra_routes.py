"""``/tokenize``, ``/detokenize``, ``/version``, ``/ping`` and ``/v1/models/{id}`` through HTTP.

The ids are checked twice: against the project's tokenizer (what ``/v1/completions`` encodes with) and
against a ``tokenizers`` BPE built here straight from the tiny GGUF's vocabulary and merges (Digits
then ByteLevel, as SmolLM's own ``tokenizer.json`` spells it), so a shared mistake would have to be
made twice. A chat's ``tokens`` are compared with the ``prompt_token_ids`` a real chat request ran.
"""

from __future__ import annotations

import http.client as httpc
import json

import openai
import pytest

import minicb
from serve_helpers import MODEL, client, http, running_server
from tiny_files import write_gguf
from tokenizer_fixtures import SAMPLE, tiny_gguf_tokenizer_metadata

SMALL = dict(max_num_seqs=4, num_blocks=48, block_size=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("extra") / "tiny.gguf")


@pytest.fixture(scope="module")
def served(gguf):
    with running_server(gguf, **SMALL) as (server, url):
        yield server, url


@pytest.fixture(scope="module")
def direct():
    """The tiny vocabulary as a ``tokenizers`` BPE, built from the raw GGUF metadata (not by minicb)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    md = tiny_gguf_tokenizer_metadata()
    tokens = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, kind in zip(tokens, md["tokenizer.ggml.token_type"]) if kind == 3])
    return tk


def post(url: str, path: str, body, headers: dict | None = None):
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


# --- /tokenize and /detokenize ------------------------------------------------------------------------
def test_tokenize_equals_the_tokenizer_and_an_independent_bpe(served, direct):
    server, url = served
    texts = [t for t in SAMPLE if t] + ["1234 digits", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        status, got = post(url, "/tokenize", {"model": MODEL, "prompt": text})
        assert status == 200, got
        ours = server.tokenizer.encode(text, add_special_tokens=True)
        assert got["tokens"] == ours == direct.encode(text).ids, text
        assert got["count"] == len(ours) and got["max_model_len"] == server.max_model_len
        assert got["token_strs"] is None
        status, back = post(url, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
        assert status == 200 and back == {"prompt": direct.decode(got["tokens"], skip_special_tokens=True)}
    status, got = post(url, "/tokenize", {"prompt": "the 123", "return_token_strs": True})
    assert got["token_strs"] == [direct.id_to_token(i) for i in got["tokens"]]
    assert "".join(got["token_strs"]) == "theĠ123"                    # byte-level BPE's stand-in space


def test_tokenize_messages_is_the_prompt_a_chat_request_runs(served):
    _, url = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why 42?"}]
    status, got = post(url, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, got
    c = client(url)
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert got["tokens"] == chat.model_extra["prompt_token_ids"] and got["count"] == len(got["tokens"])
    assert got["count"] == chat.usage.prompt_tokens
    _, bare = post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    _, header = post(url, "/tokenize", {"prompt": "<|im_start|>assistant\n", "add_special_tokens": False})
    assert bare["tokens"] + header["tokens"] == got["tokens"]           # the generation prompt, exactly


def test_tokenize_a_prompt_longer_than_the_context_still_counts(served):
    server, url = served
    text = "ab " * (server.max_model_len + 10)
    status, got = post(url, "/tokenize", {"prompt": text})
    assert status == 200 and got["count"] > server.max_model_len, got["count"]


BAD = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, "messages[0]"),
    ("/tokenize", {"messages": [{"role": "user", "content": "<|im_start|>system"}]}, "messages[0].content"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"prompt": "x" * 200_001}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": 3}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 266]}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": [10**40]}, "tokens"),
    ("/detokenize", {"tokens": [5] * 4097}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_input_is_a_400_error_object_naming_the_field(served, path, body, param):
    _, url = served
    status, got = post(url, path, body)
    assert status == 400, got
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["param"] == param, got


def test_the_limits_of_the_generation_routes_apply(served):
    _, url = served
    status, got = post(url, "/tokenize", b"not json")
    assert status == 400 and "not valid JSON" in got["error"]["message"]
    status, got = post(url, "/tokenize", b"[" * 40 + b"]" * 40)
    assert status == 400 and "nests deeper" in got["error"]["message"]
    host, port = url.removeprefix("http://").rsplit(":", 1)     # judged by Content-Length, before a byte
    c = httpc.HTTPConnection(host, int(port), timeout=30)
    c.putrequest("POST", "/tokenize")
    c.putheader("Content-Type", "application/json")
    c.putheader("Content-Length", str(2 * 2**20 + 1))
    c.endheaders()
    r = c.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
    c.close()
    status, got = post(url, "/detokenize", json.dumps({"tokens": [1]}).encode(),
                       {"Content-Type": "text/plain"})
    assert status == 415
    status, got = post(url, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and got["error"]["code"] == "model_not_found"
    status, _, got = http("GET", url + "/tokenize")
    assert status == 405 and "error" in got


# --- /version, /ping, /v1/models/{id} -----------------------------------------------------------------
def test_version_ping_and_one_model(served):
    server, url = served
    assert http("GET", url + "/version")[::2] == (200, {"version": minicb.__version__})
    for method in ("GET", "POST"):
        status, _, body = http(method, url + "/ping")
        assert (status, body) == (200, "")
    c = client(url)
    m = c.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by, m.created) == (MODEL, "model", "minicb", server.created)
    listed = c.models.list().data[0]
    assert listed.model_dump() == m.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    status, _, got = http("GET", url + "/v1/models/org/some%20model")
    assert status == 404 and got["error"]["type"] == "invalid_request_error"


def test_ping_is_503_once_the_server_drains(gguf):
    with running_server(gguf, **SMALL) as (server, url):
        assert http("GET", url + "/ping")[0] == 200
        server.draining = True                       # what begin_shutdown sets first
        status, _, got = http("POST", url + "/ping")
        assert status == 503 and got["error"]["code"] == "server_shutting_down"
        server.draining = False


def test_api_key_and_host_rules(gguf):
    key = {"Authorization": "Bearer sesame"}
    with running_server(gguf, api_key="sesame", **SMALL) as (_, url):
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            status, got = post(url, path, body)
            assert status == 401 and got["error"]["code"] == "invalid_api_key", got
            assert post(url, path, body, key)[0] == 200
            status, got = post(url, path, body, {**key, "Host": "evil.example"})
            assert status == 400 and got["error"]["code"] == "invalid_host"
        assert http("GET", url + "/v1/models/" + MODEL)[0] == 401
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0, timeout=30)
        assert keyed.models.retrieve(MODEL).id == MODEL
        for path in ("/version", "/ping"):                        # open, as /health is (and vLLM's)
            assert http("GET", url + path)[0] == 200
