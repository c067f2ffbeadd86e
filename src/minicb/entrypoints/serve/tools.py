"""Tool calling (``tools`` + ``tool_choice`` on chat completions) in SmolLM2's own format.

SmolLM2-Instruct was tuned for function calling with a system prompt that lists the tools inside
``<tools></tools>`` and asks for the calls as a JSON list inside ``<tool_call></tool_call>``::

    <tool_call>[
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]</tool_call>

The chat template in the GGUF file renders no tools, so this module does what a tool-aware template
would (``template_messages``). ``tool_choice``: ``none`` hides the tools; ``auto`` (the default)
shows them and parses the output into ``tool_calls`` if it is the format above; ``required`` and a
named function force the format through a grammar (``constraint``). The whole story, streaming
included: ``docs/concepts/structured_outputs.md``, section "Tools".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from minicb.core.errors import describe
from minicb.core.structured_outputs import StructuredOutputsParams, schema_depth
from minicb.entrypoints.serve.errors import bad_request
from minicb.entrypoints.serve.limits import ServeLimits, flag

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "You have access to the following tools:\n"
    "<tools>{tools}</tools>\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function "
    "call is needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    '{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "(more tool calls as required)\n"
    "]</tool_call>")

# the JSON layout the model was tuned on (json.dumps's), also inside the tool-call grammar
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools (OpenAI's function objects: name, description, parameters) and its choice:
    ``"none"``, ``"auto"``, ``"required"`` or the name of the one function to call."""

    functions: tuple[dict, ...]
    choice: str
    named: bool = False
    parallel: bool = True          # OpenAI's parallel_tool_calls: several calls in one answer

    @property
    def shown(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict, limits: ServeLimits) -> ToolRequest | None:
    """``tools`` and ``tool_choice`` checked (400s name the field), or None without tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: 'function', function: {...}}", "tools")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"tools[{i}] must be {{type: 'function', function: {{name, description, "
                              "parameters}}}}", f"tools[{i}]")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)",
                              f"tools[{i}].function.parameters")
        if schema_depth(params) > limits.max_schema_depth:
            raise bad_request(f"tools[{i}].function.parameters nests more than {limits.max_schema_depth} "
                              f"levels ({flag('max_schema_depth')})", f"tools[{i}].function.parameters")
        fn = {"name": f["name"], "description": f.get("description", ""), "parameters": params}
        functions.append(fn)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    size = len(json.dumps(functions))
    if size > limits.max_grammar_chars:
        raise bad_request(f"the tools' definitions have {size:,} characters; at most "
                          f"{limits.max_grammar_chars:,} are allowed ({flag('max_grammar_chars')})", "tools")
    parallel = body.get("parallel_tool_calls") is not False     # its type: protocol.py's model
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fname = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(fname, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {type: 'function', "
                              "function: {name}}", "tool_choice")
        if fname not in names:
            raise bad_request(f"tool_choice names the function {describe(fname)}, which is not in tools",
                              "tool_choice")
        return ToolRequest(tuple(functions), fname, named=True, parallel=parallel)
    if choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{type: 'function', "
                          f"function: {{name}}}}, got {describe(choice)}", "tool_choice")
    return ToolRequest(tuple(functions), choice, parallel=parallel)


def system_prompt(req: ToolRequest) -> str:
    return SYSTEM_PROMPT.format(tools=json.dumps(list(req.functions), ensure_ascii=False))


def template_messages(messages: list, req: ToolRequest | None) -> list[dict]:
    """The checked turns (``protocol.Message``) as SmolLM2's template can render them: the tools'
    system prompt first (after a client's own system message), earlier assistant ``tool_calls`` in
    the tool-call format, ``tool`` messages as user turns in ``<tool_response>``."""
    out = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            out.append({"role": "assistant", "content": m.text + render_calls(m.tool_calls)})
        elif m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.text}\n</tool_response>"})
        else:
            out.append({"role": m.role, "content": m.text})
    if req is not None and req.shown:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system_prompt(req)}
        else:
            out.insert(0, {"role": "system", "content": system_prompt(req)})
    return out


def render_calls(tool_calls: list) -> str:
    """OpenAI ``tool_calls`` of an earlier assistant turn (``protocol.ToolCall``s) in the model's format."""
    def arguments(a):
        try:
            return json.loads(a) if isinstance(a, str) else a
        except ValueError:
            return a

    calls = [json.dumps({"name": c.function.name, "arguments": arguments(c.function.arguments)},
                        ensure_ascii=False) for c in tool_calls]
    return OPEN + "[\n" + ",\n".join(calls) + "\n]" + CLOSE


def constraint(req: ToolRequest) -> StructuredOutputsParams | None:
    """For ``required`` and a named function: a grammar that admits only the tool-call format, each
    call's arguments checked against its function's parameter schema (llguidance's ``%json``)."""
    if req.choice in ("none", "auto"):
        return None
    wanted = [f for f in req.functions if not req.named or f["name"] == req.choice]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in wanted]
    schema = {"anyOf": calls, "x-guidance": _X_GUIDANCE} if len(calls) > 1 else {**calls[0],
                                                                                  "x-guidance": _X_GUIDANCE}
    most = 1 if req.named or not req.parallel else len(req.functions)
    more = f' ("," "\\n"? call)~0..{most - 1}' if most > 1 else ""
    lark = (f'start: "{OPEN}[" "\\n"? call{more} "\\n"? "]{CLOSE}"\n'
            f"call: %json {json.dumps(schema, ensure_ascii=False)}\n")
    return StructuredOutputsParams(grammar=lark)


def unwrapped(text: str) -> str:
    """A tool-call answer that did not parse (cut short by ``max_tokens``) as plain text: without the
    model's ``<tool_call>[`` ... ``]</tool_call>`` wrapper, which is the format's, not the answer's."""
    start = text.find(OPEN)
    if start < 0:
        return text
    inner = text[start + len(OPEN):]
    inner = inner.removesuffix(CLOSE).removesuffix("]") if inner.endswith(CLOSE) else inner
    inner = inner.removeprefix("[").strip("\n")
    return (text[:start] + inner).strip() if text[:start].strip() else inner


def parse_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """``(content before the calls, OpenAI tool_calls)`` if ``text`` holds the tool-call format with
    at least one well-formed call; None otherwise (the text is a plain answer)."""
    start = text.find(OPEN)
    if start < 0:
        return None
    end = text.find(CLOSE, start)
    body = text[start + len(OPEN): end if end >= 0 else len(text)].strip()
    try:
        calls = json.loads(body)
    except ValueError:
        return None
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", {})
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": c["name"],
                                 "arguments": args if isinstance(args, str) else json.dumps(args,
                                                                                            ensure_ascii=False)}})
    content = text[:start].strip() or None
    return content, out
