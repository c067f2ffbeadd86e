"""The OpenAI request bodies the server accepts, checked and turned into what the engine needs.

::

    POST /v1/completions       {"model", "prompt": "text" | [token ids], "max_tokens": 16, ...}
    POST /v1/chat/completions  {"model", "messages": [{"role", "content"}], "max_completion_tokens", ...}

Both become one ``GenerateRequest`` (a prompt, ``SamplingParams``, the stop strings) inside a
``ParsedRequest`` (how to answer). The bodies are pydantic models, ``CompletionRequest`` and
``ChatCompletionRequest``: OpenAI's and vLLM's field names, each with its type and range in one place
(strict: no ``"5"`` for 5, no ``true`` for 1, no NaN), their JSON schema served at ``/openapi.json``.
``_message`` words pydantic's first error as OpenAI's error object (400, ``param`` naming the field);
the bounds that are the server's flags (``limits.py``) are validators that name their flag. What only
the engine can judge (the prompt's length in tokens against the KV pool) is judged on the engine thread.

vLLM's choices where OpenAI leaves room: ``temperature`` and ``top_p`` default to 1.0; ``top_k`` 0 or
-1 is off; ``max_tokens`` defaults to 16 for completions and, for chat, to the room the prompt leaves
(filled in on the engine thread); ``stop`` strings are matched on the text and never part of it; a
list of prompts is one engine request each, answered with ``index = prompt_index * n + child``;
the logprob fields and vLLM's own (``priority``, ``cache_salt``, ``request_id``, ...) are
``docs/concepts/serving.md``'s tables. Every field minicb does not implement (``_UNSUPPORTED``) is
a 400 naming it unless it holds its default, never a silently different answer; unknown fields are
ignored (clients send extras).

Hand-written, with a tested reason: the prompt and message checks (``_prompts``, ``_messages``) run
*before* pydantic, cheapest first, because a 10**6-id prompt must be refused by its length before its
ids are typed (``test_each_cost_bound_is_a_400_naming_its_flag``), and their messages name the
message and part a client got wrong (``messages[0].content``), which pydantic's union errors do not.
Chat message text containing the model's control tokens (``<|im_start|>``) is refused unless
``--allow-control-text``: rendered, it would become real control tokens (a forged system turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationError, field_validator
from pydantic import BeforeValidator as Before
from pydantic import WithJsonSchema as Schema

from minicb.core.errors import InvalidArgument, describe
from minicb.core.sampling_params import MAX_INT, MAX_LOGPROBS, SamplingParams
from minicb.entrypoints.serve.errors import ApiError, bad_request  # noqa: F401 - ApiError: re-exported
from minicb.entrypoints.serve.limits import ServeLimits, flag
from minicb.entrypoints.serve.structured import parse_structured
from minicb.entrypoints.serve.tools import (
    ToolRequest,
    constraint,
    parse_tools,
    template_messages,
)

DEFAULT_LIMITS = ServeLimits()


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


# fields minicb does not implement, with the values that ask for what it does (a 400 for any other)
_UNSUPPORTED = {
    "best_of": (None, 1), "suffix": (None, ""), "functions": (None, []),
    "spaces_between_special_tokens": (None, True), "guided_decoding_backend": (None,),
    "allowed_token_ids": (None,), "truncate_prompt_tokens": (None,),
    # beam search (vLLM's): not implemented, and n > 1 would otherwise return n sampled texts
    "use_beam_search": (None, False), "length_penalty": (None, 1.0, 1), "early_stopping": (None, False),
    "prompt_embeds": (None,), "logits_processors": (None, []), "vllm_xargs": (None, {}),
    "kv_transfer_params": (None, {}), "guided_whitespace_pattern": (None,),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
}
# chat fields that change the rendered prompt (and chat's echo)
_UNSUPPORTED_CHAT = {
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
    "documents": (None, []), "echo": (None, False),
}
MAX_REQUEST_ID_CHARS = 256

# name: (type, low, high, low excluded): the ranges of the numbers (pydantic's bounds and _message's words)
RANGES: dict[str, tuple[type, float | None, float | None, bool]] = {
    "max_tokens": (int, 1, MAX_INT, False), "max_completion_tokens": (int, 1, MAX_INT, False),
    "temperature": (float, 0.0, 2.0, False), "top_p": (float, 0.0, 1.0, True),
    "top_k": (int, -1, MAX_INT, False), "seed": (int, 0, MAX_INT, False),
    "presence_penalty": (float, -2.0, 2.0, False), "frequency_penalty": (float, -2.0, 2.0, False),
    "repetition_penalty": (float, 0.0, None, True), "min_p": (float, 0.0, 1.0, False),
    "min_tokens": (int, 0, MAX_INT, False), "n": (int, 1, MAX_INT, False),
    "priority": (int, -MAX_INT - 1, MAX_INT, False), "logprobs": (int, 0, MAX_LOGPROBS, False),
    "top_logprobs": (int, 0, MAX_LOGPROBS, False), "prompt_logprobs": (int, 0, MAX_LOGPROBS, False),
    "stop_token_ids": (int, 0, MAX_INT, False), "logit_bias": (float, -100.0, 100.0, False),
}


def _r(name: str):
    kind, lo, hi, lo_open = RANGES[name]
    bound = {"gt" if lo_open else "ge": lo} if lo is not None else {}
    if hi is not None:
        bound["le"] = hi
    return Annotated[kind, Field(strict=True, **bound, **({"allow_inf_nan": False} if kind is float else {}))]


Bool = Annotated[bool, Field(strict=True)]
Str = Annotated[str, Field(strict=True)]
_Text = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
# (max count flag, its unit, max characters flag) of the lists the server's flags bound
_BOUNDED = {"stop": ("max_stop", "strings", "max_stop_chars"),
            "stop_token_ids": ("max_stop_token_ids", "ids", None),
            "logit_bias": ("max_logit_bias", "entries", None),
            "bad_words": ("max_bad_words", "strings", "max_bad_words_chars")}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Bool | None = None
    continuous_usage_stats: Bool | None = None      # vLLM's: the usage so far in every chunk


class TextPart(BaseModel):
    type: Literal["text"]                    # the only part minicb supports (no images, no audio)
    text: Str


class Call(BaseModel):
    name: Str
    arguments: Str | dict = "{}"


class ToolCall(BaseModel):
    function: Call                           # OpenAI's id and type are not read


class Message(BaseModel):
    """One chat turn: a role and its text (a string, ``null`` or text parts); an assistant turn's
    earlier ``tool_calls``. Other fields (``name``, ``tool_call_id``) pass."""

    model_config = ConfigDict(extra="allow")
    role: Str
    content: Str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())


def _few_messages(v, info):
    """The count before the turns are checked: a million messages cost a length check."""
    if not isinstance(v, list) or not v:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    cap = _limits(info).max_messages
    if len(v) > cap:
        raise bad_request(f"messages holds {len(v):,} messages; at most {cap:,} are allowed "
                          f"({flag('max_messages')})", "messages")
    return v


Messages = Annotated[list[Message], Before(_few_messages)]


class _Request(BaseModel):
    """The fields both endpoints share. ``None`` is "unset" (the default applies)."""

    model_config = ConfigDict(extra="allow")
    model: Str | None = None
    user: Str | None = None
    max_tokens: _r("max_tokens") | None = None
    temperature: _r("temperature") | None = None
    top_p: _r("top_p") | None = None
    top_k: _r("top_k") | None = None
    seed: _r("seed") | None = None
    n: _r("n") | None = None
    presence_penalty: _r("presence_penalty") | None = None
    frequency_penalty: _r("frequency_penalty") | None = None
    repetition_penalty: _r("repetition_penalty") | None = None
    min_p: _r("min_p") | None = None
    min_tokens: _r("min_tokens") | None = None
    priority: _r("priority") | None = None
    prompt_logprobs: _r("prompt_logprobs") | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    stop: Annotated[list[Str] | None, Schema({"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "string"}}, {"type": "null"}]})] = None           # a string is a list of one
    stop_token_ids: list[_r("stop_token_ids")] | None = None
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,18}$")], _r("logit_bias")] | None = None
    bad_words: list[Str] | None = None
    ignore_eos: Bool | None = None
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None
    return_token_ids: Bool | None = None
    return_tokens_as_token_ids: Bool | None = None
    request_id: Annotated[_Text, Field(pattern=r"^[^\x00-\x1f\x7f]*$")] | None = None
    cache_salt: _Text | None = None
    # checked by structured.py (their bounds are the server's flags); declared for /openapi.json
    response_format: SkipValidation[dict | None] = None
    structured_outputs: SkipValidation[dict | None] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator(*_BOUNDED, mode="before")
    @classmethod
    def _count(cls, v, info):
        """Bounded before their items are checked: a million stop strings cost a length check."""
        cap_flag, unit, _ = _BOUNDED[info.field_name]
        cap = getattr(_limits(info), cap_flag)
        if isinstance(v, (list, dict)) and len(v) > cap:
            raise bad_request(f"{info.field_name} may hold at most {cap:,} {unit} ({flag(cap_flag)}), got "
                              f"{len(v):,}", info.field_name)
        return v

    @field_validator("stop", "bad_words")
    @classmethod
    def _chars(cls, v, info):
        chars_flag = _BOUNDED[info.field_name][2]
        cap, total = getattr(_limits(info), chars_flag), sum(map(len, v or ()))
        if total > cap:
            raise bad_request(f"the {info.field_name} strings hold {total:,} characters; at most {cap:,} are "
                              f"allowed ({flag(chars_flag)})", info.field_name)
        return v


class CompletionRequest(_Request):
    """POST /v1/completions"""

    prompt: SkipValidation[str | list[int] | list[str] | list[list[int]]]     # _prompts checks it first
    logprobs: _r("logprobs") | None = None
    echo: Bool | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_unset(cls, v):
        return None if v is False else v


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions"""

    messages: Messages
    max_completion_tokens: _r("max_completion_tokens") | None = None
    logprobs: Bool | None = None
    top_logprobs: _r("top_logprobs") | None = None
    tools: SkipValidation[list[dict] | None] = None      # tools.py checks them
    tool_choice: SkipValidation[str | dict | None] = None
    parallel_tool_calls: Bool | None = None


