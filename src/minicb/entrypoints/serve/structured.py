"""The request fields that ask for structured output, turned into one ``StructuredOutputsParams``.

Three spellings, at most one per request (a 400 names the conflict):

=====================================================  ==============================================
OpenAI ``response_format``                             ``{"type": "json_object"}``; ``{"type":
                                                       "json_schema", "json_schema": {"name", "schema",
                                                       "strict"}}``; ``{"type": "text"}`` is no constraint
vLLM ``structured_outputs``                            ``{"json" | "regex" | "choice" | "grammar" |
                                                       "json_object": ...}`` (exactly one)
vLLM's older ``guided_json`` / ``guided_regex`` /      the same, one field each
``guided_choice`` / ``guided_grammar``
=====================================================  ==============================================

Bounded before anything is compiled: the constraint's text is at most ``--max-grammar-chars``
characters and a schema nests at most ``--max-schema-depth`` levels (400 naming the flag). Whether
the constraint compiles is checked by the frontend (``Preparer._compile``, in a thread of the server),
which also warms the compiled-grammar cache the engine thread then copies from.
"""

from __future__ import annotations

import json
from typing import Any

from minicb.core.errors import InvalidArgument, describe
from minicb.core.structured_outputs import StructuredOutputsParams, schema_depth
from minicb.entrypoints.serve.errors import bad_request
from minicb.entrypoints.serve.limits import ServeLimits, flag

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# vLLM's options of structured_outputs that change nothing here (minicb's JSON layout is fixed)
_IGNORED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


def parse_structured(body: dict, limits: ServeLimits) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint (or None) and the field it came from (for error messages)."""
    found: list[tuple[str, dict]] = []
    rf = body.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object: {json | regex | choice | grammar | "
                              "json_object: ...}", "structured_outputs")
        unknown = [k for k in so if k not in ("json", "regex", "choice", "grammar", "json_object")
                   and k not in _IGNORED_OPTIONS and so[k] is not None]
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not supported by minicb serve",
                              f"structured_outputs.{unknown[0]}")
        found.append(("structured_outputs", {k: v for k, v in so.items() if k not in _IGNORED_OPTIONS
                                             and v is not None}))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output; send one",
                          found[1][0])
    param, fields = found[0]
    return checked(fields, param, limits), param


def _response_format(rf: Any) -> dict | None:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object with a type", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema must be an object {name, schema, strict}",
                              "response_format.json_schema")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be a JSON schema (an object)",
                              "response_format.json_schema.schema")
        return {"json": schema}
    raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                      f"{describe(kind)}", "response_format.type")


def checked(fields: dict, param: str, limits: ServeLimits) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**fields)``, bounded by ``limits`` (a 400 naming ``param``)."""
    schema = fields.get("json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
        fields = {**fields, "json": schema}
    if schema is not None:
        depth = schema_depth(schema)
        if depth > limits.max_schema_depth:
            raise bad_request(f"{param}: the JSON schema nests {depth} levels; at most "
                              f"{limits.max_schema_depth} are allowed ({flag('max_schema_depth')})", param)
    try:
        spec = StructuredOutputsParams(**fields)
    except InvalidArgument as e:
        raise bad_request(f"{param}: {e}", param) from None
    except TypeError:
        raise bad_request(f"{param} takes exactly one of json, regex, choice, grammar, json_object",
                          param) from None
    if spec.size > limits.max_grammar_chars:
        raise bad_request(f"{param}: the constraint has {spec.size:,} characters; at most "
                          f"{limits.max_grammar_chars:,} are allowed ({flag('max_grammar_chars')})", param)
    return spec
