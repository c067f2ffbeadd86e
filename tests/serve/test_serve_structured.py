"""Structured outputs and tools through the HTTP API (a tiny random model behind a real server).

The model knows nothing: every valid JSON object, regex match and tool call below is the grammar's
doing, and is checked independently (``jsonschema``, ``re``, ``json``). Also: the request-side
checks (limits, conflicts, bad grammars are 400s naming the field) and the tool-call format parser.
"""

import json
import re

import jsonschema
import pytest

from minicb.entrypoints.serve.limits import ServeLimits
from minicb.entrypoints.serve.protocol import ApiError, parse_chat, parse_completion
from minicb.entrypoints.serve.tools import parse_calls
from serve_helpers import client, http, running_server
from tiny_files import write_gguf

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "color"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "ab"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    gguf = write_gguf(tmp_path_factory.mktemp("structured") / "tiny.gguf")
    with running_server(gguf, max_num_seqs=8) as (_, url):
        yield url


def post(url, path, body):
    status, _, out = http("POST", url + path, body, timeout=120)
    assert status == 200, out
    return out


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions",
                                                                               {"messages": USER})])
def test_response_format_json_schema_and_json_object_validate(url, path, base):
    def text(out):
        c = out["choices"][0]
        return c["text"] if "text" in c else c["message"]["content"]

    for seed in (1, 2):
        out = post(url, path, {**base, "max_tokens": 80, "seed": seed, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}})
        assert out["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text(out)), SCHEMA)
    out = post(url, path, {**base, "max_tokens": 80, "temperature": 0,
                           "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(text(out)), dict)


def test_vllms_structured_outputs_and_guided_fields(url):
    cases = [({"structured_outputs": {"regex": "[ab]{2,3}c"}}, lambda t: re.fullmatch("[ab]{2,3}c", t)),
             ({"guided_regex": "x[0-9]{2}"}, lambda t: re.fullmatch("x[0-9]{2}", t)),
             ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"structured_outputs": {"grammar": 'start: "<" "z"+ ">"'}}, lambda t: re.fullmatch("<z+>", t)),
             ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
              lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]
    for extra, ok in cases:
        for temperature in (0, 1.0):
            out = post(url, "/v1/completions", {"prompt": "ab", "max_tokens": 60, "temperature": temperature,
                                                "seed": 5, **extra})
            t = out["choices"][0]["text"]
            assert ok(t) and out["choices"][0]["finish_reason"] == "stop", (extra, t)


def test_the_openai_client_gets_json_that_validates(url):
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def check_calls(message, allowed):
    assert message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        f = call["function"]
        tool = next(t for t in (WEATHER, TIME) if t["function"]["name"] == f["name"])
        assert f["name"] in allowed
        jsonschema.validate(json.loads(f["arguments"]), tool["function"]["parameters"])


def test_tool_choice_required_and_named_give_calls_whose_arguments_validate(url):
    for seed in (1, 2, 3):
        out = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 300, "seed": seed,
                                                 "tools": [WEATHER, TIME], "tool_choice": "required"})
        c = out["choices"][0]
        assert c["finish_reason"] == "tool_calls"
        check_calls(c["message"], {"get_weather", "get_time"})
        assert len(c["message"]["tool_calls"]) <= 2              # at most one call per tool offered
        out = post(url, "/v1/chat/completions", {
            "messages": USER, "max_tokens": 300, "seed": seed, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
        c = out["choices"][0]
        assert c["finish_reason"] == "tool_calls" and len(c["message"]["tool_calls"]) == 1
        check_calls(c["message"], {"get_time"})


def test_tool_choice_none_gives_plain_text_and_auto_parses_only_the_format(url):
    plain = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0,
                                               "return_token_ids": True})
    none = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0,
                                              "return_token_ids": True, "tools": [WEATHER],
                                              "tool_choice": "none"})
    # none: the tools are not shown, so the prompt and the answer are exactly those without tools
    assert none["prompt_token_ids"] == plain["prompt_token_ids"]
    assert none["choices"][0] == plain["choices"][0] and "tool_calls" not in none["choices"][0]["message"]
    auto = post(url, "/v1/chat/completions", {"messages": USER, "max_tokens": 8, "temperature": 0,
                                              "return_token_ids": True, "tools": [WEATHER]})
    assert len(auto["prompt_token_ids"]) > len(plain["prompt_token_ids"])     # the tools' system prompt
    msg = auto["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"] is not None       # random text is not a call


def test_streaming_with_tools_sends_the_calls_in_one_delta(url):
    c = client(url)
    chunks = list(c.chat.completions.create(model="tiny", messages=USER, max_tokens=300, seed=4, stream=True,
                                            tools=[WEATHER], tool_choice="required"))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    for tc in calls:
        assert tc.function.name == "get_weather"
        jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])


def test_an_earlier_call_and_its_result_are_rendered_in_the_models_format(url):
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    seen = {}
    parse_chat({"messages": history, "tools": [TIME]}, lambda m: seen.setdefault("m", m) and "x")
    m = seen["m"]
    assert m[0]["role"] == "system" and '"name": "get_time"' in m[0]["content"]
    assert m[2] == {"role": "assistant",
                    "content": '<tool_call>[\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n]'
                               '</tool_call>'}
    assert m[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    out = post(url, "/v1/chat/completions", {"messages": history, "tools": [TIME], "max_tokens": 4})
    assert out["choices"][0]["message"]["role"] == "assistant"


LIMITS = ServeLimits(max_grammar_chars=50, max_schema_depth=3)


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both constrain"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"guided_regex": "a" * 51}, "guided_regex", "at most 50 are allowed (--max-grammar-chars)"),
    ({"guided_json": {"a": {"b": {"c": {}}}}}, "guided_json", "nests 4 levels; at most 3 are allowed "
                                                             "(--max-schema-depth)"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ({"tools": [WEATHER]}, "tools", "for /v1/chat/completions"),
])
def test_bad_constraints_are_400_naming_the_field(body, param, needle):
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "x", **body}, LIMITS)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": [{"type": "function"}]}, "tools[0]", "must be {type"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be 'none'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "f" * 200}}]}, "tools",
     "(--max-grammar-chars)"),
])
def test_bad_tools_are_400_naming_the_field(body, param, needle):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": USER, **body}, lambda m: "x", ServeLimits(max_grammar_chars=300))
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value


def test_a_grammar_that_does_not_compile_is_a_400_from_the_server(url):
    status, _, out = http("POST", url + "/v1/completions", {"prompt": "ab", "guided_regex": "(unclosed"})
    assert status == 400 and out["error"]["param"] == "guided_regex" and "cannot be compiled" in \
        out["error"]["message"]
    status, _, out = http("POST", url + "/v1/completions", {"prompt": "ab", "guided_regex": "a",
                                                            "ignore_eos": True})
    assert status == 400 and "ignore_eos" in out["error"]["message"]


def test_parse_calls_reads_the_format_and_nothing_else():
    content, calls = parse_calls('ok <tool_call>[\n{"name": "f", "arguments": {"x": 1}}\n]</tool_call>')
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert content == "ok" and got == [("f", {"x": 1})]
    one = parse_calls('<tool_call>{"name": "g", "arguments": {}}</tool_call>')      # one call, no list
    assert one[1][0]["function"]["name"] == "g"
    for text in ("plain text", "<tool_call>[]</tool_call>", "<tool_call>[{\"name\": 3}]</tool_call>",
                 "<tool_call>[{\"name\": \"f\", \"arg"):
        assert parse_calls(text) is None, text
