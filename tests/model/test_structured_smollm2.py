"""Structured outputs on the real model, offline (``LLM.generate``): token-exact with a grammar that
allows everything, JSON that validates, and a forced tool call in SmolLM2's own format."""

import json

import jsonschema
import pytest
import torch

from minicb.core.sampling_params import SamplingParams
from minicb.core.structured_outputs import StructuredOutputsParams as S
from minicb.entrypoints.llm import LLM
from minicb.entrypoints.serve.limits import ServeLimits
from minicb.entrypoints.serve.protocol import parse_chat
from minicb.entrypoints.serve.tools import parse_calls
from minicb.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(smollm2):
    model = LlamaForCausalLM.from_state_dict(smollm2.config, smollm2.state_dict, torch.float64)
    return LLM(model, tokenizer=smollm2.tokenizer, max_num_seqs=8)


def chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template(text)


def test_a_grammar_that_allows_any_text_leaves_the_greedy_tokens_unchanged(llm):
    """The mask of ``(?s:.*)`` keeps every text token (and EOS: the grammar is always complete), so
    each row's argmax is the unconstrained one; the plain request beside it is untouched too."""
    prompts = [chat(llm, "Name three colours."), chat(llm, "What is 2 + 2?")]
    plain = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16))]
    anything = SamplingParams(max_tokens=16, structured_outputs=S(regex="(?s:.*)"))
    mixed = llm.generate(prompts, [anything, SamplingParams(max_tokens=16)])
    assert [o.token_ids for o in mixed] == plain


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    prompt = chat(llm, "Describe a fictional person as JSON with their name and age.")
    params = [SamplingParams(max_tokens=60, structured_outputs=S(json=PERSON))] + [
        SamplingParams(max_tokens=60, temperature=0.8, seed=s, structured_outputs=S(json=PERSON))
        for s in range(3)]
    for o in llm.generate([prompt] * len(params), params):
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)


def test_a_forced_tool_call_parses_and_its_arguments_validate(llm):
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "What's the weather in Berlin?"}], "tools": [weather],
            "tool_choice": "required", "max_tokens": 60, "temperature": 0}
    parsed = parse_chat(body, llm.tokenizer.apply_chat_template, ServeLimits())
    assert "<tools>" in parsed.generate.prompt and "get_weather" in parsed.generate.prompt
    out = llm.generate([parsed.generate.prompt], parsed.generate.params)[0]
    assert out.finish_reason == "stop", out.text
    content, calls = parse_calls(out.text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), weather["function"]["parameters"])
