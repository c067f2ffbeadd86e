"""vLLM's small routes beside generation, with vLLM's shapes (``docs/concepts/serving.md``, "Tokenizer,
version and probes"): ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET | POST /ping``,
``GET /v1/models/{id}``.

lm-eval's ``tokenizer_backend=remote`` counts and cuts prompts with ``/tokenize`` and ``/detokenize``,
load balancers probe ``/ping``, ``openai``'s ``models.retrieve(id)`` reads ``/v1/models/{id}``. A chat
is rendered by the same template with the same checks as ``/v1/chat/completions``; ``count`` is given
even past ``max_model_len`` (as vLLM). The bodies pass the same doors as generation (``read_body``,
the JSON depth, ``--max-prompt-chars``, ``--max-messages``, the model name); the tokenizer runs in a
thread, never on the loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

import minicb
from minicb.core.errors import InvalidArgument, describe
from minicb.entrypoints.serve.frontend import parse_json
from minicb.entrypoints.serve.limits import flag
from minicb.entrypoints.serve.protocol import (
    ApiError,
    Bool,
    Messages,
    Str,
    _checked,
    _messages,
    _no_control_text,
    _object,
    _unsupported,
    bad_request,
    rendered,
)
from minicb.entrypoints.serve.tools import template_messages

PING_TIMEOUT_S = 10.0
_UNSUPPORTED_CHAT = {"chat_template": (None,), "chat_template_kwargs": (None, {}), "tools": (None, []),
                     "mm_processor_kwargs": (None, {}), "continue_final_message": (None, False)}


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest`` (told apart by ``messages``)."""

    model_config = ConfigDict(extra="allow")
    model: Str | None = None
    prompt: Str | None = None
    messages: Messages | None = None
    add_special_tokens: Bool | None = None
    add_generation_prompt: Bool | None = None
    return_token_strs: Bool | None = None


def extra_routes(server, read_body) -> APIRouter:
    """The routes of this module for ``server`` (``read_body`` is ``app.read_body``, handed in: ``app``
    imports this module)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request):
        raw = await read_body(request, server.limits)
        return await asyncio.to_thread(tokenize_body, server, raw)

    @router.post("/detokenize")
    async def detokenize(request: Request):
        raw = await read_body(request, server.limits)
        return await asyncio.to_thread(detokenize_body, server, raw)

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
        server.frontend.local.check_model({"model": model_id})
        return model_card(server)

    return router


def model_card(server) -> dict:
    """OpenAI's model object of the served model (``/v1/models`` lists it)."""
    return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "minicb",
            "max_model_len": server.max_model_len}


async def engine_answers(server, timeout: float = PING_TIMEOUT_S) -> dict:
    """The engine thread's ``_health`` answer, if the engine is alive, not shutting down, and its thread
    answers within ``timeout``; else a 503 saying which (asked again after the answer: the engine
    thread may have run the step that killed the engine, or begun the shutdown, meanwhile)."""
    _down(server)
    try:
        body = await asyncio.wait_for(asyncio.wrap_future(server.engine_thread.call(_health)), timeout)
    except (asyncio.TimeoutError, RuntimeError):
        _down(server)
        raise ApiError(503, "the engine thread does not answer", "service_unavailable_error") from None
    _down(server)
    return body


def _down(server) -> None:
    if server.engine_thread.dead is not None:
        raise ApiError(503, f"the engine is dead: {server.engine_thread.dead}", "service_unavailable_error",
                       code="engine_dead")
    if server.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable_error",
                       code="server_shutting_down")


def _health(engine) -> dict:
    """Runs on the engine thread: the scheduler's counts right now."""
    s = engine.snapshot()
    return {"status": "ok", "num_requests_running": len(s.running), "num_requests_waiting": len(s.waiting),
            "num_requests_swapped": len(s.swapped), "num_blocks": s.num_blocks,
            "num_free_blocks": s.num_free_blocks, "num_free_slots": sum(r is None for r in s.slots),
            "num_slots": len(s.slots), "num_steps": s.step}


def tokenize_body(server, raw: bytes) -> dict:
    """``/tokenize``'s answer to the body ``raw``."""
    body = _body(server, raw)
    chat = body.get("messages") is not None
    if chat:
        _unsupported(body, _UNSUPPORTED_CHAT)
    r = _checked(body, TokenizeRequest, server.limits)
    tok = _tokenizer(server)
    if chat:
        if r.prompt is not None:
            raise bad_request("send either prompt or messages, not both", "prompt")
        messages = _messages(template_messages(r.messages, None), server.limits)
        _no_control_text(messages, server.frontend.local.control_texts)
        generation = r.add_generation_prompt is not False
        text = rendered(lambda m: tok.apply_chat_template(m, add_generation_prompt=generation), messages)
    else:
        text, cap = r.prompt, server.limits.max_prompt_chars
        if text is None:
            raise bad_request("prompt must be a string (or send messages), got nothing", "prompt")
        if len(text) > cap:
            raise bad_request(f"the prompt has {len(text):,} characters; at most {cap:,} are allowed "
                              f"({flag('max_prompt_chars')})", "prompt")
    add_special = r.add_special_tokens if r.add_special_tokens is not None else not chat
    try:
        ids = tok.encode(text, add_special_tokens=add_special)
    except InvalidArgument as e:
        raise bad_request(str(e), "messages" if chat else "prompt") from None
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
            "token_strs": [tok.id_to_token(i) for i in ids] if r.return_token_strs else None}


def detokenize_body(server, raw: bytes) -> dict:
    """``/detokenize``'s answer: the text of ``tokens`` (special tokens left out, as vLLM's)."""
    ids = _body(server, raw).get("tokens")
    tok = _tokenizer(server)
    if not isinstance(ids, list):
        raise bad_request(f"tokens must be a list of token ids, got {describe(ids)}", "tokens")
    if len(ids) > server.max_model_len:
        raise bad_request(f"tokens holds {len(ids):,} ids; at most {server.max_model_len:,} (max_model_len) "
                          "are allowed", "tokens")
    vocab = server.frontend.local.vocab_size
    for k, i in enumerate(ids):
        if type(i) is not int or not 0 <= i < vocab:     # JSON integers only: no 1.0, no true
            raise bad_request(f"tokens must be integers in [0, {vocab - 1}] (the vocabulary), got "
                              f"{describe(i)} at index {k}", "tokens")
    return {"prompt": tok.decode(ids)}


def _body(server, raw: bytes) -> dict:
    body = _object(parse_json(raw))
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad_request(f"model must be a string, got {type(body['model']).__name__}", "model")
    server.frontend.local.check_model(body)
    return body


def _tokenizer(server):
    if server.tokenizer is None:
        raise bad_request("the model has no tokenizer: minicb serve works on token ids only")
    return server.tokenizer
