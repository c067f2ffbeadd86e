"""The small routes that tools expect beside generation: tokenizer, version, ping, one model.

::

    POST /tokenize    {"prompt": "text"} or {"messages": [...]}  ->  {"tokens", "count", "max_model_len"}
    POST /detokenize  {"tokens": [ids]}                          ->  {"prompt": "text"}
    GET  /version                                                ->  {"version": "0.1.0"}
    GET | POST /ping                                             ->  200, empty (503 when down)
    GET  /v1/models/{id}                                         ->  OpenAI's model object (404)

These are vLLM's routes with vLLM's request and response shapes, so a client written for ``vllm serve``
works unchanged: lm-eval's ``tokenizer_backend=remote`` counts and cuts prompts with ``/tokenize`` and
``/detokenize``, load balancers and SageMaker probe ``/ping``, and the ``openai`` client's
``models.retrieve(id)`` reads ``/v1/models/{id}``.

**Tokenize** takes either a completion prompt (``prompt``, with ``add_special_tokens``, default
true as in vLLM) or a chat (``messages``, ``add_generation_prompt`` default true,
``add_special_tokens`` default false: the template writes the markers itself). The chat is rendered
by the same chat template, with the same checks, as ``/v1/chat/completions``, so its ``tokens`` are
exactly the prompt a chat request would run (``return_token_ids`` shows it). ``return_token_strs``
adds each token's spelling in the tokenizer's vocabulary (``Ġhello``: byte-level BPE's stand-ins).
``count`` is the number of tokens; a prompt longer than ``max_model_len`` still gets its count (that
is how a client finds out it is too long), as in vLLM.

**The same doors as generation.** Each body is read by ``app.read_body`` (JSON only: 415, at most
``--max-body-bytes``: 413, within ``--body-timeout``: 408) and parsed with the same depth bound; the
text is bounded by ``--max-prompt-chars``, the messages by ``--max-messages``, the ids of
``/detokenize`` by ``max_model_len`` and the vocabulary; a ``model`` that is not the served one is a
404 as on ``/v1/*``. The tokenizer runs in the frontend's worker pool, never on the event loop. The
Host allow-list covers every route (``guard.py``); ``/tokenize`` and ``/detokenize`` need the API key
when the server has one (they do work in proportion to their input, as ``/v1/*`` does; vLLM's own
key check covers ``/v1/*`` only), while ``/version`` and ``/ping`` stay open like ``/health``. Bad
input is a 400 with OpenAI's error object, ``param`` naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

import minicb
from minicb.core.errors import InvalidArgument, describe
from minicb.entrypoints.serve.frontend import parse_json
from minicb.entrypoints.serve.limits import flag
from minicb.entrypoints.serve.protocol import ApiError, _messages, _no_control_text, bad_request

PING_TIMEOUT_S = 10.0
_UNSUPPORTED_CHAT = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


def extra_routes(server, read_body) -> APIRouter:
    """The routes of this module for ``server`` (``app.py`` includes them with one line); ``read_body``
    is ``app.read_body``, handed in so that this module does not import ``app`` (which imports it)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request):
        raw = await read_body(request, server.limits)
        return await server.frontend.call(tokenize_body, server, raw)

    @router.post("/detokenize")
    async def detokenize(request: Request):
        raw = await read_body(request, server.limits)
        return await server.frontend.call(detokenize_body, server, raw)

    @router.get("/version")
    async def version():
        return {"version": minicb.__version__}

    @router.get("/ping", operation_id="ping_get")
    @router.post("/ping", operation_id="ping_post")
    async def ping():
        await engine_answers(server)
        return Response(status_code=200)

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model_name:
            raise ApiError(404, f"the model `{_shown(model_id)}` does not exist; this server serves "
                                f"`{server.model_name}` (GET /v1/models)", "invalid_request_error", "model",
                           "model_not_found")
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "minicb",
                "max_model_len": server.max_model_len}

    return router


