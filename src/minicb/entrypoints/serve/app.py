"""The HTTP routes: OpenAI's API, health, metrics and the live page, on FastAPI.

::

    POST /v1/completions        POST /v1/chat/completions        GET /v1/models
    GET  /health                GET  /metrics                    GET /  (live page)   GET /live/events

A generation request goes: read the body, bounded (JSON only: 415; ``--max-body-bytes``: 413;
``--body-timeout``: 408) -> prepare it in a worker process (``frontend``: JSON, fields, chat template,
token ids, stop matcher; 400 / 404 there) -> hand a ``RequestHandle`` to the engine thread -> wait for
its verdict (``Accepted``, or 400 / 503) -> stream its ``Delta``s (token ids from the engine thread,
text made on this loop by its ``RequestText``) as SSE chunks, or gather them into one response. The
handlers never call the engine, and nothing on this loop grows with a request beyond copying its
bytes and decoding its generated tokens, one at a time.

How a request that cannot be answered ends: a stream always ends with a last event and
``data: [DONE]``: a chunk with ``finish_reason: "abort"`` when the server shut down under it, an
error object when its step failed (500) or the engine died (503, with the reason); a non-streaming
client gets that error object as the response (503 ``server_shutting_down`` / ``engine_dead``, 500).

A client that goes away is noticed in both modes: a stream's response is wrapped so that however it
ends (finished, client gone, server cancelled) the request is aborted if still running; a non-stream
request waits for its result *and* for ``http.disconnect``, whichever comes first. Aborting frees the
request's slot and KV blocks at the engine's next turn.

Every error a client sees is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``,
including FastAPI's own 404 / 405 and anything unexpected (500, logged here, no traceback sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import logging
import time
import uuid
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minicb.core.errors import describe
from minicb.entrypoints.serve.detokenizer import RequestText
from minicb.entrypoints.serve.engine_thread import Accepted, Delta, RequestHandle
from minicb.entrypoints.serve.extra_routes import extra_routes
from minicb.entrypoints.serve.frontend import Prepared, body_limit_error
from minicb.entrypoints.serve.limits import ServeLimits, flag
from minicb.entrypoints.serve.metrics import CONTENT_TYPE
from minicb.entrypoints.serve.protocol import ApiError
from minicb.entrypoints.serve.tools import parse_calls

log = logging.getLogger("minicb.entrypoints.serve")

HEALTH_TIMEOUT_S = 10.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


Server = Any    # minicb.entrypoints.serve.server.Server, which imports this module (no import back: no cycle)


def build_app(server: Server) -> FastAPI:
    """The FastAPI application of ``server`` (its engine thread, metrics, live feed, model name)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.frontend.start()               # the worker processes, ready before the first request
        server.engine_thread.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.live.close()
            await asyncio.to_thread(server.engine_thread.stop)
            server.frontend.close()

    app = FastAPI(title="minicb serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    page = (importlib.resources.files("minicb.entrypoints.serve").joinpath("static/live.html")
            .read_text("utf-8"))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal server error", "server_error"))

    @app.get("/", response_class=HTMLResponse)
    async def live_page():
        return HTMLResponse(page)

    @app.get("/live/events")
    async def live_events():
        if not server.live.reserve():
            raise ApiError(503, f"{server.live.max_watchers} live pages are open already "
                                f"({flag('max_live_watchers')} {server.live.max_watchers}); close one",
                           "service_unavailable_error", code="too_many_watchers", retry_after=5)
        return EventStream(server.live.frames(), server.live.release)

    @app.get("/health")
    async def health():
        if server.engine_thread.dead is not None:
            raise ApiError(503, f"the engine is dead: {server.engine_thread.dead}",
                           "service_unavailable_error", code="engine_dead")
        if server.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable_error",
                           code="server_shutting_down")
        try:
            fut = server.engine_thread.call(_health)
            body = await asyncio.wait_for(asyncio.wrap_future(fut), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError):
            raise ApiError(503, "the engine thread does not answer", "service_unavailable_error") from None
        body["engine_busy_s"] = round(server.engine_thread.busy_seconds, 6)
        body["live_listener_s"] = round(server.live.listener_seconds, 6)
        body["live_frame_s"] = round(server.live.frame_seconds, 6)
        return body

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": server.created, "owned_by": "minicb",
                                            "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await read_body(request, server.limits)
        return await generate(server, request, await server.frontend.prepare("completion", raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await read_body(request, server.limits)
        return await generate(server, request, await server.frontend.prepare("chat", raw))

    app.include_router(extra_routes(server, read_body))   # /tokenize, /detokenize, /version, /ping, ...
    return app


def _health(engine) -> dict:
    """Runs on the engine thread: the scheduler's counts right now."""
    s = engine.snapshot()
    return {"status": "ok", "num_requests_running": len(s.running), "num_requests_waiting": len(s.waiting),
            "num_requests_swapped": len(s.swapped), "num_blocks": s.num_blocks,
            "num_free_blocks": s.num_free_blocks, "num_free_slots": sum(r is None for r in s.slots),
            "num_slots": len(s.slots), "num_steps": s.step}


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message that quotes a client's lone
    surrogate (``"\\ud800"``) still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(err.retry_after)))} if err.retry_after is not None else None
    return AsciiJSONResponse(err.body(), status_code=err.status, headers=headers)


