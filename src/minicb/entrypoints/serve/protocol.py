"""The OpenAI request bodies the server accepts, checked and turned into what the engine needs.

::

    POST /v1/completions       {"model", "prompt": "text" | [token ids], "max_tokens": 16, ...}
    POST /v1/chat/completions  {"model", "messages": [{"role", "content"}], "max_completion_tokens", ...}

Both become one ``GenerateRequest``: a prompt (text, token ids, or the chat template rendered to
text), ``SamplingParams`` and the stop strings. Everything a client can get wrong is found here and
reported as an ``ApiError`` (HTTP 400, OpenAI's error object, ``param`` naming the field), before the
request reaches the engine; what only the engine can judge (the prompt's length in tokens against
``max_model_len`` and the KV pool) is judged on the engine thread and reported the same way.

Field by field (vLLM's choices where OpenAI leaves room):

* ``temperature`` defaults to 1.0 and ``top_p`` to 1.0, as OpenAI's; ``temperature: 0`` is greedy.
* ``top_k`` (vLLM's extension): 0 or -1 means off. ``seed``: per-request generator, reproducible.
* ``max_tokens`` defaults to 16 for completions (OpenAI's default) and, for chat, to whatever room the
  prompt leaves (``max_model_len`` and the KV pool: the engine thread fills it in).
* ``stop``: a string or a list of strings, matched on the decoded text, never part of the output.
  ``stop_token_ids`` and ``ignore_eos`` are vLLM's extensions, passed to ``SamplingParams``.
* ``prompt`` (completions) may be a list of strings or of token-id lists: each is its own engine
  request, batched by the engine like any other, answered in prompt order with OpenAI's choice
  ``index`` (``prompt_index * n + child``). The cost bounds hold for the whole body (characters or
  ids summed over the prompts) and so for each prompt.
* Logprobs: completions ``logprobs: k`` (the sampled token's logprob and the top ``k``: OpenAI's
  ``{tokens, token_logprobs, top_logprobs, text_offset}``) and ``echo: true`` (the prompt is returned
  before the completion, and with ``logprobs`` its tokens' logprobs too, the first one ``null``);
  chat ``logprobs: true`` + ``top_logprobs: k`` (``{content: [{token, logprob, bytes, top_logprobs}]}``);
  vLLM's ``prompt_logprobs: k`` on both (``prompt_logprobs``: per prompt token ``{id: {logprob, rank,
  decoded_token}}``, ``null`` first). ``k`` is at most 20; ``-inf`` is sent as -9999.0 (vLLM's floor).
* ``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` (``structured.py``) constrain
  the output with a grammar; ``tools`` / ``tool_choice`` on chat (``tools.py``) render the tools for
  the model and parse its calls (``required`` / a named function forced by a grammar).
* The sampling knobs (``minicb.runtime.logits_processors``): OpenAI's ``presence_penalty`` and
  ``frequency_penalty`` (in [-2, 2]) and ``logit_bias`` (an object of token id -> bias in [-100, 100],
  at most ``--max-logit-bias`` entries, ids in the vocabulary); vLLM's ``repetition_penalty`` (> 0),
  ``min_p`` (in [0, 1]), ``min_tokens`` (at most ``max_tokens``; stop strings are not matched before
  it either, as vLLM), ``bad_words`` (at most ``--max-bad-words`` strings of
  ``--max-bad-words-chars`` characters in all), ``include_stop_str_in_output`` (the matched stop
  string stays in the text) and ``skip_special_tokens`` (default true).
* ``n`` choices (parallel sampling) up to the engine's ``max_n``. ``best_of``, chat's ``echo``, vLLM's
  ``spaces_between_special_tokens``, ``allowed_token_ids``, beam search (``use_beam_search``,
  ``length_penalty``, ``early_stopping``), ``prompt_embeds``, ``logits_processors``, ``vllm_xargs``,
  ``kv_transfer_params``, ``guided_whitespace_pattern``, OpenAI's ``prediction`` / ``audio`` and the chat
  fields that would change the rendered prompt (``add_generation_prompt: false``,
  ``continue_final_message``, ``chat_template``, ``chat_template_kwargs``, ``mm_processor_kwargs``,
  ``documents``): a clear 400 naming the field
  rather than a silently different answer. ``user`` must be a string (it is not used). Unknown fields
  are ignored (clients send extras).
* The scalar fields (numbers, flags, strings) are one pydantic model, ``Fields``, built from the
  ``RANGES`` table: each field's type and range in one place, strict (no ``"5"`` for 5, no ``true``
  for 1), its JSON schema (with the bodies' other fields: ``CompletionRequest``,
  ``ChatCompletionRequest``) at ``/openapi.json``; ``_message`` words pydantic's first error as
  minicb's 400. What depends on the server's flags (list lengths, characters) is checked by hand.
* Numbers are checked to their end: a count or an id above 2**63 - 1, a temperature between 0 and
  1e-5, NaN, a 5,000-digit integer are each a 400 naming the field, never a 500.
* The cost bounds of ``limits.py`` (prompt characters and ids, messages, stop strings) are checked
  here, before the chat template or the tokenizer runs; ``chat`` refuses message text that contains
  the model's control tokens (``<|im_start|>``) unless the server allows it (``--allow-control-text``):
  rendered by the template, such text would become real control tokens (a user forging a system turn).
* vLLM's request fields: ``stream_options.continuous_usage_stats`` (with ``include_usage``: every chunk
  carries the usage so far, its choice's completion tokens), ``return_tokens_as_token_ids`` (the
  logprobs' tokens are ``"token_id:N"``), ``request_id`` (the response's id is ``cmpl-`` /
  ``chatcmpl-`` + it), ``priority`` (lower is more important; a 400 unless the server runs
  ``--scheduling-policy priority``, as vLLM), ``cache_salt`` (prefix-cache blocks are shared only
  between requests of one salt). Every choice carries vLLM's ``stop_reason``: the stop string or stop
  token id that ended it, else ``null``.
* ``return_token_ids`` (vLLM's extension): the response carries ``prompt_token_ids`` and each
  choice its ``token_ids``; the tests use it to compare with ``LLM.generate`` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import ConfigDict, Field, ValidationError, create_model

from minicb.core.errors import InvalidArgument, check_float, check_int, describe
from minicb.core.sampling_params import MAX_INT, MAX_LOGPROBS, SamplingParams
from minicb.entrypoints.serve.errors import ApiError, bad_request  # noqa: F401 - ApiError: re-exported
from minicb.entrypoints.serve.limits import ServeLimits, flag
from minicb.entrypoints.serve.structured import parse_structured
from minicb.entrypoints.serve.tools import ToolRequest, constraint, parse_tools, template_messages

DEFAULT_LIMITS = ServeLimits()
MAX_STOP_STRINGS = DEFAULT_LIMITS.max_stop


@dataclass(slots=True, frozen=True)
class GenerateRequest:
    """One request as the engine thread needs it. ``params.max_tokens`` is a placeholder when
    ``max_tokens_from_room`` (chat without a limit): the engine thread sets it from the prompt length."""

    prompt: str | list[int]
    params: SamplingParams
    stops: tuple[str, ...] = ()
    max_tokens_from_room: bool = False
    priority: int = 0                 # vLLM's: lower is more important (--scheduling-policy priority only)


@dataclass(slots=True, frozen=True)
class ParsedRequest:
    """A checked body: what to generate and how to answer (stream or not, usage, token ids)."""

    kind: str                      # "completion" | "chat"
    model: str | None
    generate: GenerateRequest
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tools: ToolRequest | None = None          # chat with tools shown: the output is parsed for calls
    constraint_param: str | None = None       # the field a structured-output constraint came from
    prompts: tuple = ()               # every prompt of the body, in order (``generate.prompt`` is the first)
    echo: bool = False                # completions: return the prompt before the completion
    logprobs: int | None = None       # top logprobs per token in the answer (None: no logprobs field)
    prompt_logprobs: int | None = None   # vLLM's ``prompt_logprobs`` asked for (None: not in the answer)
    continuous_usage: bool = False    # stream_options.continuous_usage_stats: usage in every chunk
    tokens_as_ids: bool = False       # vLLM's return_tokens_as_token_ids: logprobs' tokens "token_id:N"
    request_id: str | None = None     # vLLM's request_id: the response's id ("cmpl-" + it)


# fields we do not implement: a client that sets them gets a 400 instead of a silently different answer
_UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""), "functions": (None, []),
    # vLLM's extensions that minicb does not implement (yet)
    "spaces_between_special_tokens": (None, True), "guided_decoding_backend": (None,),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    # beam search (vLLM's): not implemented, and n > 1 would otherwise return n sampled texts
    "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1), "early_stopping": (None, False),
    "prompt_embeds": (None,), "logits_processors": (None, []), "vllm_xargs": (None, {}),
    "kv_transfer_params": (None, {}), "guided_whitespace_pattern": (None,),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
}
# chat fields of vLLM's that change the rendered prompt: refused unless they ask for what minicb does
_UNSUPPORTED_CHAT = {
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
    "documents": (None, []),
}
MAX_REQUEST_ID_CHARS = 256


def parse_completion(body: Any, limits: ServeLimits = DEFAULT_LIMITS) -> ParsedRequest:
    body = _object(body)
    if "prompt" not in body:
        raise bad_request("prompt is required: a string or a list of token ids", "prompt")
    check_model(body)
    if body.get("tools") or body.get("tool_choice") is not None:
        raise bad_request("tools and tool_choice are for /v1/chat/completions", "tools")
    prompts = _prompts(body["prompt"], limits)
    return _parse(body, "completion", prompts, default_max_tokens=16, limits=limits)


def parse_chat(body: Any, render, limits: ServeLimits = DEFAULT_LIMITS,
               control_texts: tuple[str, ...] = ()) -> ParsedRequest:
    """``render(messages) -> str`` applies the model's chat template (``Tokenizer.apply_chat_template``).
    A message whose text contains one of ``control_texts`` (the model's control tokens) is refused."""
    body = _object(body)
    check_model(body)
    tools = parse_tools(body, limits)
    _unsupported(body, _UNSUPPORTED_CHAT)
    messages = _messages(template_messages(body.get("messages"), tools, _content), limits)
    _no_control_text(messages, control_texts)
    try:
        prompt = render(messages)
    except InvalidArgument as e:
        raise bad_request(str(e), "messages") from None
    except Exception as e:   # noqa: BLE001 - a template's raise_exception(): the messages broke its rules
        raise bad_request(f"the model's chat template rejected the messages: {e}", "messages") from None
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return _parse(body, "chat", [prompt], default_max_tokens=None, limits=limits, tools=tools)


def check_model(body: dict) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {type(model).__name__}", "model")


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _unsupported(body: dict, table: dict, prefix: str = "") -> None:
    for name, defaults in table.items():
        if name in body and not _is_default(body[name], defaults):
            raise bad_request(f"{prefix}{name} is not supported by minicb serve (leave it unset)",
                              prefix + name)


# --- the scalar fields: types and ranges in one place (pydantic), shown at /openapi.json -------------
# name: (type, low, high, low excluded). Floats accept JSON integers, never booleans; NaN is in no range.
RANGES: dict[str, tuple[type, float | None, float | None, bool]] = {
    "max_tokens": (int, 1, MAX_INT, False), "temperature": (float, 0.0, 2.0, False),
    "top_p": (float, 0.0, 1.0, True), "top_k": (int, -1, MAX_INT, False), "seed": (int, 0, MAX_INT, False),
    "presence_penalty": (float, -2.0, 2.0, False), "frequency_penalty": (float, -2.0, 2.0, False),
    "repetition_penalty": (float, 0.0, None, True), "min_p": (float, 0.0, 1.0, False),
    "min_tokens": (int, 0, MAX_INT, False), "n": (int, 1, MAX_INT, False),
    "priority": (int, -MAX_INT - 1, MAX_INT, False),
}
_FLAGS = ("stream", "echo", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
          "return_token_ids", "return_tokens_as_token_ids")


def _ranged(kind: type, lo, hi, lo_open: bool):
    bound = {"gt" if lo_open else "ge": lo} if lo is not None else {}
    if hi is not None:
        bound["le"] = hi
    return Annotated[kind, Field(strict=True, allow_inf_nan=False, **bound) if kind is float
                     else Field(strict=True, **bound)]


_Text = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_REQUEST_ID_CHARS)]

