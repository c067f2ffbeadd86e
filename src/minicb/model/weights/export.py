"""Write a model as a Hugging Face directory: what other engines (transformers, vLLM) read.

minicb reads llama.cpp's GGUF files; most other inference engines read the directory that
``save_pretrained`` writes. To run a peer on the very same weights (``bench/peer_vllm.py``), or to
serve them through a tool that only speaks Hugging Face, ``export_hf`` turns whatever
``load_model`` reads into such a directory::

    OUT/
      config.json              LlamaConfig: shapes, rope_theta, rms_norm_eps, tied embeddings, special ids
      generation_config.json   bos / eos / pad ids (what ``generate`` stops on)
      model.safetensors        every weight, dequantized, under Hugging Face names, in ``dtype``
      tokenizer.json           the fast tokenizer minicb built from the GGUF vocabulary and merges
      tokenizer_config.json    the chat template and the special tokens

The weights need no translation: ``load_model`` already returns Hugging Face names and layouts
(``gguf_loader`` undoes llama.cpp's Q/K row permutation), so export is "dequantize, then write".
Dequantized 4-bit weights are exact in float32 (every value is ``d * q + m`` in float32 arithmetic), so a
float32 export is the GGUF model itself; a bfloat16 export rounds each weight once. With tied
embeddings (SmolLM2) only ``model.embed_tokens.weight`` is written and ``config.json`` says
``tie_word_embeddings``, as ``save_pretrained`` does.

Invariant (``tests/model/test_export.py``): transformers' ``AutoModelForCausalLM`` and ``AutoTokenizer`` on
the exported directory compute the same logits and tokens as minicb on the source file, and
``load_model`` of the directory gives back the same weights.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument
from minicb.model.weights.loader import LoadedModel, load_model

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config_dict(config: ModelConfig, dtype: torch.dtype, pad_token_id: int | None = None) -> dict:
    """``config.json`` of a plain LLaMA (what transformers' ``LlamaConfig`` writes, both RoPE spellings:
    transformers 5 reads ``rope_parameters``, older readers ``rope_theta``)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": pad_token_id,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def generation_config_dict(config: ModelConfig, pad_token_id: int | None = None) -> dict:
    """``generation_config.json``: the special ids only, so no engine picks up sampling defaults."""
    out = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    if pad_token_id is not None:
        out["pad_token_id"] = pad_token_id
    return out


def export_hf(out: str | os.PathLike, model: str | os.PathLike | None = None,
              dtype: str | torch.dtype = "float32", overwrite: bool = False) -> pathlib.Path:
    """Export ``model`` (a GGUF file or Hugging Face directory; ``None``: the default SmolLM2) to the
    Hugging Face directory ``out``, weights in ``dtype`` (float32, bfloat16 or float16). ``out`` must be
    absent or empty unless ``overwrite``. Returns ``out`` as a ``Path``."""
    torch_dtype = _export_dtype(dtype)
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise InvalidArgument(f"out must be a directory, {str(out)!r} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InvalidArgument(f"out directory {str(out)!r} is not empty (pass overwrite=True / --force)")
    loaded = load_model(model, dtype=torch.float32)
    write_hf_dir(out, loaded, torch_dtype)
    return out


def write_hf_dir(out: pathlib.Path, loaded: LoadedModel, dtype: torch.dtype) -> None:
    """Write the five files of the module docstring for an already loaded model."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg, tok = loaded.config, loaded.tokenizer
    pad = tok.pad_token_id
    _write_json(out / "config.json", hf_config_dict(cfg, dtype, pad))
    _write_json(out / "generation_config.json", generation_config_dict(cfg, pad))
    weights = {k: v.to(dtype).contiguous() for k, v in loaded.state_dict.items()}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)     # the head *is* the embedding; readers re-tie it
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)


def _export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in EXPORT_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in EXPORT_DTYPES:
        return EXPORT_DTYPES[dtype]
    raise InvalidArgument(f"dtype must be one of {tuple(EXPORT_DTYPES)}, got {dtype!r}")


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
