"""The models the measuring tools run: the tiny random one (``"tiny"``: 2 layers, vocabulary 256,
for pictures and quick runs), SmolLM2 (``"default"``), or a GGUF file / Hugging Face directory."""

from __future__ import annotations


def build_model(name: str, dtype: str, seed: int = 0, gguf_blocks: dict | None = None):
    """(model, tokenizer) for ``name``: 'tiny' is a random 2-layer model (vocab 256), 'default' SmolLM2.
    ``gguf_blocks``, a dict, gets a GGUF's quantized weights as stored (``LoadedModel.gguf_blocks``)."""
    import torch

    from minicb.core.config import TINY_MODEL
    from minicb.model.llama import LlamaForCausalLM, as_dtype

    if name == "tiny":
        return LlamaForCausalLM.random(TINY_MODEL, seed=seed, dtype=as_dtype(dtype), std=0.3), None
    from minicb.model.weights.loader import load_model

    loaded = load_model(None if name == "default" else name, dtype=as_dtype(dtype))
    if gguf_blocks is not None:
        gguf_blocks.update(loaded.gguf_blocks)
    model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, as_dtype(dtype),
                                             torch.device("cpu"))
    return model, loaded.tokenizer