Fields = create_model(
    "Fields", __config__=ConfigDict(extra="allow"),
    **{name: (_ranged(*r) | None, None) for name, r in RANGES.items()},
    **{name: (Annotated[bool, Field(strict=True)] | None, None) for name in _FLAGS},
    stop_token_ids=(list[_ranged(int, 0, MAX_INT, False)] | None, None),
    model=(Annotated[str, Field(strict=True)] | None, None),
    user=(Annotated[str, Field(strict=True)] | None, None),
    request_id=(Annotated[_Text, Field(pattern=r"^[^\x00-\x1f\x7f]*$")] | None, None),
    cache_salt=(_Text | None, None),
)
Fields.__doc__ = """The body's scalar fields (both endpoints): OpenAI's names and vLLM's extensions, each with
its type and range. ``None`` is "unset" (the default applies). Unknown fields pass (clients send extras)."""


_Ids = list[Annotated[int, Field(ge=0, le=MAX_INT)]]
_Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
# The rest of each body, declared for /openapi.json; checked by hand below and in structured.py / tools.py
# (their bounds are the server's flags, their messages name them).
_BODY = dict(stop=(str | list[str] | None, None), logit_bias=(dict[str, float] | None, None),
             bad_words=(list[str] | None, None), prompt_logprobs=(_Logprobs | None, None),
             stream_options=(dict[str, bool] | None, None), response_format=(dict | None, None),
             structured_outputs=(dict | None, None))
