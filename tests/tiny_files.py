"""Tiny model *files* written by the tests themselves, without transformers: a GGUF (through
``gguf.GGUFWriter``) and a Hugging Face directory (``config.json`` + ``model.safetensors`` +
``tokenizer.json``), both around a random LLaMA of one layer and the 266-token BPE of
``tokenizer_fixtures``. Used by the loader fuzzing and the command-line tests."""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as VT

from minicb.model.weights.gguf_loader import permute_qk
from tokenizer_fixtures import tiny_gguf_tokenizer_metadata

TOKENIZER = tiny_gguf_tokenizer_metadata()
VOCAB = len(TOKENIZER["tokenizer.ggml.tokens"])            # 266
SHAPE = dict(vocab=VOCAB, hidden=32, inter=64, layers=1, heads=2, kv_heads=1, head_dim=16, ctx=4096)

_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_TO_GGUF[rest]}"


def add_hf_tensor(w: gguf.GGUFWriter, hf_name: str, name: str, a: np.ndarray, ty, heads: int,
                  kv_heads: int) -> None:
    """Write one Hugging Face float32 weight as llama.cpp's converter would: Q and K rows permuted
    into its rotary layout, then stored as ``ty`` under the GGUF tensor name ``name``."""
    if hf_name.endswith("q_proj.weight"):
        a = permute_qk(a, heads)
    elif hf_name.endswith("k_proj.weight"):
        a = permute_qk(a, kv_heads)
    if ty == T.F32:
        w.add_tensor(name, a)
    elif ty == T.F16:
        w.add_tensor(name, a.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(a, ty), raw_dtype=ty)


def tiny_weights(seed: int = 0, never_eos: bool = False) -> dict[str, np.ndarray]:
    """Hugging Face names -> float32 arrays, untied head.

    ``never_eos``: the head scores only two letters, ``A`` and ``a``, with opposite signs of one
    hidden dimension, so greedy decoding prints one of them at every step and never ends by itself
    (every other logit, EOS's included, is 0 and one of the two is always positive).
    """
    s = SHAPE
    rng = np.random.default_rng(seed)
    h, i, q, kv = s["hidden"], s["inter"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def w(*shape):
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(s["vocab"], h)}
    for n in range(s["layers"]):
        p = f"model.layers.{n}."
        out |= {p + "input_layernorm.weight": 1 + w(h) / 3, p + "self_attn.q_proj.weight": w(q, h),
                p + "self_attn.k_proj.weight": w(kv, h), p + "self_attn.v_proj.weight": w(kv, h),
                p + "self_attn.o_proj.weight": w(h, q), p + "post_attention_layernorm.weight": 1 + w(h) / 3,
                p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                p + "mlp.down_proj.weight": w(h, i)}
    out["model.norm.weight"] = np.ones(h, np.float32)
    head = w(s["vocab"], h)
    if never_eos:
        head[:] = 0.0
        head[TOKENIZER["tokenizer.ggml.tokens"].index("A"), 0] = 10.0
        head[TOKENIZER["tokenizer.ggml.tokens"].index("a"), 0] = -10.0
    out["lm_head.weight"] = head
    return out


def base_kv() -> dict[str, tuple]:
    """The metadata of the tiny GGUF, ``{key: (value, GGUFValueType)}`` (arrays: (values, ARRAY, sub))."""
    s, md = SHAPE, TOKENIZER
    return {
        "llama.block_count": (s["layers"], VT.UINT32),
        "llama.context_length": (s["ctx"], VT.UINT32),
        "llama.embedding_length": (s["hidden"], VT.UINT32),
        "llama.feed_forward_length": (s["inter"], VT.UINT32),
        "llama.attention.head_count": (s["heads"], VT.UINT32),
        "llama.attention.head_count_kv": (s["kv_heads"], VT.UINT32),
        "llama.rope.freq_base": (10000.0, VT.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, VT.FLOAT32),
        "llama.rope.dimension_count": (s["head_dim"], VT.UINT32),
        "llama.vocab_size": (s["vocab"], VT.UINT32),
        "tokenizer.ggml.model": ("gpt2", VT.STRING),
        "tokenizer.ggml.pre": ("smollm", VT.STRING),
        "tokenizer.ggml.tokens": (md["tokenizer.ggml.tokens"], VT.ARRAY, VT.STRING),
        "tokenizer.ggml.token_type": (md["tokenizer.ggml.token_type"], VT.ARRAY, VT.INT32),
        "tokenizer.ggml.merges": (md["tokenizer.ggml.merges"], VT.ARRAY, VT.STRING),
        "tokenizer.ggml.bos_token_id": (1, VT.UINT32),
        "tokenizer.ggml.eos_token_id": (2, VT.UINT32),
        "tokenizer.ggml.padding_token_id": (2, VT.UINT32),
        "tokenizer.ggml.add_bos_token": (False, VT.BOOL),
        "tokenizer.chat_template": (md["tokenizer.chat_template"], VT.STRING),
    }


def write_gguf(path, weights: dict[str, np.ndarray] | None = None, kv: dict[str, tuple] | None = None,
               quantize: bool = True) -> pathlib.Path:
    """Write a tiny GGUF. ``kv`` overrides or adds metadata (value ``None`` removes a key); with
    ``quantize`` the 2-D weights cycle through Q8_0 / Q4_0 / Q4_1 / F16 (the rest are F32)."""
    weights = tiny_weights() if weights is None else weights
    meta = base_kv()
    for key, value in (kv or {}).items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype, *sub) in meta.items():
        w.add_key_value(key, value, vtype, sub[0] if sub else None)
    types = [T.Q8_0, T.Q4_0, T.Q4_1, T.F16]
    for k, (name, a) in enumerate(weights.items()):
        ty = types[k % len(types)] if quantize and a.ndim == 2 else T.F32
        add_hf_tensor(w, name, gguf_name(name), a, ty, SHAPE["heads"], SHAPE["kv_heads"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pathlib.Path(path)


def hf_config() -> dict:
    s = SHAPE
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": s["vocab"],
            "hidden_size": s["hidden"], "intermediate_size": s["inter"], "num_hidden_layers": s["layers"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
            "head_dim": s["head_dim"], "max_position_embeddings": s["ctx"], "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu"}


def write_hf_dir(path, weights: dict[str, np.ndarray] | None = None, config: dict | None = None):
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files into directory ``path``."""
    from safetensors.numpy import save_file

    from minicb.model.text.tokenizer import Tokenizer

    d = pathlib.Path(path)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config() if config is None else config))
    save_file(tiny_weights() if weights is None else weights, str(d / "model.safetensors"))
    Tokenizer.from_gguf_metadata(TOKENIZER).save_pretrained(d)
    return d
