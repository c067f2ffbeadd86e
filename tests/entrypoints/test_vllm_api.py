"""Where a vLLM user reaches for vLLM's offline API, minicb answers (issue 45): ``LLM.chat`` with the
model's chat template, ``generate(..., use_tqdm=...)``, ``LLM.get_tokenizer()``,
``RequestOutput.prompt``, and ``LLMEngine.add_request(request_id, prompt, params)`` with the id first
(a call that leaves it out is told so). The differences that remain are docs/vllm_differences.md."""

from __future__ import annotations

import pytest

from helpers import tiny_model
from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints import llm as llm_module
from minicb.entrypoints.llm import LLM
from tokenizer_fixtures import tiny_tokenizer

# the tiny model over the test tokenizer's 266 ids (its ChatML template renders the conversations)
MODEL = ModelConfig(vocab_size=266, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    max_position_embeddings=4096, eos_token_id=2)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def llm():
    with LLM(tiny_model(MODEL), tokenizer=tiny_tokenizer(), max_num_seqs=4, num_blocks=64,
             block_size=4) as llm:
        yield llm


def test_get_tokenizer_is_the_engines_tokenizer(llm):
    assert llm.get_tokenizer() is llm.tokenizer is tiny_tokenizer()


def test_request_output_prompt_is_the_text_given_or_none_for_token_ids(llm):
    text, ids = "hello there", [40, 41, 42]
    outs = llm.generate([text, ids], GREEDY)
    assert [o.prompt for o in outs] == [text, None]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(text)
    llm.engine.add_request("s", text, GREEDY)            # streaming: every output carries it too
    streamed = [o for _ in range(100) if llm.engine.has_unfinished_requests() for o in llm.engine.step()]
    assert streamed and {o.prompt for o in streamed} == {text}


def test_chat_renders_the_chat_template_then_generates_it(llm):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\n")                 # ChatML, written out by hand
    (out,) = llm.chat(conversation, GREEDY)
    (want,) = llm.generate([rendered], GREEDY)
    assert out.prompt == rendered and out.token_ids == want.token_ids and len(out.token_ids) == 6


def test_chat_takes_a_list_of_conversations_in_order(llm):
    convs = [[{"role": "user", "content": c}] for c in ("a", "bb", "ccc")]
    outs = llm.chat(convs, GREEDY)
    assert [o.prompt for o in outs] == [llm.tokenizer.apply_chat_template(c) for c in ("a", "bb", "ccc")]
    assert [o.token_ids for o in outs] == [llm.chat(c, GREEDY)[0].token_ids for c in convs]


@pytest.mark.parametrize("bad", ["Hi", [], None, [{"role": "user"}]])
def test_chat_refuses_what_is_not_a_conversation(llm, bad):
    with pytest.raises(InvalidArgument):
        llm.chat(bad, GREEDY)


@pytest.mark.parametrize("kwargs, bar", [({"use_tqdm": True}, True), ({"use_tqdm": False}, False),
                                         ({}, False), ({"progress": True}, True),
                                         ({"progress": True, "use_tqdm": False}, False)])
def test_use_tqdm_is_vllms_name_for_the_progress_bar(llm, monkeypatch, kwargs, bar):
    made = []
    real = llm_module._progress
    monkeypatch.setattr(llm_module, "_progress", lambda total: made.append(total) or real(total))
    outs = llm.generate(["a", "b"], GREEDY, **kwargs)
    assert len(outs) == 2 and made == ([2] if bar else [])


def test_add_request_takes_the_id_first_and_says_so_when_it_is_left_out(llm):
    assert llm.engine.add_request("mine", "hello", GREEDY) == "mine"
    with pytest.raises(InvalidArgument, match=r"add_request takes \(request_id, prompt, params\)"):
        llm.engine.add_request("hello", GREEDY)           # vLLM's order is (request_id, prompt, params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


@pytest.mark.slow
@pytest.mark.model
def test_chat_answers_as_minicb_generate_chat_does(smollm2_path, capsys):
    """Greedy ``llm.chat([{"role": "user", "content": "Hi"}])`` is ``minicb generate --chat "Hi"``."""
    from minicb.entrypoints.cli import main

    assert main(["generate", "--chat", "Hi", "--max-tokens", "12"]) == 0
    cli_text = capsys.readouterr().out
    with LLM() as real:
        (out,) = real.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=12))
    assert out.text.strip() and cli_text == out.text + "\n"