def _limits(info) -> ServeLimits:
    return (info.context or {}).get("limits", DEFAULT_LIMITS)


def parse_completion(body: Any, limits: ServeLimits = DEFAULT_LIMITS) -> ParsedRequest:
    body = _object(body)
    if "prompt" not in body:
        raise bad_request("prompt is required: a string or a list of token ids", "prompt")
    if body.get("tools") or body.get("tool_choice") is not None:
        raise bad_request("tools and tool_choice are for /v1/chat/completions", "tools")
    prompts = _prompts(body["prompt"], limits)
    _unsupported(body, _UNSUPPORTED)
    return _parse(body, _checked(body, CompletionRequest, limits), prompts, limits)


def parse_chat(body: Any, render, limits: ServeLimits = DEFAULT_LIMITS,
               control_texts: tuple[str, ...] = ()) -> ParsedRequest:
    """``render(messages) -> str`` applies the model's chat template (``Tokenizer.apply_chat_template``).
    A message whose text contains one of ``control_texts`` (the model's control tokens) is refused."""
    body = _object(body)
    _unsupported(body, _UNSUPPORTED | _UNSUPPORTED_CHAT)
    f = _checked(body, ChatCompletionRequest, limits)      # the fields first: the template is the cost
    tools = parse_tools(body, limits)
    messages = _messages(template_messages(f.messages, tools), limits)
    _no_control_text(messages, control_texts)
    return _parse(body, f, [rendered(render, messages)], limits, tools)