async def engine_answers(server) -> None:
    """Return if the engine is alive, not shutting down, and its thread answers; else a 503."""
    if server.engine_thread.dead is not None:
        raise ApiError(503, f"the engine is dead: {server.engine_thread.dead}", "service_unavailable_error",
                       code="engine_dead")
    if server.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable_error",
                       code="server_shutting_down")
    try:
        fut = server.engine_thread.call(lambda engine: None)
        await asyncio.wait_for(asyncio.wrap_future(fut), PING_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError):
        raise ApiError(503, "the engine thread does not answer", "service_unavailable_error") from None


# --- the work, on a frontend worker thread ---------------------------------------------------------
def tokenize_body(server, raw: bytes) -> dict:
    """``/tokenize``'s answer to the body ``raw`` (vLLM's ``TokenizeCompletionRequest`` or
    ``TokenizeChatRequest``, told apart by ``messages``)."""
    body = _body(server, raw)
    tok = _tokenizer(server)
    limits = server.limits
    chat = body.get("messages") is not None
    add_special = _flag(body, "add_special_tokens", not chat)
    with_strs = _flag(body, "return_token_strs", False)
    if chat:
        if "prompt" in body:
            raise bad_request("send either prompt or messages, not both", "prompt")
        for name in _UNSUPPORTED_CHAT:
            if body.get(name) not in (None, [], {}):
                raise bad_request(f"{name} is not supported by minicb serve (leave it unset)", name)
        if _flag(body, "continue_final_message", False):
            raise bad_request("continue_final_message is not supported by minicb serve",
                              "continue_final_message")
        generation_prompt = _flag(body, "add_generation_prompt", True)
        messages = _messages(body["messages"], limits)
        _no_control_text(messages, server.frontend.control_texts)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        except InvalidArgument as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:   # noqa: BLE001 - a template's raise_exception(): the messages broke its rules
            raise bad_request(f"the model's chat template rejected the messages: {e}", "messages") from None
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad_request(f"prompt must be a string (or send messages), got {_kind(text)}", "prompt")
        if len(text) > limits.max_prompt_chars:
            raise bad_request(f"the prompt has {len(text):,} characters; at most {limits.max_prompt_chars:,} "
                              f"are allowed ({flag('max_prompt_chars')})", "prompt")
    try:
        ids = tok.encode(text, add_special_tokens=add_special)
    except InvalidArgument as e:
        raise bad_request(str(e), "messages" if chat else "prompt") from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                           "token_strs": None}
    if with_strs:
        out["token_strs"] = [tok.id_to_token(i) for i in ids]
    return out


def detokenize_body(server, raw: bytes) -> dict:
    """``/detokenize``'s answer: the text of ``tokens`` (special tokens left out, as vLLM's)."""
    body = _body(server, raw)
    tok = _tokenizer(server)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise bad_request(f"tokens must be a list of token ids, got {_kind(ids)}", "tokens")
    cap = server.max_model_len
    if len(ids) > cap:
        raise bad_request(f"tokens holds {len(ids):,} ids; at most {cap:,} (max_model_len) are allowed",
                          "tokens")
    vocab = server.frontend.vocab_size
    for k, i in enumerate(ids):
        v = i if type(i) is int else None                # JSON integers only: no 1.0, no true
        if v is None or not 0 <= v < vocab:
            raise bad_request(f"tokens must be integers in [0, {vocab - 1}] (the vocabulary), got "
                              f"{describe(i)} at index {k}", "tokens")
    return {"prompt": tok.decode(ids)}


def _body(server, raw: bytes) -> dict:
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {type(model).__name__}", "model")
    server.frontend._check_model(body)
    return body


def _tokenizer(server):
    if server.tokenizer is None:
        raise bad_request("the model has no tokenizer: minicb serve works on token ids only")
    return server.tokenizer


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if type(v) is not bool:
        raise bad_request(f"{name} must be true or false, got {describe(v)}", name)
    return v


def _kind(v) -> str:
    return "nothing" if v is None else type(v).__name__


def _shown(text: str) -> str:
    plain = len(text) <= 100 and text.isprintable()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        plain = False
    return text if plain else describe(text)
