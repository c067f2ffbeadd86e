"""What a model argument may be, checked without torch: a ``.gguf`` file or a local Hugging Face
directory. minicb never downloads anything, so a Hugging Face Hub id such as
``HuggingFaceTB/SmolLM2-360M-Instruct`` (an ``owner/name`` that is not a path here) is answered with
what to pass instead, before any import of torch or any second of loading."""

from __future__ import annotations

import os
import re

from minicb.core.errors import ModelLoadError

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def looks_like_hub_id(text: str) -> bool:
    """``owner/name`` with no other slash, not starting with ``.`` or ``/`` and not naming a weight
    file: the shape of a Hugging Face Hub id (``HuggingFaceTB/SmolLM2-360M-Instruct``)."""
    return bool(_HUB_ID.fullmatch(text)) and not text.lower().endswith(_WEIGHT_SUFFIXES)


def check_model_path(path, what: str = "model path") -> None:
    """Raise ``ModelLoadError`` if ``path`` (not None) does not exist, saying that minicb never
    downloads when it looks like a Hub id."""
    text = os.fspath(path)
    if os.path.exists(text):
        return
    if looks_like_hub_id(text):
        raise ModelLoadError(f"{what} {text!r} does not exist here, and minicb never downloads: pass a .gguf "
                             "file or a local Hugging Face directory (for instance one written by "
                             "`huggingface-cli download`)")
    raise ModelLoadError(f"{what} {text!r} does not exist; pass a .gguf file or a Hugging Face model "
                         "directory")