def rendered(render, messages: list[dict]) -> str:
    """``render(messages)`` (the chat template), its refusal a 400 naming ``messages``."""
    try:
        return render(messages)
    except InvalidArgument as e:
        raise bad_request(str(e), "messages") from None
    except Exception as e:   # noqa: BLE001 - a template's raise_exception(): the messages broke its rules
        raise bad_request(f"the model's chat template rejected the messages: {e}", "messages") from None


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _unsupported(body: dict, table: dict, prefix: str = "") -> None:
    for name, defaults in table.items():
        if name in body and not _is_default(body[name], defaults):
            raise bad_request(f"{prefix}{name} is not supported by minicb serve (leave it unset)",
                              prefix + name)


def _is_default(value, defaults: tuple) -> bool:
    """``value`` is one of ``defaults`` with the same type (so ``logprobs: 0`` is not ``False``)."""
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


# what a type error in these fields means, in a client's words (their items are no concern of its)
_SHAPES = {("stop", None): "must be a string or a list of strings",
           ("bad_words", None): "must be a list of strings",
           ("logit_bias", "dict_type"): "must be an object of token id -> bias",
           ("logit_bias", "string_pattern_mismatch"): "keys must be token ids (decimal integers)",
           ("stream_options", "model_type"): "must be an object"}


