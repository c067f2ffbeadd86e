"""What one request and one connection may cost, and the flag that sets each bound.

Each field of ``ServeLimits`` is one ``minicb serve`` flag (``flag``); its help text (what it bounds,
and the answer past it) is the field's metadata, so ``minicb serve --help`` is this module's table.
Why, and in which order they are checked: ``docs/concepts/serving.md``, "Limits". A token-id prompt
is at most ``max_model_len`` ids anyway, so its bound defaults to that (``with_model_len``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from minicb.core.errors import InvalidArgument, check_float, check_int

MAX_JSON_DEPTH = 256          # the most --max-json-depth allows (json's recursion limit is ~1,000)


def _limit(default, help: str, lo: float | None = 1, hi: int | None = None):
    """A field: its default, its ``--help`` text ("at most N <help>") and its range."""
    return field(default=default, metadata={"help": help, "lo": lo, "hi": hi})


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """The bounds of one request and one connection (each a flag: ``flag(name)``)."""

    max_body_bytes: int = _limit(2 * 2**20, "bytes of a request body (413)")
    max_prompt_chars: int = _limit(200_000, "characters of a text prompt, or of all messages")
    max_prompt_tokens: int | None = _limit(None, "token ids of a prompt (default: max_model_len)")
    max_messages: int = _limit(1024, "messages of a chat request")
    max_stop: int = _limit(16, "stop strings of a request", lo=0)
    max_stop_chars: int = _limit(4096, "characters of all stop strings together")
    max_stop_token_ids: int = _limit(256, "stop_token_ids of a request", lo=0)
    # each logit_bias entry is one indexed add per step of the request
    max_logit_bias: int = _limit(1024, "logit_bias entries of a request", lo=0)
    # vLLM's own cap (MAX_NUM_BAD_WORDS); each is tokenized once
    max_bad_words: int = _limit(128, "bad_words of a request", lo=0)
    max_bad_words_chars: int = _limit(4096, "characters of all bad_words together")
    max_grammar_chars: int = _limit(65_536, "characters of a structured-output constraint (a JSON schema, "
                                    "regex, grammar, choices) or of a request's tool schemas")
    max_schema_depth: int = _limit(16, "levels of JSON nesting in a schema")
    header_timeout: float = _limit(10.0, "seconds for a request line and headers (then closed)", lo=None)
    body_timeout: float = _limit(30.0, "seconds for a request body (408)", lo=None)
    keep_alive_timeout: float = _limit(5.0, "seconds an idle connection stays open", lo=None)
    max_connections: int = _limit(1024, "open connections (503, uvicorn's)")
    max_live_watchers: int = _limit(8, "open live pages (/live/events; 503)", lo=0)
    # an OpenAI body nests 5 levels at most (messages, parts)
    max_json_depth: int = _limit(32, "levels of nesting in a JSON body", hi=MAX_JSON_DEPTH)
    max_header_bytes: int = _limit(16 * 2**10, "bytes of a request line and its headers (431; h11's default)",
                                   lo=1024)
    body_linger: float = _limit(2.0, "seconds a refused body (413, 408) is still read and dropped, so that "
                                "its client reads the answer, before the connection closes", lo=0.0)
    max_frontend_queue: int = _limit(256, "requests being parsed, rendered and tokenized at once (503 + "
                                     "Retry-After past it)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value, lo, hi = getattr(self, f.name), f.metadata["lo"], f.metadata["hi"]
            if f.type == "float" and lo is None:              # a timeout: a positive number of seconds
                if not check_float(flag(f.name), value, finite=True) > 0:
                    raise InvalidArgument(f"{flag(f.name)} must be > 0 seconds, got {value}")
            elif f.type == "float":
                check_float(flag(f.name), value, lo=lo, finite=True)
            elif value is not None:
                check_int(flag(f.name), value, lo=lo, hi=hi)

    def with_model_len(self, max_model_len: int) -> ServeLimits:
        """These limits with ``max_prompt_tokens`` filled in (and never above ``max_model_len``)."""
        n = max_model_len if self.max_prompt_tokens is None else min(self.max_prompt_tokens, max_model_len)
        return replace(self, max_prompt_tokens=n)


def flag(field: str) -> str:
    """The ``minicb serve`` flag of a ``ServeLimits`` field: ``max_stop_chars`` -> ``--max-stop-chars``."""
    return "--" + field.replace("_", "-")
