"""The HTTP routes on FastAPI: OpenAI's API, ``/health``, ``/metrics``, the live page and its feed.

A generation request (``docs/concepts/serving.md``, "A request's life"): ``read_body`` (415 / 413 /
408) -> ``frontend`` (400 / 404) -> a ``RequestHandle`` per prompt to the engine thread -> its verdict
(``Accepted``, or 400 / 503) -> its ``Delta``s as SSE chunks or one response (``_Answer``). Nothing on
this loop grows with a request beyond copying its bytes and decoding its tokens, one at a time. A
stream always ends with a last event and ``data: [DONE]`` (``finish_reason: "abort"`` at shutdown, an
error object when its step failed or the engine died); a client that goes away is noticed in both
modes and its request aborted. Every error, FastAPI's own 404 / 405 and a 500 included, is OpenAI's
error object.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import importlib.resources
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minicb.core.errors import describe
from minicb.entrypoints.serve import logprob_format
from minicb.entrypoints.serve.detokenizer import RequestText
from minicb.entrypoints.serve.engine_thread import Accepted, Delta, RequestHandle, check_choices
from minicb.entrypoints.serve.extra_routes import engine_answers, extra_routes, model_card
from minicb.entrypoints.serve.frontend import Prepared, body_limit_error
from minicb.entrypoints.serve.limits import ServeLimits, flag
from minicb.entrypoints.serve.metrics import CONTENT_TYPE
from minicb.entrypoints.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from minicb.entrypoints.serve.tools import parse_calls, unwrapped

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
        body = await engine_answers(server, HEALTH_TIMEOUT_S)
        return body | {"engine_busy_s": round(server.engine_thread.busy_seconds, 6),
                       "live_listener_s": round(server.live.listener_seconds, 6),
                       "live_frame_s": round(server.live.frame_seconds, 6)}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(server)]}

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        raw = await read_body(request, server.limits)
        return await generate(server, request, await server.frontend.prepare("completion", raw))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        raw = await read_body(request, server.limits)
        return await generate(server, request, await server.frontend.prepare("chat", raw))

    app.include_router(extra_routes(server, read_body))   # /tokenize, /detokenize, /version, /ping, ...
    return app


def _body_schema(model) -> dict:
    """A route's request body for /openapi.json: the pydantic model's JSON schema (the body itself is
    read raw and checked in a worker process, ``protocol.py``)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": model.model_json_schema()}}}}


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
    """One engine request per prompt (a completions ``prompt`` may list several), all submitted at
    once so they join the same step; answered together, in prompt order."""
    parsed = prepared.parsed
    prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
    params = parsed.generate.params
    check_choices(params.n, server.engine_thread.engine.config.max_n)
    check_prompt_count(len(prepared.requests), server.engine_thread)
    handles = []
    base = f"{prefix}-{parsed.request_id or uuid.uuid4().hex}"     # the response's id
    several = len(prepared.requests) > 1
    for k, (ids, stops) in enumerate(prepared.requests):  # each prompt: its own request, decoder, stops
        rid = f"{base}-{k}" if several else base
        # n > 1: each choice its own decoder and stop strings (a stop ends that choice only)
        text = _request_text(server, params, rid, stops) if params.n == 1 else \
            [_request_text(server, params, rid, copy.deepcopy(stops), i) for i in range(params.n)]
        handles.append(RequestHandle(rid, dataclasses.replace(parsed.generate, prompt=ids), server.clock(),
                                     text))
    for handle in handles:
        server.engine_thread.submit(handle)

    def abort_all() -> None:
        for h in handles:
            server.engine_thread.abort(h.request_id)

    verdicts = []
    try:
        for handle in handles:
            verdicts.append(await handle.queue.get())
    except asyncio.CancelledError:
        abort_all()
        raise
    refused = next((v for v in verdicts if isinstance(v, ApiError)), None)
    if refused is not None:          # one prompt refused: the request is (its accepted prompts abort)
        abort_all()
        raise refused
    assert all(isinstance(v, Accepted) for v in verdicts)
    answer = _Answer(server, parsed, handles, verdicts, base)
    if parsed.stream:
        return EventStream(answer.stream(), abort_all)
    return await answer.whole(request, abort_all)


