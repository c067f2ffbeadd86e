"""What one request may cost, and the flag that sets each bound.

A server on a shared machine must know the most work a request can cause *before* doing any of it:
one small body must not be able to allocate gigabytes or freeze the other clients. Every bound here
is checked in the order the work would happen, cheapest first (the body's size before it is parsed,
a prompt's length before its ids are checked, the number and total length of the stop strings before
a matcher is built), and refused with OpenAI's error object naming the limit and its flag:

==========================  ============================  ===========  ===============================
limit                       flag                          default      refused with
==========================  ============================  ===========  ===============================
request body                ``--max-body-bytes``          2 MiB        413
prompt text (or the text    ``--max-prompt-chars``        200,000      400 ``prompt`` / ``messages``
of all messages)
prompt token ids            ``--max-prompt-tokens``       max_model_len 400 ``prompt``
messages                    ``--max-messages``            1,024        400 ``messages``
stop strings                ``--max-stop``                16           400 ``stop``
their total length          ``--max-stop-chars``          4,096        400 ``stop``
``stop_token_ids``          ``--max-stop-token-ids``      256          400 ``stop_token_ids``
``logit_bias`` entries      ``--max-logit-bias``          1,024        400 ``logit_bias``
``bad_words``               ``--max-bad-words``           128          400 ``bad_words``
their total length          ``--max-bad-words-chars``     4,096        400 ``bad_words``
a structured-output         ``--max-grammar-chars``       65,536       400 ``response_format`` /
constraint or tools'                                                   ``structured_outputs`` / ``tools``
schemas (characters)
its JSON nesting            ``--max-schema-depth``        16 levels    400 (the same)
JSON nesting                ``--max-json-depth``          32 levels    400
requests being prepared     ``--max-frontend-queue``      256          503 + ``Retry-After``
(parsed, rendered, tokenized
in the worker processes)
==========================  ============================  ===========  ===============================

And what a *connection* may cost (``server.py`` applies these to uvicorn):

==========================  ============================  ===========  ===============================
the request line + headers  ``--header-timeout``          10 s         the connection is closed
the body                    ``--body-timeout``            30 s         408
an idle keep-alive          ``--keep-alive-timeout``      5 s          the connection is closed
open connections            ``--max-connections``         1,024        503 (uvicorn)
their size                  ``--max-header-bytes``        16 KiB       431, then closed
live-page watchers          ``--max-live-watchers``       8            503
a refused body (413, 408)   ``--body-linger``             2 s          read and dropped this long, so
                                                                       the client, still sending,
                                                                       reads its answer; then closed
==========================  ============================  ===========  ===============================

A token-id prompt is at most ``max_model_len`` ids anyway (the engine refuses a longer one), so its
bound defaults to that: the list's length is checked first, then its ids all at once (numpy), so a
list of ten million ids costs a length check, not ten million Python checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from minicb.core.errors import InvalidArgument, check_float, check_int

MAX_JSON_DEPTH = 256          # the most --max-json-depth allows (json's recursion limit is ~1,000)


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """The bounds of one request and one connection (see the module docstring for the table)."""

    max_body_bytes: int = 2 * 2**20
    max_prompt_chars: int = 200_000
    max_prompt_tokens: int | None = None          # None: the engine's max_model_len
    max_messages: int = 1024
    max_stop: int = 16
    max_stop_chars: int = 4096
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024          # each entry is one indexed add per step of the request
    max_bad_words: int = 128            # vLLM's own cap (MAX_NUM_BAD_WORDS); each is tokenized once
    max_bad_words_chars: int = 4096
    max_grammar_chars: int = 65_536
    max_schema_depth: int = 16
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024
    max_live_watchers: int = 8
    max_json_depth: int = 32                      # an OpenAI body nests 5 levels at most (messages, parts)
    max_header_bytes: int = 16 * 2**10            # h11's default
    body_linger: float = 2.0
    max_frontend_queue: int = 256

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_messages", "max_stop_chars",
                     "max_connections", "max_bad_words_chars", "max_frontend_queue", "max_grammar_chars",
                     "max_schema_depth"):
            check_int(flag(name), getattr(self, name), lo=1)
        for name in ("max_stop", "max_stop_token_ids", "max_live_watchers", "max_logit_bias",
                     "max_bad_words"):
            check_int(flag(name), getattr(self, name), lo=0)
        if self.max_prompt_tokens is not None:
            check_int(flag("max_prompt_tokens"), self.max_prompt_tokens, lo=1)
        check_int(flag("max_json_depth"), self.max_json_depth, lo=1, hi=MAX_JSON_DEPTH)
        check_int(flag("max_header_bytes"), self.max_header_bytes, lo=1024)
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            v = check_float(flag(name), getattr(self, name), finite=True)
            if not v > 0:
                raise InvalidArgument(f"{flag(name)} must be > 0 seconds, got {v}")
        check_float(flag("body_linger"), self.body_linger, lo=0.0, finite=True)

    def with_model_len(self, max_model_len: int) -> ServeLimits:
        """These limits with ``max_prompt_tokens`` filled in (and never above ``max_model_len``)."""
        from dataclasses import replace

        n = max_model_len if self.max_prompt_tokens is None else min(self.max_prompt_tokens, max_model_len)
        return replace(self, max_prompt_tokens=n)


def flag(field: str) -> str:
    """The ``minicb serve`` flag of a ``ServeLimits`` field: ``max_stop_chars`` -> ``--max-stop-chars``."""
    return "--" + field.replace("_", "-")
