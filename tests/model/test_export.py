"""``minicb.model.weights.export``: a GGUF model written as a Hugging Face directory that transformers reads.

The tiny GGUF of ``tiny_files`` (one layer, GQA 2:1, quantized weights of four types, a 266-token BPE
with a chat template) is exported; transformers loads the directory with its own code, and its logits,
greedy tokens and tokenizer must agree with minicb reading the GGUF itself.
"""

import json

import pytest
import torch

from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM
from minicb.model.attention import ReferenceAttention
from minicb.model.llama import LlamaForCausalLM
from minicb.model.weights.export import export_hf
from minicb.model.weights.loader import load_model
from minicb.runtime.packer import pack_prompts
from tiny_files import hf_config, tiny_weights, write_gguf
from tokenizer_fixtures import SAMPLE

PROMPT_TEXTS = ["hello world", "the cat sat", "A"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    gguf = write_gguf(d / "tiny.gguf")
    return gguf, export_hf(d / "hf", gguf)


def minicb_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    b = pack_prompts([ids])
    return model(b.input_ids, b.positions, ReferenceAttention(None), b.attn, b.logits_indices)


def test_files_and_config(files):
    gguf, out = files
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                      "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]
    cfg = json.loads((out / "config.json").read_text())
    want = hf_config()      # the tiny model's config as the test files write it, by hand
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == want[key], key
    assert cfg["rope_theta"] == want["rope_theta"]
    assert cfg["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["chat_template"] == load_model(gguf).tokenizer.chat_template
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_reloads_to_the_same_weights(files):
    gguf, out = files
    a, b = load_model(gguf), load_model(out)
    assert a.config == b.config
    assert set(a.state_dict) == set(b.state_dict)
    for k, v in a.state_dict.items():
        assert torch.equal(v, b.state_dict[k]), k
    # the dequantized weights are not trivially equal to the float32 originals (they are 4/8-bit)
    orig = torch.from_numpy(tiny_weights()["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(a.state_dict["model.layers.0.self_attn.q_proj.weight"], orig)


def test_transformers_logits_and_greedy_tokens_equal_minicb(files):
    import transformers

    gguf, out = files
    # SDPA, not "eager": transformers' eager attention takes its softmax in float32 even for a float64
    # model (1e-6 off), SDPA on the CPU computes in float64, so the two forwards agree to rounding.
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64,
                                                           attn_implementation="sdpa").eval()
    loaded = load_model(gguf, dtype=torch.float64)
    mine = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.float64)
    prompts = [loaded.tokenizer.encode(t) for t in PROMPT_TEXTS]
    with torch.no_grad():
        for ids in prompts:
            theirs = hf(torch.tensor([ids])).logits[0]
            ours = minicb_logits(mine, ids)
            assert theirs.shape == ours.shape
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    llm = LLM(mine, tokenizer=loaded.tokenizer)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for ids, o in zip(prompts, outs):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=2)
        assert gen[0, len(ids):].tolist() == o.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1      # not one degenerate continuation


def test_tokenizer_round_trips_in_transformers(files):
    from transformers import AutoTokenizer

    gguf, out = files
    ours = load_model(gguf).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(out))
    for text in SAMPLE:
        ids = ours.encode(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, text
        assert theirs.decode(ids, skip_special_tokens=False) == ours.decode(ids, False) == text, text
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    msgs = [{"role": "user", "content": "hi"}]
    assert theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(msgs)


def test_bfloat16_export_rounds_once(tmp_path, files):
    gguf, _ = files
    out = export_hf(tmp_path / "bf16", gguf, dtype="bfloat16")
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    f32 = load_model(gguf).state_dict
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for k, v in stored.items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, f32[k].to(torch.bfloat16)), k


def test_bad_arguments(tmp_path, files):
    gguf, _ = files
    with pytest.raises(InvalidArgument, match="dtype must be one of"):
        export_hf(tmp_path / "x", gguf, dtype="int8")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(InvalidArgument, match="not empty"):
        export_hf(tmp_path / "full", gguf)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgument, match="is a file"):
        export_hf(tmp_path / "file", gguf)


def test_cli_export_hf(tmp_path, files, capsys):
    from minicb.entrypoints.cli import main

    gguf, first = files
    out = tmp_path / "cli"
    assert main(["export-hf", str(out), "--model", str(gguf)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert (out / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    # a second export into the now non-empty directory is a usage error (one line, exit 2) ...
    assert main(["export-hf", str(out), "--model", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minicb: error: out directory") and err.count("\n") == 1
    # ... unless forced
    assert main(["export-hf", str(out), "--model", str(gguf), "--dtype", "bfloat16", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
