"""``StructuredOutputsParams``: the grammar a request's output must follow (vLLM's name and fields).

Exactly one constraint per request::

    StructuredOutputsParams(json={"type": "object", "properties": {...}})   # a JSON schema
    StructuredOutputsParams(json_object=True)                               # any JSON object
    StructuredOutputsParams(regex=r"\\d{3}-\\d{4}")                           # the whole output matches
    StructuredOutputsParams(choice=("yes", "no"))                           # exactly one of these
    StructuredOutputsParams(grammar='start: "a"+')                          # Lark (or GBNF) grammar

Torch-free and engine-free: it only holds and checks the constraint. What turns it into a token mask
is ``minicb.runtime.grammar`` (the llguidance engine), per request row of the flat batch.

A JSON schema given as a dict is stored as its compact JSON text (key order kept: a schema's property
order is the order the output writes them), so the dataclass
stays frozen and hashable and two equal schemas are one cache entry of the compiled grammars.
``schema_depth`` and ``len(json)`` are what ``minicb serve``'s limits on schema size and nesting read.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

from minicb.core.errors import InvalidArgument, describe

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    json: str | None = None               # a JSON schema (a dict is stored as canonical JSON text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None            # Lark, or llama.cpp's GBNF (converted by the engine)
    json_object: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.json is not None:
            set_(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidArgument(f"structured_outputs.{name} must be a non-empty string, "
                                      f"got {describe(v)}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidArgument("structured_outputs.choice must be a non-empty list of non-empty "
                                      f"strings, got {describe(self.choice)}")
            set_(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise InvalidArgument("structured_outputs.json_object must be a bool, "
                                  f"got {describe(self.json_object)}")
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidArgument("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                  f"json_object; got {', '.join(chosen) or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def size(self) -> int:
        """Characters of the constraint's text (what the size limit reads)."""
        v = getattr(self, self.kind)
        return sum(map(len, v)) if isinstance(v, tuple) else len(v) if isinstance(v, str) else 0


def _schema_text(schema) -> str:
    """A JSON schema (dict, ``True``, or its JSON text) as canonical JSON text."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as e:
            raise InvalidArgument(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument("structured_outputs.json must be a JSON schema (an object), "
                              f"got {describe(schema)}")
    try:
        return _json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"structured_outputs.json is not a JSON value: {e}") from None


def schema_depth(value) -> int:
    """How deeply ``value`` (parsed JSON) nests containers: a scalar is 0, ``{}`` is 1, ``{"a": [1]}``
    is 2. Level by level, not recursive (a schema nested 10,000 deep cannot overflow the stack)."""
    depth, level = 0, [value]
    while True:
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            return depth
        depth += 1
        level = [x for v in level for x in (v.values() if isinstance(v, dict) else v)]
