"""The reference backends plus the CPU's C decode kernel (``cpu-paged``): the runner's ``make_backend``
when the fast paths are on.

``cpu-paged`` (``cpu_paged.CpuPagedAttention``) runs on the CPU for float32, float64 and bfloat16 models
where a C compiler builds its kernel (about a second, cached afterwards). ``auto`` on the CPU takes it,
and falls back to ``reference`` with one logged line saying why when it cannot run; on a CUDA device
``auto`` is the reference registry's choice (``minicb.model.backends``), as is every other name.
"""

from __future__ import annotations

import logging

import torch

from minicb.core.errors import InvalidArgument
from minicb.fastpaths.settings import Settings
from minicb.model import backends as reference
from minicb.model.attention import AttentionBackend
from minicb.model.kv_cache import KVCache

BACKENDS = ("reference", "cpu-paged", "flash-attn", "torch-varlen")
_log = logging.getLogger("minicb")
_FALLBACKS_LOGGED: set[str] = set()


def cpu_paged_reasons(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Why ``cpu-paged`` cannot run here ([] if it can); builds the kernel only if all else allows."""
    from minicb.fastpaths import cpu_paged

    device = torch.device(device)
    reasons = []
    if device.type != "cpu":
        reasons.append(f"the model is on {device.type}; cpu-paged runs on the CPU")
    if dtype not in cpu_paged.DTYPES:
        name_of = str(dtype).removeprefix("torch.")
        reasons.append(f"cpu-paged takes float32, float64 or bfloat16, the model is {name_of}")
    if not reasons and (why := cpu_paged.unavailable_reason()):
        reasons.append(why)
    return reasons


def unavailable_reasons(name: str, device: torch.device | str, dtype: torch.dtype,
                        head_dim: int) -> list[str]:
    """Why backend ``name`` cannot run a model of this dtype / head_dim on ``device`` ([] if it can)."""
    if name == "cpu-paged":
        return cpu_paged_reasons(device, dtype)
    return reference.unavailable_reasons(name, device, dtype, head_dim)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """The concrete backend name for ``name`` (``auto`` included); raises if ``name`` cannot run."""
    if not isinstance(name, str):
        return reference.resolve_backend(name, device, dtype, head_dim)     # raises, naming the choices
    if name == "auto" and torch.device(device).type == "cpu":
        return _auto_cpu(dtype)
    if name == "cpu-paged":
        reasons = cpu_paged_reasons(device, dtype)
        if reasons:
            raise InvalidArgument(f"attn_backend 'cpu-paged' is unavailable here: {'; '.join(reasons)}")
        return name
    return reference.resolve_backend(name, device, dtype, head_dim)


def _auto_cpu(dtype: torch.dtype) -> str:
    """``auto`` on the CPU: ``cpu-paged``, else ``reference`` with one logged line saying why."""
    reasons = cpu_paged_reasons(torch.device("cpu"), dtype)
    if not reasons:
        return "cpu-paged"
    why = "; ".join(reasons)
    if why not in _FALLBACKS_LOGGED:      # once per reason, not once per engine
        _FALLBACKS_LOGGED.add(why)
        _log.warning("minicb: attn_backend auto: using reference, not cpu-paged: %s", why)
    return "reference"


def backend_table(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> dict[str, str]:
    """``{backend: "available" or the reasons it is not}``, for reports (``bench/gpu_check.py``)."""
    return {b: "; ".join(unavailable_reasons(b, device, dtype, head_dim)) or "available" for b in BACKENDS}


def make_backend(name: str, kv_cache: KVCache, device: torch.device | str | None = None,
                 paged: bool | None = None, settings: Settings | None = None) -> AttentionBackend:
    """Build the backend ``name`` resolves to for this cache (its dtype, head_dim and device)."""
    device = kv_cache.data.device if device is None else device
    chosen = resolve_backend(name, device, kv_cache.data.dtype, int(kv_cache.data.shape[-1]))
    if chosen == "cpu-paged":
        from minicb.fastpaths.cpu_paged import CpuPagedAttention

        return CpuPagedAttention(kv_cache, settings)
    return reference.make_backend(chosen, kv_cache, device, paged)