def check_prompt_count(num_prompts: int, engine_thread) -> None:
    """More prompts in one body than the server could ever hold at once (its slots and
    ``--max-waiting``): a 400, since no retry can succeed (a 503 would have SDKs retry in vain)."""
    room = engine_thread.engine.config.max_num_seqs + engine_thread.max_waiting
    if num_prompts > room:
        raise ApiError(400, f"the request holds {num_prompts:,} prompts; this server holds at most {room:,} "
                            f"requests at once (max_num_seqs + --max-waiting {engine_thread.max_waiting}): "
                            "send them in several requests", "invalid_request_error", "prompt")


def _request_text(server: Server, params, rid: str, stops,
                  index: int | None = None) -> RequestText:
    """The loop's decoder and stop strings of request ``rid`` (or of its choice ``index``)."""
    decoder = (server.tokenizer.incremental_decoder(params.skip_special_tokens)
               if server.tokenizer is not None else None)
    eos = server.engine_thread.engine.eos_token_id
    stop_ids = frozenset(params.stop_token_ids) - ({eos} if not params.ignore_eos else set())
    return RequestText(decoder, stops, functools.partial(server.engine_thread.abort, rid, "stop", index),
                       params.min_tokens, stop_ids)


class EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends (finished, client gone, cancelled): a
    generation aborts its request there. Starlette stops the stream as soon as the client goes away:
    it listens for ``http.disconnect`` beside it, since uvicorn's h11 says ASGI spec 2.3."""

    def __init__(self, content, on_close=None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                self._on_close()


class _Answer:
    """Builds OpenAI's response (or its SSE chunks) from the ``Delta``s of a request's prompts: ``n``
    choices per prompt, ``index = prompt_index * n + child`` (OpenAI's rule). With ``n > 1`` the Deltas
    of one prompt's ``n`` children arrive interleaved on its handle, each with its ``Delta.index``; a
    prompt is complete when every child has sent its finished Delta. Usage counts each prompt once and
    every choice's completion tokens. One ``_choice`` makes a choice for both modes: a chunk's from one
    Delta, the response's from a choice's Deltas joined."""

    def __init__(self, server: Server, parsed, handles: list[RequestHandle], accepted: list[Accepted],
                 response_id: str):
        self.server, self.parsed, self.handles, self.accepted = server, parsed, handles, accepted
        self.chat = parsed.kind == "chat"
        self.tokenizer = server.tokenizer
        self.N = parsed.generate.params.n          # choices per prompt
        self.envelope = {"id": response_id, "object": "", "created": int(time.time()),
                         "model": server.model_name}
        self.started: set[int] = set()             # choices that have sent their first chunk
        self.formats: dict[int, logprob_format.CompletionLogprobs] = {}   # text_offset runs on per choice
        self.prompt_scores: dict[int, list] = {}   # a prompt's logprobs, once one of its Deltas had them

    def _usage(self, finals: list[tuple[int, Delta]]) -> dict:
        prompt = sum({i: d.num_prompt_tokens for i, d in finals}.values())    # each prompt once
        done = sum(d.num_output_tokens for _, d in finals)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _usage_so_far(self, i: int, d: Delta | None) -> dict:
        """stream_options.continuous_usage_stats: prompt ``i``'s tokens and this choice's so far."""
        prompt = len(self.accepted[i].prompt_token_ids)
        done = d.num_output_tokens if d is not None else 0
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _name(self, token_id: int) -> str:
        if self.tokenizer is None or self.parsed.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _echo_text(self, i: int) -> str:
        """The prompt as given (text), or its ids decoded (vLLM's echo of a token-id prompt)."""
        prompt = self.parsed.prompts[i] if self.parsed.prompts else self.parsed.generate.prompt
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(self.accepted[i].prompt_token_ids) if self.tokenizer is not None else ""

    def _logprobs(self, i: int, j: int, d: Delta, first: bool):
        """This Delta's ``logprobs`` object (completions: the prompt's tokens first when echoing)."""
        k, as_ids = self.parsed.logprobs, self.parsed.tokens_as_ids
        if k is None:
            return None
        ids, entries = list(d.token_ids), list(d.logprobs or [])
        if self.chat:
            return logprob_format.chat_logprobs(ids, entries, k, as_ids)
        if first and self.parsed.echo:
            prompt = self.accepted[i].prompt_token_ids
            scored = d.prompt_logprobs or self.prompt_scores.get(i) or [None] * len(prompt)
            ids, entries = prompt + ids, scored + entries
        fmt = self.formats.setdefault(j, logprob_format.CompletionLogprobs(k, as_ids))
        return fmt.add(ids, entries, self._name)

    def _prompt_logprobs(self, d: Delta | None):
        k = self.parsed.prompt_logprobs
        return None if k is None or d is None or d.prompt_logprobs is None else \
            logprob_format.prompt_logprobs(d.prompt_logprobs, k)

    def _choice(self, i: int, c: int, d: Delta | None, final: bool, stream: bool) -> dict:
        """Choice ``c`` of prompt ``i``: a chunk's (``stream``) or the response's (``final``: it ends)."""
        p, j = self.parsed, self.index(i, c)
        first = j not in self.started
        self.started.add(j)
        text = d.text if d is not None else ""
        logprobs = self._logprobs(i, j, d, first) if d is not None else None
        reason = d.finish_reason if final else None
        tools = final and self.chat and p.tools is not None       # a whole answer: parsed for calls
        calls = parse_calls(text) if tools else None
        if tools and calls is None:
            text = unwrapped(text)                    # a call cut short: its text only
        if calls is not None:                         # the model called tools: OpenAI's tool_calls
            content, tool_calls = calls
            msg = ({"tool_calls": [{"index": k, **call} for k, call in enumerate(tool_calls)]}
                   | ({"content": content} if content else {})) if stream else \
                {"role": "assistant", "content": content, "tool_calls": tool_calls}
            reason = "tool_calls" if reason == "stop" else reason
        elif stream and not first:
            msg = {"content": text} if text else {}
        else:
            msg = {"role": "assistant", "content": text}
        choice = {"index": j, "delta" if stream else "message": msg} if self.chat else \
            {"index": j, "text": (self._echo_text(i) if first and p.echo else "") + text}
        choice |= {"logprobs": logprobs, "finish_reason": reason,
                   "stop_reason": d.stop_reason if final else None}
        if p.return_token_ids:
            choice["token_ids"] = list(d.token_ids) if d is not None else []
        if not self.chat and self._prompt_logprobs(d) is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(d)
        return choice

    def index(self, prompt_index: int, child: int = 0) -> int:
        return prompt_index * self.N + child

    def _body(self, obj: str, choices: list) -> dict:
        return {**self.envelope, "object": obj, "choices": choices}

    # --- streaming ------------------------------------------------------------------------------
    async def stream(self):
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        p = self.parsed

        def chunk(i: int, c: int, d: Delta | None, final: bool = False) -> str:
            first = self.index(i, c) not in self.started
            body = self._body(obj, [self._choice(i, c, d, final, stream=True)])
            if p.return_token_ids and first:
                body["prompt_token_ids"] = self.accepted[i].prompt_token_ids
            if self.chat and self._prompt_logprobs(d) is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(d)
            if p.include_usage:
                body["usage"] = self._usage_so_far(i, d) if p.continuous_usage else None
            return _sse(body)

        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            ended = 0
            while ended < self.N:
                d = await handle.queue.get()
                merged.put_nowait((i, d))
                ended += d.finished

        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(self.handles)]
        # with tools: each choice's whole answer, sent at its end
        held: list[list[Delta]] = [[] for _ in range(len(self.handles) * self.N)]
        try:
            if self.chat:              # OpenAI's first chat chunk per choice: the role, no content yet
                for i in range(len(self.handles)):
                    for c in range(self.N):
                        yield chunk(i, c, None)
            finals: list[tuple[int, Delta]] = []
            while len(finals) < len(self.handles) * self.N:
                i, d = await merged.get()
                if d.failure is not None and d.finish_reason != "abort":   # a failed step, a dead engine
                    yield _sse(d.failure.body(), ascii_only=True)
                    break
                if d.prompt_logprobs:
                    self.prompt_scores[i] = d.prompt_logprobs
                if p.tools is not None:
                    held[self.index(i, d.index)].append(d)
                    if d.finished:
                        finals.append((i, d))
                        yield chunk(i, d.index, _joined(held[self.index(i, d.index)]), final=True)
                elif d.finished:
                    finals.append((i, d))
                    yield chunk(i, d.index, d, final=True)
                elif d.text or (p.return_token_ids and d.token_ids) or d.logprobs or d.prompt_logprobs:
                    yield chunk(i, d.index, d)
            else:
                if p.include_usage:
                    yield _sse({**self._body(obj, []), "usage": self._usage(finals)})
        finally:
            for task in pumps:
                task.cancel()
        yield "data: [DONE]\n\n"

    # --- one response ---------------------------------------------------------------------------
    async def whole(self, request: Request, abort_all):
        disconnected = asyncio.ensure_future(_disconnect(request))
        gathered = [asyncio.ensure_future(self._gather(h, self.N)) for h in self.handles]
        try:
            pending = set(gathered)
            while pending:
                done, _ = await asyncio.wait(pending | {disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if disconnected in done:
                    abort_all()
                    return Response(status_code=499)      # nobody reads it; nginx's "client closed"
                pending -= done
                failed = next((d.failure for t in done for d in t.result() if d.failure), None)
                if failed is not None:
                    abort_all()
                    raise failed
        except asyncio.CancelledError:
            abort_all()
            raise
        finally:
            disconnected.cancel()
            for task in gathered:
                task.cancel()
        choices, finals, joined = [], [], None
        for i, task in enumerate(gathered):
            deltas = task.result()
            self.prompt_scores[i] = next((x.prompt_logprobs for x in deltas if x.prompt_logprobs), None)
            for c in range(self.N):
                mine = [x for x in deltas if x.index == c]
                finals.append((i, mine[-1]))
                joined = dataclasses.replace(_joined(mine), prompt_logprobs=self.prompt_scores[i])
                choices.append(self._choice(i, c, joined, final=True, stream=False))
                if self.parsed.return_token_ids and len(self.handles) > 1:
                    choices[-1]["prompt_token_ids"] = self.accepted[i].prompt_token_ids
        body = {**self._body("chat.completion" if self.chat else "text_completion", choices),
                "usage": self._usage(finals)}
        if self.parsed.return_token_ids:
            body["prompt_token_ids"] = self.accepted[0].prompt_token_ids
        if self.chat and self._prompt_logprobs(joined) is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(joined)
        return JSONResponse(body)

    @staticmethod
    async def _gather(handle: RequestHandle, n: int) -> list[Delta]:
        """Every Delta of one prompt until each of its ``n`` children has sent its last."""
        deltas: list[Delta] = []
        ended = 0
        while ended < n:
            d: Delta = await handle.queue.get()
            deltas.append(d)
            ended += d.finished
        return deltas


def _joined(deltas: list[Delta]) -> Delta:
    """A choice's Deltas as one (the last one's counts and reason; texts, ids, logprobs joined)."""
    d = deltas[-1]
    logprobs = None if all(x.logprobs is None for x in deltas) else \
        [e for x in deltas for e in x.logprobs or []]
    return Delta("".join(x.text for x in deltas), [t for x in deltas for t in x.token_ids],
                 d.num_prompt_tokens, d.num_output_tokens, d.finished, d.finish_reason, d.error, d.failure,
                 logprobs, next((x.prompt_logprobs for x in deltas if x.prompt_logprobs), None), d.index,
                 d.stop_reason)


async def _disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read, so nothing else comes)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _sse(obj: dict, ascii_only: bool = False) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=ascii_only, separators=(',', ':'))}\n\n"
