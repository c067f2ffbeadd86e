"""``--max-logprob-entries`` through the server (issue 46): a request whose logprobs would cost more
than the limit (rows x (top-k + 1), over its prompt for ``prompt_logprobs`` / ``echo`` and over its
tokens for ``logprobs``) is a 400 naming the limit, before any work; one at the limit is served."""

from __future__ import annotations

import pytest

from serve_helpers import MODEL, http, running_server
from tiny_files import write_gguf

LIMIT = 60


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    gguf = write_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf")
    with running_server(gguf, max_num_seqs=2, num_blocks=64, block_size=4,
                        max_logprob_entries=LIMIT) as (_server, url):
        yield url


def test_echo_logprobs_past_the_limit_is_a_400_and_at_the_limit_is_served(url):
    # echo + logprobs 5 scores every prompt row and the generated token with 5 + 1 entries each:
    # 10 prompt tokens -> (9 + 1) x 6 = 60 entries (the limit), 11 -> 66
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "logprobs": 5, "echo": True}
    status, _, out = http("POST", url + "/v1/completions", {**body, "prompt": list(range(5, 15))})
    assert status == 200, out
    assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == 11
    status, _, out = http("POST", url + "/v1/completions", {**body, "prompt": list(range(5, 16))})
    assert status == 400, out
    msg = out["error"]["message"]
    assert "66 logprob entries" in msg and f"limit is {LIMIT}" in msg and "max_logprob_entries" in msg


def test_prompt_logprobs_on_a_chat_past_the_limit_is_a_400(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 1,
            "prompt_logprobs": 20}
    status, _, out = http("POST", url + "/v1/chat/completions", body)
    assert status == 400 and "logprob entries" in out["error"]["message"], out
