"""The frontend: everything a request needs before the engine sees it, in a worker pool.

::

    event loop                      worker pool (threads)                        engine thread
    ──────────                      ─────────────────────                        ─────────────
    read the body (bounded:   ──►   JSON -> checked fields (protocol.py)   ──►   add_request(ids)
    size, deadline, type)           -> chat template -> token ids               step, step, ...
                                    -> stop-string matcher
                                    -> structured output: its grammar compiled
                                       (cached per constraint)

The event loop serves every client and the engine thread steps every request: neither may run
anything whose cost grows with a request. Parsing a JSON body, rendering the chat template of a
thousand messages, tokenizing 200,000 characters, building a matcher for long stop strings: each is
linear in the request but takes milliseconds to seconds, and on the loop or the engine thread it
would freeze every stream for that long. So they run here, in a ``ThreadPoolExecutor`` (vLLM V1 does
the same work in its frontend process, SGLang in a tokenizer process): the HF tokenizer and the JSON
parser are C / Rust code, and the engine thread's torch kernels release the GIL, so the threads
overlap. The engine thread gets token ids and a ready matcher and does only what is its own: add the
request (its own checks, linear in a prompt of at most ``max_model_len`` tokens) and step.

Detokenizing stays in the engine's step: it is incremental, a table lookup per generated token
(``IncrementalDecoder``), the same cost as sampling the token.

Every bound of ``limits.py`` is checked here in the order the work happens, so the work a request
can cause is known before it starts; any bad input is an ``ApiError`` (400 / 404 / 413), never a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from dataclasses import dataclass

from minicb.core.errors import InvalidArgument, describe
from minicb.entrypoints.serve.limits import MAX_JSON_DEPTH, ServeLimits, flag
from minicb.entrypoints.serve.protocol import (
    ApiError,
    ParsedRequest,
    bad_request,
    parse_chat,
    parse_completion,
)
from minicb.entrypoints.serve.stops import StopMatcher


@dataclass(slots=True)
class Prepared:
    """A request ready for the engine thread: checked, tokenized, with its stop-string matcher."""

    parsed: ParsedRequest
    prompt_token_ids: list[int]            # the (first) prompt's
    stops: StopMatcher
    more: tuple[tuple[list[int], StopMatcher], ...] = ()   # the other prompts of a list, each its own matcher

    @property
    def requests(self) -> list[tuple[list[int], StopMatcher]]:
        """(token ids, stop matcher) of every prompt, in order: one engine request each."""
        return [(self.prompt_token_ids, self.stops), *self.more]


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class Frontend:
    """Turns request bodies into ``Prepared`` requests on a pool of worker threads."""

    def __init__(self, *, model_name: str, tokenizer, vocab_size: int, max_model_len: int,
                 limits: ServeLimits, allow_control_text: bool = False, workers: int | None = None) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits.with_model_len(max_model_len)
        self.control_texts: tuple[str, ...] = ()
        if tokenizer is not None and not allow_control_text:
            texts = (tokenizer.id_to_token(i) for i in sorted(tokenizer.all_special_ids))
            self.control_texts = tuple(t for t in texts if t)
        self.workers = default_workers() if workers is None else workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="minicb-frontend")

    def close(self) -> None:
        """Stop the workers; requests still being prepared finish (they are refused by the engine)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, kind: str, raw: bytes) -> Prepared:
        """Run ``prepare_now`` in the pool (the caller's loop keeps serving meanwhile)."""
        if self._pool is None:
            return self.prepare_now(kind, raw)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.prepare_now, kind, raw)

    async def call(self, fn, *args):
        """``fn(*args)`` in the pool (``/tokenize`` and ``/detokenize`` run the tokenizer there)."""
        if self._pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- the work, on a worker thread -----------------------------------------------------------
    def prepare_now(self, kind: str, raw: bytes) -> Prepared:
        body = parse_json(raw)
        self._check_model(body)
        if kind == "chat":
            parsed = parse_chat(body, self._render, self.limits, self.control_texts)
        else:
            parsed = parse_completion(body, self.limits)
        prompts = parsed.prompts or (parsed.generate.prompt,)
        ids = [self._token_ids(parsed, p) for p in prompts]
        total, cap = sum(map(len, ids)), self.limits.max_prompt_tokens
        if len(ids) > 1 and total > cap:          # the bound holds for the whole body, as for one prompt
            raise bad_request(f"the {len(ids)} prompts have {total:,} tokens; at most {cap:,} are allowed in "
                              f"one request ({flag('max_prompt_tokens')}, at most max_model_len)", "prompt",
                              "context_length_exceeded")
        self._compile(parsed)
        gen = parsed.generate
        stop = gen.params.include_stop_str_in_output
        return Prepared(parsed, ids[0], StopMatcher(gen.stops, stop),
                        tuple((i, StopMatcher(gen.stops, stop)) for i in ids[1:]))

    def _compile(self, parsed: ParsedRequest) -> None:
        """Compile the request's grammar here, off the engine thread: a bad one is a 400 now, a good one
        is cached, and the engine thread's ``register`` only copies the compiled matcher."""
        spec = parsed.generate.params.structured_outputs
        if spec is None:
            return
        param = parsed.constraint_param
        if self.tokenizer is None or self.tokenizer.eos_token_id is None:
            raise bad_request("structured outputs need the model's tokenizer and its EOS token", param)
        from minicb.runtime.grammar import compiled

        try:
            compiled(spec, self.tokenizer, self.vocab_size, self.tokenizer.eos_token_id)
        except InvalidArgument as e:
            raise bad_request(str(e), param) from None

    def _check_model(self, body) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model != self.model_name:
            plain = len(model) <= 100 and model.isprintable() and _encodable(model)
            shown = model if plain else describe(model)
            raise ApiError(404, f"the model `{shown}` does not exist; this server serves "
                                f"`{self.model_name}` (GET /v1/models)", "invalid_request_error", "model",
                           "model_not_found")

    def _render(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise InvalidArgument("the model has no tokenizer, so no chat template: use /v1/completions "
                                  "with token ids")
        return self.tokenizer.apply_chat_template(messages)

    def _token_ids(self, parsed: ParsedRequest, prompt) -> list[int]:
        param = "messages" if parsed.kind == "chat" else "prompt"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request("prompt is text but the model has no tokenizer; pass token ids", param)
            try:               # bounded first: at most max_model_len tokens' worth of characters
                ids = self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
            except InvalidArgument as e:
                raise bad_request(str(e), param, "context_length_exceeded"
                                  if "allowed" in str(e) else None) from None
        else:
            ids = prompt
        if not ids:
            raise bad_request("prompt must not be empty: it needs at least 1 token (it has 0)", param)
        cap = self.limits.max_prompt_tokens
        if len(ids) > cap:               # the engine would refuse it too, after checking every id
            raise bad_request(f"the prompt has {len(ids):,} tokens; at most {cap:,} are allowed "
                              f"({flag('max_prompt_tokens')}, at most max_model_len)", param,
                              "context_length_exceeded")
        top = max(ids)                                   # one C loop: the ids are plain ints by now
        if top >= self.vocab_size:
            raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size - 1}] (the "
                              f"vocabulary), got {top} at index {ids.index(top)}", param)
        return ids


def parse_json(raw: bytes):
    """The body as JSON, or a 400: invalid JSON or UTF-8, an integer of more than 4,300 digits,
    nesting deeper than ``MAX_JSON_DEPTH``."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:        # JSONDecodeError is a ValueError; so is 10**5000
        raise bad_request(f"the request body is not valid JSON: {_one_line(e)}") from None
    _check_depth(body)
    return body


def _check_depth(body) -> None:
    """Walk the containers only (no recursion): a body of 100,000 ints costs one pass over them."""
    level: list = [body]
    for _depth in range(MAX_JSON_DEPTH + 1):
        nxt = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(x for x in v.values() if isinstance(x, (list, dict)))
            elif isinstance(v, list):
                nxt.extend(x for x in v if isinstance(x, (list, dict)))
        if not nxt:
            return
        level = nxt
    raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def body_limit_error(size: int, limits: ServeLimits) -> ApiError:
    return ApiError(413, f"the request body has {size:,} bytes or more; at most {limits.max_body_bytes:,} "
                         f"are allowed ({flag('max_body_bytes')})", "invalid_request_error", None,
                    "request_too_large")