CompletionRequest = create_model("CompletionRequest", __base__=Fields, __doc__="POST /v1/completions",
                                 prompt=(str | _Ids | list[str] | list[_Ids], ...),
                                 logprobs=(_Logprobs | None, None), **_BODY)
ChatCompletionRequest = create_model("ChatCompletionRequest", __base__=Fields,
                                     __doc__="POST /v1/chat/completions", messages=(list[dict], ...),
                                     max_completion_tokens=(int | None, None),
                                     logprobs=(bool | None, None), top_logprobs=(_Logprobs | None, None),
                                     tools=(list[dict] | None, None), tool_choice=(str | dict | None, None),
                                     parallel_tool_calls=(bool | None, None), **_BODY)


def _what(value) -> str:
    return f"{type(value).__name__} {describe(value)}"


def _message(err: dict) -> tuple[str, str]:
    """A pydantic error as (message, param) in minicb's words: the field and what it must be."""
    loc = [str(x) for x in err["loc"] if not str(x).startswith(("constrained-", "function-"))]
    name = loc[0] + "".join("[i]" for x in loc[1:] if x.isdigit())
    value, kind = err["input"], err["type"]
    r = RANGES.get(loc[0]) if len(loc) == 1 else (int, 0, MAX_INT, False)
    if kind == "bool_type":
        return f"{name} must be true or false, got {describe(value)}", loc[0]
    if kind == "list_type":
        return f"{name} must be a list, got {type(value).__name__}", loc[0]
    if kind.startswith("string") and loc[0] in ("request_id", "cache_salt"):
        return (f"{name} must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} printable characters, "
                f"got {describe(value)}"), loc[0]
    if kind.startswith("string"):
        return f"{name} must be a string, got {type(value).__name__}", loc[0]
    if kind.startswith("int"):
        return f"{name} must be an integer, got {_what(value)}", loc[0]
    if kind.startswith("float"):
        return f"{name} must be a number, got {_what(value)}", loc[0]
    kind_, lo, hi, lo_open = r
    if kind_ is float:
        lo, hi = (None if lo is None else float(lo)), (None if hi is None else float(hi))
    rng = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    if kind == "finite_number" and hi is None:       # NaN is out of any range; inf only of an open one
        return f"{name} must be a finite number in {rng}, got {describe(value)}", loc[0]
    return f"{name} must be in {rng}, got {describe(value)}", loc[0]


