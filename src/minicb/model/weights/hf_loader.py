"""Read a Hugging Face ``LlamaForCausalLM`` directory: ``config.json`` + ``*.safetensors``.

A model saved with ``save_pretrained`` is a directory::

    config.json                      shapes and hyper-parameters (LlamaConfig)
    model.safetensors                the weights, under their PyTorch names ...
    model.safetensors.index.json     ... or split in shards, with a {name: shard file} "weight_map"
    tokenizer.json                   the fast tokenizer (read by ``tokenizer.Tokenizer.from_hf_dir``)
    tokenizer_config.json            chat template, special tokens

The weights are already in the layout minicb uses (minicb's state dict *is* Hugging Face's), so this
module only reads them and checks the configuration describes a plain LLaMA: no biases, SiLU, no
RoPE scaling. Anything else raises ``ModelLoadError`` rather than producing a model that silently
computes something different.

Damaged inputs are errors too, never a crash or a huge allocation: ``config.json`` values of the wrong
type, an index naming files outside the directory, weights that are not floating point, and whatever a
truncated or corrupt ``.safetensors`` file makes the reader raise (it checks the declared offsets
against the file size before reading) all become ``ModelLoadError``.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch

from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument, ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def read_config_json(directory: pathlib.Path) -> dict[str, Any]:
    f = directory / "config.json"
    if not f.is_file():
        raise ModelLoadError(f"{directory} has no config.json; not a Hugging Face model directory")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{f} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{f} must hold a JSON object")
    return cfg


def _first(value):
    """``eos_token_id`` may be a list (several stop tokens); ModelConfig keeps the first."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def config_from_hf(cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """``ModelConfig`` from a parsed ``config.json``. Raises ``ModelLoadError`` for non-LLaMA models."""
    try:
        return _config_from_hf(cfg, where)
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: a value has the wrong type ({type(e).__name__}: {e})") from e


def _config_from_hf(cfg: dict[str, Any], where: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"{where}: 'architectures' must be a list of names, got {archs!r:.60}")
    model_type = cfg.get("model_type")
    if not (set(archs) & set(SUPPORTED_ARCHITECTURES) or (not archs and model_type == "llama")):
        raise ModelLoadError(f"unsupported architecture {archs or model_type!r} in {where}: minicb loads "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type 'llama') only")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelLoadError(f"{where}: {flag}=true is not supported (minicb's LLaMA has no biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; only 'silu'")
    # transformers 4 writes rope_theta / rope_scaling; transformers 5 writes rope_parameters.
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ModelLoadError(f"{where}: RoPE scaling {rope_type!r} is not supported; plain RoPE only")
    try:
        n_heads = cfg["num_attention_heads"]
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim"),
            rope_theta=_number(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", where),
            rms_norm_eps=_number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),  # LlamaConfig's default
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            bos_token_id=_first(cfg.get("bos_token_id")),
            eos_token_id=_first(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where} lacks {e.args[0]!r}, which a LLaMA model needs") from e
    except InvalidArgument as e:
        raise ModelLoadError(f"{where}: {e}") from e


def _number(value, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{where}: {name} must be a number, got {type(value).__name__} {value!r:.60}")
    return float(value)


def safetensors_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The weight files: the shards an index names, or ``model.safetensors``, or every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f and pathlib.PurePath(f).name == f for f in weight_map.values()):
            raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to file names in the "
                                 "same directory")
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{directory}: shards named in the index are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights (minicb reads safetensors only)")
    return files


def load_hf_dir(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """``(config, state_dict)`` of the Hugging Face LLaMA directory at ``path``, weights cast to ``dtype``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = pathlib.Path(path)
    config = config_from_hf(read_config_json(d), str(d / "config.json"))
    state_dict: dict[str, torch.Tensor] = {}
    for f in safetensors_files(d):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, OverflowError) as e:
            reason = " ".join(str(e).split())[:200]
            raise ModelLoadError(f"cannot read {f}: {type(e).__name__}: {reason}") from e
        for name, t in part.items():
            if name.endswith("rotary_emb.inv_freq"):   # a buffer some old checkpoints saved
                continue
            if not t.is_floating_point():
                raise ModelLoadError(f"{f}: weight {name!r} has dtype {t.dtype}; LLaMA weights are floating "
                                     "point")
            state_dict[name] = t.to(dtype)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)        # tied: the embedding is the head
    return config, state_dict