_TURN = {"role": "an object with a string role", "content": "a string, null or a list of text parts",
         "tool_calls": "a list of tool calls", "call": "{function: {name: string, arguments: string}}"}


def _message(err: dict) -> tuple[str, str]:
    """A pydantic error as (message, param) in minicb's words: the field and what it must be."""
    loc, value, kind = err["loc"], err["input"], err["type"]
    field = str(loc[0])
    keyed = field == "logit_bias"            # its str locations are keys: logit_bias[5], not .5
    name = field + "".join("[i]" if isinstance(x, int) else f"[{x}]" if keyed else f".{x}" for x in loc[1:]
                           if x != "[key]")
    param = field + "".join(f".{x}" for x in loc[1:] if isinstance(x, str) and not keyed)
    shape = _SHAPES.get((field, kind)) or _SHAPES.get((field, None))
    if shape is not None:
        return f"{field} {shape}, got {describe(value)}", field
    if field == "messages" and len(loc) > 1:      # the turn and its part: messages[1].tool_calls[0]
        what = loc[2] if len(loc) > 2 else "role"
        call = what == "tool_calls" and len(loc) > 3 and isinstance(loc[3], int)
        param = f"messages[{loc[1]}]" + ("" if what == "role" else f".{what}") + \
            (f"[{loc[3]}]" if call else "")
        return f"{param} must be {_TURN['call' if call else what]}, got {describe(value)}", param
    if kind == "missing":
        return f"{name} is required", param
    if kind == "bool_type":
        return f"{name} must be true or false, got {describe(value)}", param
    if kind.startswith("string") and field in ("request_id", "cache_salt"):
        return (f"{name} must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} printable characters, "
                f"got {describe(value)}"), param
    if kind.startswith("string"):
        return f"{name} must be a string, got {type(value).__name__}", param
    if kind in ("list_type", "model_type", "dict_type"):
        return f"{name} must be a {kind[:-5].replace('model', 'n object')}, got {type(value).__name__}", param
    if kind.startswith(("int", "float")):
        what = "an integer" if kind.startswith("int") else "a number"
        return f"{name} must be {what}, got {type(value).__name__} {describe(value)}", param
    kind_, lo, hi, lo_open = RANGES[field]
    if kind_ is float:
        lo, hi = (None if lo is None else float(lo)), (None if hi is None else float(hi))
    rng = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    if kind == "finite_number" and hi is None:       # NaN is out of any range; inf only of an open one
        return f"{name} must be a finite number in {rng}, got {describe(value)}", param
    return f"{name} must be in {rng}, got {describe(value)}", param


def _checked(body: dict, model: type[_Request], limits: ServeLimits) -> _Request:
    """``model`` of ``body``; the first error as a 400 naming its field."""
    try:
        return model.model_validate(body, context={"limits": limits})
    except ValidationError as e:
        message, param = _message(e.errors(include_url=False)[0])
        raise bad_request(message, param) from None