def checked_fields(body: dict):
    """``Fields`` of ``body``; the first error as a 400 naming its field."""
    try:
        return Fields.model_validate(body)
    except ValidationError as e:
        message, param = _message(e.errors(include_url=False)[0])
        raise bad_request(message, param) from None


def _parse(body: dict, kind: str, prompts: list, default_max_tokens: int | None,
           limits: ServeLimits = DEFAULT_LIMITS, tools: ToolRequest | None = None) -> ParsedRequest:
    _unsupported(body, _UNSUPPORTED)
    f = checked_fields({k: v for k, v in body.items() if k != "logprobs"})
    logprobs, echo, prompt_logprobs = _logprob_fields(body, kind, f)
    structured, param = parse_structured(body, limits)
    forced = constraint(tools) if tools is not None else None
    if forced is not None:
        if structured is not None:
            raise bad_request(f"tool_choice {tools.choice!r} forces a tool call; it cannot be combined with "
                              f"{param}", param)
        structured, param = forced, "tools"
    stream = bool(f.stream)
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request("stream_options is allowed only with stream: true", "stream_options")
        for name in ("include_usage", "continuous_usage_stats"):
            if opts.get(name) is not None and not isinstance(opts[name], bool):
                raise bad_request(f"stream_options.{name} must be true or false, got {describe(opts[name])}",
                                  f"stream_options.{name}")
        include_usage = bool(opts.get("include_usage"))
        # vLLM's: each chunk carries the usage so far; with include_usage only, as in vLLM
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
    from_room = f.max_tokens is None and default_max_tokens is None
    max_tokens = MAX_INT if from_room else (default_max_tokens if f.max_tokens is None else f.max_tokens)
    stops = _stops(body.get("stop"), limits)
    # echo + logprobs scores the prompt too: its tokens' logprobs are prompt logprobs, as in vLLM
    scored = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    params = _sampling_params(body, f, max_tokens, limits, structured, logprobs=logprobs,
                              prompt_logprobs=max(scored) if scored else None)
    generate = GenerateRequest(prompts[0], params, stops, from_room, f.priority or 0)
    return ParsedRequest(kind, f.model, generate, stream, include_usage, bool(f.return_token_ids),
                         tools if tools is not None and tools.shown else None, param, tuple(prompts), echo,
                         logprobs, prompt_logprobs, continuous, bool(f.return_tokens_as_token_ids),
                         f.request_id)