async def read_body(request: Request, limits: ServeLimits) -> bytes:
    """The body, if it is JSON (415), fits ``--max-body-bytes`` (413: by its Content-Length before a
    byte is read, else as it arrives) and arrives within ``--body-timeout`` seconds (408)."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise ApiError(415, f"the request body must be JSON sent with Content-Type: application/json "
                            f"(got {describe(ctype) if ctype else 'no Content-Type'})",
                       "invalid_request_error", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise body_limit_error(int(declared), limits)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise body_limit_error(size, limits)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), limits.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout:g} s "
                            f"({flag('body_timeout')})", "invalid_request_error",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "the client went away before sending its body") from None


async def generate(server: Server, request: Request, prepared: Prepared):
    parsed = prepared.parsed
    prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
    rid = f"{prefix}-{uuid.uuid4().hex}"
    decoder = server.tokenizer.incremental_decoder() if server.tokenizer is not None else None
    text = RequestText(decoder, prepared.stops, lambda: server.engine_thread.abort(rid, "stop"))
    handle = RequestHandle(rid, parsed.generate, server.clock(), text)
    server.engine_thread.submit(handle)
    try:
        verdict = await handle.queue.get()
    except asyncio.CancelledError:
        server.engine_thread.abort(handle.request_id)
        raise
    if isinstance(verdict, ApiError):
        raise verdict
    assert isinstance(verdict, Accepted)
    answer = _Answer(server, parsed, handle, verdict)
    if parsed.stream:
        return EventStream(answer.stream(), lambda: server.engine_thread.abort(handle.request_id))
    return await answer.whole(request)


class EventStream(StreamingResponse):
    """An SSE response that stops as soon as the client goes away, and then calls ``on_close``.

    Starlette (ASGI 2.4) notices a gone client only when the next write fails; a request waiting in
    the queue, or a live page while the engine idles, writes nothing for a long time. So this listens
    for ``http.disconnect`` beside the stream and cancels it at once; ``on_close`` runs however the
    response ends (finished, client gone, server cancelled): a generation aborts its request there."""

    def __init__(self, content, on_close=None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            if self._on_close is not None:
                self._on_close()


class _Answer:
    """Builds OpenAI's response (or its SSE chunks) from one request's ``Delta``s."""

    def __init__(self, server: Server, parsed, handle: RequestHandle, accepted: Accepted):
        self.server, self.parsed, self.handle, self.accepted = server, parsed, handle, accepted
        self.chat = parsed.kind == "chat"
        self.created = int(time.time())

    def _usage(self, d: Delta) -> dict:
        return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
                "total_tokens": d.num_prompt_tokens + d.num_output_tokens}

    def _envelope(self, obj: str) -> dict:
        env = {"id": self.handle.request_id, "object": obj, "created": self.created,
               "model": self.server.model_name}
        return env

    # --- streaming ------------------------------------------------------------------------------
    async def stream(self):
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        p = self.parsed
        first = True

        def chunk(text: str | None, ids: list[int], reason: str | None) -> str:
            nonlocal first
            if self.chat:
                delta = {"role": "assistant", "content": text or ""} if first else \
                    ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            if p.return_token_ids:
                choice["token_ids"] = ids
            body = {**self._envelope(obj), "choices": [choice]}
            if p.return_token_ids and first:
                body["prompt_token_ids"] = self.accepted.prompt_token_ids
            if p.include_usage:
                body["usage"] = None
            first = False
            return _sse(body)

        if self.chat:                  # OpenAI's first chat chunk: the role, no content yet
            yield chunk("", [], None)
        held: list[str] = []           # with tools: the whole answer, sent at its end (call or content)
        held_ids: list[int] = []
        while True:
            d: Delta = await self.handle.queue.get()
            if d.failure is not None and d.finish_reason != "abort":     # a failed step, a dead engine
                yield _sse(d.failure.body(), ascii_only=True)
                break
            if p.tools is not None and not d.finished:
                held.append(d.text)
                held_ids += d.token_ids
                continue
            if d.finished and p.tools is not None:
                text, ids = "".join(held) + d.text, held_ids + d.token_ids
                calls = parse_calls(text)
                if calls is None:
                    yield chunk(text, ids, d.finish_reason)
                else:
                    content, tool_calls = calls
                    delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
                    if content:
                        delta["content"] = content
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason":
                              "tool_calls" if d.finish_reason == "stop" else d.finish_reason}
                    if p.return_token_ids:
                        choice["token_ids"] = ids
                    yield _sse({**self._envelope(obj), "choices": [choice]}
                               | ({"usage": None} if p.include_usage else {}))
                if p.include_usage:
                    yield _sse({**self._envelope(obj), "choices": [], "usage": self._usage(d)})
                break
            if d.finished:
                yield chunk(d.text, d.token_ids, d.finish_reason)
                if p.include_usage:
                    yield _sse({**self._envelope(obj), "choices": [], "usage": self._usage(d)})
                break
            if d.text or (p.return_token_ids and d.token_ids):
                yield chunk(d.text, d.token_ids, None)
        yield "data: [DONE]\n\n"

    # --- one response ---------------------------------------------------------------------------
    async def whole(self, request: Request):
        disconnected = asyncio.ensure_future(_disconnect(request))
        text: list[str] = []
        ids: list[int] = []
        try:
            while True:
                nxt = asyncio.ensure_future(self.handle.queue.get())
                done, _ = await asyncio.wait({nxt, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    self.server.engine_thread.abort(self.handle.request_id)
                    return Response(status_code=499)      # nobody reads it; nginx's "client closed"
                d: Delta = nxt.result()
                text.append(d.text)
                ids += d.token_ids
                if d.finished:
                    break
        except asyncio.CancelledError:
            self.server.engine_thread.abort(self.handle.request_id)
            raise
        finally:
            disconnected.cancel()
        if d.failure is not None:
            raise d.failure
        out = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": out}} if self.chat
                  else {"index": 0, "text": out})
        choice |= {"logprobs": None, "finish_reason": d.finish_reason}
        calls = parse_calls(out) if self.parsed.tools is not None else None
        if calls is not None:          # the model called tools: OpenAI's tool_calls message
            content, tool_calls = calls
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": tool_calls}
            if d.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        if self.parsed.return_token_ids:
            choice["token_ids"] = ids
        body = {**self._envelope("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": self._usage(d)}
        if self.parsed.return_token_ids:
            body["prompt_token_ids"] = self.accepted.prompt_token_ids
        return JSONResponse(body)


async def _disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so nothing else comes)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _sse(obj: dict, ascii_only: bool = False) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=ascii_only, separators=(',', ':'))}\n\n"
