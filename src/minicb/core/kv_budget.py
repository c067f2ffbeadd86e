"""How many KV blocks ``LLM()`` gives the paged cache when nobody says: sized from memory, as vLLM does.

The KV pool is the one big allocation whose size is a choice. vLLM measures what is left after the
weights and takes a share of it (``gpu_memory_utilization`` on a GPU, ``VLLM_CPU_KVCACHE_SPACE`` GiB or
a share of the node's RAM on the CPU, ``kv_cache_memory_bytes`` to say it outright). minicb does the
same, in a few lines and with no probing run::

    bytes per block = layers x 2 (K and V) x block_size x kv_heads x head_dim x dtype size
    budget          = kv_cache_memory_bytes if given, else min(DEFAULT_MAX_BYTES, SHARE x available RAM)
                      (available: ``memory.available_cpu_bytes``, the cgroup's limit included)
    num_blocks      = budget // bytes per block, at most what max_num_seqs sequences of max_model_len
                      can ever hold (more blocks could never be used), at least one block

For SmolLM2-135M in float32 a block of 16 tokens is 720 KiB (30 layers x 2 x 16 x 3 heads x 64 x 4
bytes), so the 2 GiB default holds about 46,000 tokens: every request of the benchmarks' W2 at once,
with room to spare. ``LLM(num_blocks=N)`` still sets the pool exactly (the tests do); the command line
takes ``--kv-cache-memory GIB`` and ``--num-blocks N``. Torch-free: it only does arithmetic on the
model's shape. The pool is allocated lazily (``kv_cache.lazy_zeros``): a block's memory is committed
when it is first written, so a generous default costs nothing until requests fill it.
"""

from __future__ import annotations

from minicb.core.config import ModelConfig
from minicb.core.errors import check_int
from minicb.core.memory import available_cpu_bytes

GIB = 1 << 30
DEFAULT_MAX_BYTES = 2 * GIB      # the most the default takes, however much RAM is free
SHARE = 0.25                     # ... and at most this share of the RAM available now


def bytes_per_block(model: ModelConfig, block_size: int, dtype_size: int) -> int:
    """Bytes of K and V that one block of ``block_size`` tokens holds over every layer."""
    return (model.num_hidden_layers * 2 * block_size * model.num_key_value_heads * model.head_dim
            * dtype_size)


def default_budget(available: int | None) -> int:
    """The default KV budget in bytes for ``available`` bytes of free RAM (None: unknown)."""
    if available is None:
        return DEFAULT_MAX_BYTES
    return max(0, min(DEFAULT_MAX_BYTES, int(SHARE * available)))


def num_blocks_for(model: ModelConfig, *, block_size: int, dtype_size: int, max_num_seqs: int,
                   max_model_len: int, kv_cache_memory_bytes: int | None = None,
                   available: int | None = None) -> int:
    """The number of KV blocks for a budget (module docstring); ``available`` defaults to
    ``memory.available_cpu_bytes()``. Raises ``InvalidArgument`` for a budget that is not a positive
    integer."""
    if kv_cache_memory_bytes is None:
        budget = default_budget(available_cpu_bytes() if available is None else available)
    else:
        budget = check_int("kv_cache_memory_bytes", kv_cache_memory_bytes, lo=1)
    per_block = bytes_per_block(model, block_size, dtype_size)
    most_useful = max_num_seqs * -(-max_model_len // block_size)
    return max(1, min(budget // per_block, most_useful))


def gib_flag(value: float | None) -> int | None:
    """``--kv-cache-memory GIB`` as bytes (None: size the pool from memory); a clear error if not > 0."""
    from minicb.core.errors import InvalidArgument

    if value is None:
        return None
    if not 0 < value < float("inf"):
        raise InvalidArgument(f"--kv-cache-memory must be a positive number of GiB, got {value}")
    return int(value * GIB)