def _logprob_fields(body: dict, kind: str, f) -> tuple[int | None, bool, int | None]:
    """(top logprobs per generated token or None, echo, prompt_logprobs or None), checked.

    Completions: ``logprobs`` is the count (OpenAI's legacy field); chat: ``logprobs`` is a bool and
    ``top_logprobs`` the count, which needs ``logprobs: true`` (OpenAI's rule)."""
    def count(name):
        v = body.get(name)
        if v is None or (v is False and name == "logprobs"):    # completions' logprobs: false = unset
            return None
        if type(v) is bool:
            raise bad_request(f"{name} must be an integer, got {describe(v)}", name)
        try:
            return check_int(name, v, lo=0, hi=MAX_LOGPROBS)
        except InvalidArgument as e:
            raise bad_request(str(e), name) from None

    prompt_logprobs = count("prompt_logprobs")
    if kind == "completion":
        return count("logprobs"), bool(f.echo), prompt_logprobs
    if body.get("echo") not in (None, False):
        raise bad_request("echo is not supported by minicb serve for chat (leave it unset)", "echo")
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request(f"logprobs must be true or false, got {describe(wanted)}", "logprobs")
    top = count("top_logprobs")
    if top and not wanted:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return ((top or 0) if wanted else None), False, prompt_logprobs


def _is_default(value, defaults: tuple) -> bool:
    """``value`` is one of ``defaults`` with the same type (so ``logprobs: 0`` is not ``False``)."""
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