def _parse(body: dict, f: _Request, prompts: list, limits: ServeLimits,
           tools: ToolRequest | None = None) -> ParsedRequest:
    chat = isinstance(f, ChatCompletionRequest)
    structured, param = parse_structured(body, limits)
    forced = constraint(tools) if tools is not None else None
    if forced is not None:
        if structured is not None:
            raise bad_request(f"tool_choice {tools.choice!r} forces a tool call; it cannot be combined with "
                              f"{param}", param)
        structured, param = forced, "tools"
    opts = f.stream_options or StreamOptions()
    if f.stream_options is not None and not f.stream:
        raise bad_request("stream_options is allowed only with stream: true", "stream_options")
    if chat and f.top_logprobs and not f.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = ((f.top_logprobs or 0) if f.logprobs else None) if chat else f.logprobs
    echo = not chat and bool(f.echo)
    max_tokens = f.max_completion_tokens if chat and f.max_completion_tokens is not None else f.max_tokens
    from_room = chat and max_tokens is None
    # echo + logprobs scores the prompt too: its tokens' logprobs are prompt logprobs, as in vLLM
    scored = [k for k in (f.prompt_logprobs, logprobs if echo else None) if k is not None]
    args = {name: getattr(f, name) for name in ("temperature", "top_p", "top_k", "ignore_eos", "min_tokens",
                                                "presence_penalty", "frequency_penalty", "repetition_penalty",
                                                "min_p", "include_stop_str_in_output", "skip_special_tokens",
                                                "n") if getattr(f, name) is not None}
    args |= {"temperature": args.get("temperature", 1.0),
             "max_tokens": MAX_INT if from_room else 16 if max_tokens is None else max_tokens,
             "top_k": max(0, args.get("top_k", 0)), "seed": f.seed, "cache_salt": f.cache_salt,
             "stop_token_ids": tuple(f.stop_token_ids or ()), "bad_words": tuple(f.bad_words or ()),
             "logit_bias": {int(k): v for k, v in (f.logit_bias or {}).items()},
             "logprobs": logprobs, "prompt_logprobs": max(scored) if scored else None}
    if structured is not None:
        args["structured_outputs"] = structured
    try:
        params = SamplingParams(**args)
    except InvalidArgument as e:          # what only SamplingParams knows (temperature 1e-320): still a 400
        message = str(e)
        raise bad_request(message, next((name for name in args if message.startswith(name)), None)) from None
    stops = tuple(s for s in f.stop or () if s)
    generate = GenerateRequest(prompts[0], params, stops, from_room, f.priority or 0)
    include_usage = bool(opts.include_usage)
    return ParsedRequest("chat" if chat else "completion", f.model, generate, bool(f.stream), include_usage,
                         bool(f.return_token_ids), tools if tools and tools.shown else None, param,
                         tuple(prompts), echo, logprobs, f.prompt_logprobs,
                         include_usage and bool(opts.continuous_usage_stats),     # vLLM's: only with usage
                         bool(f.return_tokens_as_token_ids), f.request_id)


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
    """A token-id prompt checked length first, then in C loops (``set``, ``min``, ``max``): a plain
    ``int`` each (no bools, no floats), all in [0, 2**63 - 1]. The vocabulary is the frontend's."""
    cap = limits.max_prompt_tokens
    if cap is not None and len(prompt) > cap:
        raise bad_request(f"the prompt has {len(prompt):,} token ids; at most {cap:,} are allowed "
                          f"({flag('max_prompt_tokens')}, at most max_model_len)", "prompt",
                          "context_length_exceeded")
    if set(map(type, prompt)) - {int}:
        raise bad_request("prompt must be a string or a list of token ids (integers)", "prompt")
    if prompt and max(prompt) > MAX_INT:
        raise bad_request("prompt token ids must be at most 2**63 - 1", "prompt")
    if prompt and (low := min(prompt)) < 0:
        raise bad_request(f"prompt token ids must be >= 0, got {low} at index {prompt.index(low)}", "prompt")
    return prompt


def _messages(messages: list[dict], limits: ServeLimits = DEFAULT_LIMITS) -> list[dict]:
    """The rendered turns (``tools.template_messages``), bounded in characters before the template runs."""
    if sum(len(m["role"]) + len(m["content"]) for m in messages) > limits.max_prompt_chars:
        raise bad_request(f"the messages hold more than {limits.max_prompt_chars:,} characters "
                          f"({flag('max_prompt_chars')})", "messages")
    return messages


def _no_control_text(messages: list[dict], control_texts: tuple[str, ...]) -> None:
    """Refuse message text that the tokenizer would read as a control token (``<|im_start|>``)."""
    for i, m in enumerate(messages):
        for field in ("role", "content"):
            hit = next((t for t in control_texts if t in m[field]), None)
            if hit is not None:
                raise bad_request(f"messages[{i}].{field} contains the control token {hit!r}: the chat "
                                  "template would make it a real one (start the server with "
                                  "--allow-control-text to pass it through)", f"messages[{i}].{field}")
