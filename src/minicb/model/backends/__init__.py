"""The attention-backend registry of the reference model: which backends exist, which can run here,
and the automatic choice.

=================  =====================================================  ==================================
name               kernel                                                 runs where
=================  =====================================================  ==================================
``reference``      pure PyTorch (``attention.ReferenceAttention``)        anywhere, any dtype
``flash-attn``     ``flash_attn.flash_attn_varlen_func`` (``flash.py``)    CUDA, sm80+, float16 / bfloat16
``torch-varlen``   ``torch.nn.attention.varlen.varlen_attn``              CUDA, sm80+, float16 / bfloat16
=================  =====================================================  ==================================

``auto`` picks the fastest of these that can run here: on a CUDA device the first of ``flash-attn``,
``torch-varlen`` that can run for the model's dtype, else ``reference``; on the CPU ``reference``.
The CPU's C decode kernel (``cpu-paged``) is a fast path, outside this package: ``minicb.fastpaths``
has a ``make_backend`` of its own that adds it (and makes it ``auto``'s choice on the CPU) and hands
every other name to this one. The runner is given one of the two (``LLM(fast_paths=...)``).
Asking by name for a backend that cannot run raises ``InvalidArgument`` naming the backend and every
reason (flash-attn not installed, no CUDA, model not on a CUDA device, dtype, head_dim, GPU too old,
torch without ``varlen_attn``).

Nothing here touches a GPU to decide: the probes are small functions (``cuda_available``,
``cuda_capability``, ``flash_attn_kernel``, ``torch_varlen_kernel``) that the tests replace.
"""

from __future__ import annotations

import importlib

import torch

from minicb.core.errors import InvalidArgument
from minicb.model.attention import AttentionBackend, ReferenceAttention
from minicb.model.kv_cache import KVCache

BACKENDS = ("reference", "flash-attn", "torch-varlen")
FAST_PATH_BACKENDS = ("cpu-paged",)     # minicb.fastpaths
NAMES = ("auto", *BACKENDS, *FAST_PATH_BACKENDS)
AUTO_ORDER = ("flash-attn", "torch-varlen")        # preference of ``auto`` on a CUDA device
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except Exception:   # noqa: BLE001 - no driver, or a device index that does not exist
        return None


def flash_attn_kernel():
    """``flash_attn.flash_attn_varlen_func``, or None when flash-attn is not installed (or broken)."""
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except (ImportError, AttributeError, OSError):   # OSError: a wheel built for another CUDA / torch
        return None


def torch_varlen_kernel():
    """``torch.nn.attention.varlen.varlen_attn``, or None when this torch does not have it."""
    try:
        return importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None


def unavailable_reasons(name: str, device: torch.device | str, dtype: torch.dtype,
                        head_dim: int) -> list[str]:
    """Why backend ``name`` cannot run a model of this dtype / head_dim on ``device`` ([] if it can)."""
    if name == "reference":
        return []
    device = torch.device(device)
    if name in FAST_PATH_BACKENDS:
        return [f"{name} is a CPU fast path: it runs with the fast paths on (LLM(fast_paths=True), the "
                "default; minicb.fastpaths.make_backend), not with the reference model alone"]
    reasons = []
    if name == "flash-attn" and flash_attn_kernel() is None:
        reasons.append("the flash_attn package is not installed (pip install flash-attn, or "
                       "minicb[gpu])")
    if name == "torch-varlen" and torch_varlen_kernel() is None:
        reasons.append(f"torch {torch.__version__} lacks torch.nn.attention.varlen.varlen_attn")
    if not cuda_available():
        reasons.append("no CUDA (torch.cuda.is_available() is False)")
    elif device.type != "cuda":
        reasons.append(f"the model is on {device.type}, not on a CUDA device (use device='cuda')")
    else:
        cap = cuda_capability(device)
        if cap is not None and cap < (8, 0):
            reasons.append(f"the GPU has compute capability {cap[0]}.{cap[1]}; FlashAttention 2 needs "
                           "8.0 or newer")
    if dtype not in KERNEL_DTYPES:
        name_of = str(dtype).removeprefix("torch.")
        reasons.append(f"the kernels take float16 or bfloat16, the model is {name_of} (use dtype='bfloat16')")
    if head_dim % 8 or head_dim > 256:
        reasons.append(f"head_dim must be a multiple of 8 up to 256, the model has {head_dim}")
    return reasons


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device``; ``InvalidArgument`` if it is malformed or CUDA is absent."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:     # e.g. torch.device(10**30)
        raise InvalidArgument(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cuda" and not cuda_available():
        raise InvalidArgument(f"device {device!r} needs CUDA, and torch.cuda.is_available() is False "
                              f"(torch {torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """The concrete backend name for ``name`` (``auto`` included); raises if ``name`` cannot run."""
    if not isinstance(name, str) or name not in NAMES:
        raise InvalidArgument(f"attn_backend must be one of {NAMES}, got {name!r}")
    if name == "auto":
        if dtype not in KERNEL_DTYPES or torch.device(device).type != "cuda" or not cuda_available():
            return "reference"    # decided without importing the kernels (torch's varlen takes ~1 s)
        return next((b for b in AUTO_ORDER if not unavailable_reasons(b, device, dtype, head_dim)),
                    "reference")
    reasons = unavailable_reasons(name, device, dtype, head_dim)
    if reasons:
        raise InvalidArgument(f"attn_backend {name!r} is unavailable here: {'; '.join(reasons)}")
    return name


def backend_table(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> dict[str, str]:
    """``{backend: "available" or the reasons it is not}``, for reports (``bench/gpu_check.py``)."""
    return {b: "; ".join(unavailable_reasons(b, device, dtype, head_dim)) or "available" for b in BACKENDS}


def make_backend(name: str, kv_cache: KVCache, device: torch.device | str | None = None,
                 paged: bool | None = None) -> AttentionBackend:
    """Build the backend ``name`` resolves to for this cache (its dtype, head_dim and device)."""
    device = kv_cache.data.device if device is None else device
    chosen = resolve_backend(name, device, kv_cache.data.dtype, int(kv_cache.data.shape[-1]))
    if chosen == "reference":
        return ReferenceAttention(kv_cache)
    if chosen == "flash-attn":
        from minicb.model.backends.flash import FlashAttnBackend

        return FlashAttnBackend(kv_cache, flash_attn_kernel(), paged)
    from minicb.model.backends.torch_varlen import TorchVarlenBackend

    return TorchVarlenBackend(kv_cache, torch_varlen_kernel(), paged)


__all__ = ["BACKENDS", "NAMES", "backend_table", "check_device", "make_backend", "resolve_backend",
           "unavailable_reasons"]