def _sampling_params(body: dict, f, max_tokens, limits: ServeLimits = DEFAULT_LIMITS, structured=None, *,
                     logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """``f`` holds the checked scalar fields; what depends on the server's flags is checked here."""
    def stop_token_ids():
        ids = f.stop_token_ids or []
        if len(ids) > limits.max_stop_token_ids:
            raise InvalidArgument(f"stop_token_ids may hold at most {limits.max_stop_token_ids} ids "
                                  f"({flag('max_stop_token_ids')}), got {len(ids)}")
        return tuple(ids)

    def logit_bias():
        bias = body.get("logit_bias")
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise InvalidArgument("logit_bias must be an object of token id -> bias, got "
                                  f"{type(bias).__name__}")
        if len(bias) > limits.max_logit_bias:
            raise InvalidArgument(f"logit_bias may hold at most {limits.max_logit_bias:,} entries "
                                  f"({flag('max_logit_bias')}), got {len(bias):,}")
        out = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19):
                raise InvalidArgument(f"logit_bias keys must be token ids (decimal integers), got "
                                      f"{describe(key)}")
            if type(value) not in (int, float):
                raise InvalidArgument(f"logit_bias[{key}] must be a number in [-100, 100], got "
                                      f"{describe(value)}")
            out[check_int("logit_bias token id", int(key), lo=0, hi=MAX_INT)] = \
                check_float(f"logit_bias[{key}]", value, lo=-100.0, hi=100.0)
        return out

    def bad_words():
        words = body.get("bad_words")
        if words is None:
            return ()
        if not isinstance(words, list):
            raise InvalidArgument(f"bad_words must be a list, got {type(words).__name__}")
        if len(words) > limits.max_bad_words:
            raise InvalidArgument(f"bad_words may hold at most {limits.max_bad_words} strings "
                                  f"({flag('max_bad_words')}), got {len(words):,}")
        if not all(isinstance(w, str) for w in words):
            raise InvalidArgument("bad_words must be a list of strings")
        total = sum(map(len, words))
        if total > limits.max_bad_words_chars:
            cap = limits.max_bad_words_chars
            raise InvalidArgument(f"the bad_words hold {total:,} characters; at most {cap:,} are allowed "
                                  f"({flag('max_bad_words_chars')})")
        return tuple(words)

    def given(name, default):
        v = getattr(f, name)
        return default if v is None else v

    args: dict[str, Any] = {"max_tokens": max_tokens, "temperature": given("temperature", 1.0),
                            "top_p": given("top_p", 1.0), "top_k": max(0, given("top_k", 0)), "seed": f.seed,
                            "ignore_eos": given("ignore_eos", False), "min_tokens": given("min_tokens", 0),
                            "presence_penalty": given("presence_penalty", 0.0),
                            "frequency_penalty": given("frequency_penalty", 0.0),
                            "repetition_penalty": given("repetition_penalty", 1.0),
                            "min_p": given("min_p", 0.0),
                            "include_stop_str_in_output": given("include_stop_str_in_output", False),
                            "skip_special_tokens": given("skip_special_tokens", True), "n": given("n", 1),
                            # vLLM's: prefix-cache blocks are shared only between requests of one salt
                            "cache_salt": f.cache_salt}
    if max_tokens != MAX_INT or f.max_tokens is not None:
        try:
            check_int("max_tokens", max_tokens, lo=1, hi=MAX_INT)
        except InvalidArgument as e:
            raise bad_request(str(e), "max_tokens") from None
    for name, check in (("stop_token_ids", stop_token_ids), ("logit_bias", logit_bias),
                        ("bad_words", bad_words)):
        try:
            args[name] = check()
        except InvalidArgument as e:
            raise bad_request(str(e), name) from None
    if structured is not None:
        args["structured_outputs"] = structured
    try:
        return SamplingParams(**args, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except InvalidArgument as e:          # what only SamplingParams knows (temperature 1e-320): still a 400
        message = str(e)
        param = next((name for name in args if message.startswith(name)), None)
        raise bad_request(message, param) from None


def _stops(stop, limits: ServeLimits = DEFAULT_LIMITS) -> tuple[str, ...]:
    """The stop strings, bounded in number and in total length before anything is built from them."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > limits.max_stop:
        raise bad_request(f"stop may hold at most {limits.max_stop} strings ({flag('max_stop')}), "
                          f"got {len(stops)}", "stop")
    if not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    total = sum(map(len, stops))
    if total > limits.max_stop_chars:
        raise bad_request(f"the stop strings hold {total:,} characters; at most {limits.max_stop_chars:,} "
                          f"are allowed ({flag('max_stop_chars')})", "stop")
    return tuple(s for s in stops if s)


def _prompts(prompt, limits: ServeLimits = DEFAULT_LIMITS) -> list:
    """A completion's prompts: text, token ids, or a list of several of one kind. The bounds are
    checked on the whole body first (characters, ids summed over the prompts), then each prompt's
    ids (types and range, all at once)."""
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if several else [prompt]
    kinds = {type(p) for p in prompts}
    if several and (len(kinds) > 1 or not kinds <= {str, list}):
        raise bad_request("prompt must be a string, a list of token ids, or a list of several prompts of "
                          "one kind (strings, or token-id lists)", "prompt")
    if str in kinds:
        chars = sum(map(len, prompts))
        if chars > limits.max_prompt_chars:
            what = "the prompt has" if len(prompts) == 1 else f"the {len(prompts)} prompts have"
            raise bad_request(f"{what} {chars:,} characters; at most {limits.max_prompt_chars:,} are "
                              f"allowed ({flag('max_prompt_chars')})", "prompt")
        return prompts
    if kinds == {list}:
        cap = limits.max_prompt_tokens
        total = sum(map(len, prompts))
        if cap is not None and len(prompts) > 1 and total > cap:
            raise bad_request(f"the {len(prompts)} prompts have {total:,} token ids; at most {cap:,} are "
                              f"allowed in one request ({flag('max_prompt_tokens')}, at most max_model_len)",
                              "prompt", "context_length_exceeded")
        return [token_ids(p, limits) for p in prompts]
    raise bad_request("prompt must be a string or a list of token ids (integers)", "prompt")


def token_ids(prompt: list, limits: ServeLimits = DEFAULT_LIMITS) -> list[int]:
    """A token-id prompt checked length first, then vectorised: a plain ``int`` each (no bools, no
    floats), all in [0, 2**63 - 1]. The vocabulary is the frontend's check (it knows the model)."""
    cap = limits.max_prompt_tokens
    if cap is not None and len(prompt) > cap:
        raise bad_request(f"the prompt has {len(prompt):,} token ids; at most {cap:,} are allowed "
                          f"({flag('max_prompt_tokens')}, at most max_model_len)", "prompt",
                          "context_length_exceeded")
    if set(map(type, prompt)) - {int}:
        raise bad_request("prompt must be a string or a list of token ids (integers)", "prompt")
    try:
        arr = np.asarray(prompt, dtype=np.int64)
    except OverflowError:
        raise bad_request("prompt token ids must be at most 2**63 - 1", "prompt") from None
    if arr.size and int(arr.min()) < 0:
        raise bad_request(f"prompt token ids must be >= 0, got {int(arr.min())} at index "
                          f"{int(arr.argmin())}", "prompt")
    return prompt


def _messages(messages, limits: ServeLimits = DEFAULT_LIMITS) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > limits.max_messages:
        raise bad_request(f"messages holds {len(messages):,} messages; at most {limits.max_messages:,} are "
                          f"allowed ({flag('max_messages')})", "messages")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        msg = {"role": m["role"], "content": _content(m.get("content"), i)}
        chars += len(msg["role"]) + len(msg["content"])
        if chars > limits.max_prompt_chars:
            raise bad_request(f"the messages hold more than {limits.max_prompt_chars:,} characters "
                              f"({flag('max_prompt_chars')})", "messages")
        out.append(msg)
    return out


def _no_control_text(messages: list[dict], control_texts: tuple[str, ...]) -> None:
    """Refuse message text that the tokenizer would read as a control token (``<|im_start|>``)."""
    for i, m in enumerate(messages):
        for field in ("role", "content"):
            hit = next((t for t in control_texts if t in m[field]), None)
            if hit is not None:
                raise bad_request(f"messages[{i}].{field} contains the control token {hit!r}: the chat "
                                  "template would make it a real one (start the server with "
                                  "--allow-control-text to pass it through)", f"messages[{i}].{field}")


def _content(content, i: int) -> str:
    """Message content: a string, or OpenAI's list of parts of which only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise bad_request(f"messages[{i}].content: only text parts are supported",
                                  f"messages[{i}].content")
            texts.append(text)
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content")
