"""The physical paged KV cache: the tensors that ``block_manager.py`` hands out in blocks.

Layout ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (index 0 of dim 1 is K, 1 is V).
Viewed per layer as ``[num_blocks * block_size, kv_heads, head_dim]``, a token's K/V lives at the flat
*slot* ``block_id * block_size + offset``. The packer computes one slot per new token
(``slot_mapping``), the model writes through it, and attention reads older tokens back through the
block tables: the block manager decides, this module only stores.

Swap preemption copies whole blocks between this device pool and a host pool of the same layout
(``swap_out``: device → host, ``swap_in``: host → device).

The pools are sized by the user, so their bytes are compared with the memory the device (and the
host) can still give *before* they are allocated (``minicb.core.memory``): ``num_blocks=10**10`` is an
``InvalidArgument`` naming the sizes, not an allocator traceback or the OOM killer.
"""

from __future__ import annotations

import math
import mmap

import torch

from minicb.core.memory import available_cpu_bytes, check_fits


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros. On the CPU they are an anonymous private ``mmap``, whose pages the OS maps, zero-filled,
    only when first written: a pool sized for the worst case costs neither time nor memory until used.

    Plain 4 KiB pages, on purpose: with transparent huge pages (what numpy's ``zeros`` asks for on large
    arrays) the first write into each 2 MiB stretch makes the kernel find and zero a whole huge page,
    and a pool is written sparsely (writing W2's K/V into a fresh pool: 1.8 s with huge pages, 0.6 s
    with plain ones, ``python bench/step_parts.py --pool-pages``). Private, too: a shared mapping is
    backed by shared memory, whose first touch costs more (0.73 s private against 0.92 s shared)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    """The physical K/V tensors of every layer, cut into blocks; written through ``slot_mapping``.

    Note the two meanings of "slot" in minicb: a *batch slot* (``slot_table``, ``ScheduledSeq.slot_id``)
    is a row of the running batch; a *KV slot* (``slot_mapping``) is one token position in this cache,
    ``block * block_size + offset``.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 num_host_blocks: int = 0) -> None:
        check_pool_memory(num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device,
                          num_host_blocks)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.data = lazy_zeros(shape, dtype, device)
        # each layer's K and V as flat [slots, kv_heads, head_dim] views, made once: a step asks for
        # them twice per layer (write, then attend), and making them is five small torch ops each time
        self.layers = [(self.data[i, 0].flatten(0, 1), self.data[i, 1].flatten(0, 1))
                       for i in range(num_layers)]
        host_shape = (num_layers, 2, num_host_blocks, block_size, kv_heads, head_dim)
        self.host = torch.zeros(host_shape, dtype=dtype, device="cpu")

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as flat ``[slots, kv_heads, head_dim]`` views (of ``data``)."""
        return self.layers[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              valid: torch.Tensor | None = None) -> None:
        """Store the new tokens' K/V at their slots; tokens with slot -1 (padding) are not stored."""
        kc, vc = self.layer(layer)
        if valid is not None and not bool(valid.all()):
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
        kc[slot_mapping] = k
        vc[slot_mapping] = v

    def copy_blocks(self, mapping: tuple[tuple[int, int], ...]) -> None:
        """Copy device blocks to device blocks, every layer, K and V: ``mapping`` is ``((src, dst), ...)``
        (copy-on-write of a fork's shared last block; no destination is also a source)."""
        if mapping:
            src = torch.tensor([m[0] for m in mapping], device=self.data.device)
            dst = torch.tensor([m[1] for m in mapping], device=self.data.device)
            self.data[:, :, dst] = self.data[:, :, src]

    def swap_out(self, mapping: tuple[tuple[int, int], ...]) -> None:
        """Copy device blocks to host blocks: ``mapping`` is ``((device, host), ...)``."""
        if mapping:
            dev = torch.tensor([m[0] for m in mapping], device=self.data.device)
            host = torch.tensor([m[1] for m in mapping])
            self.host[:, :, host] = self.data[:, :, dev].to("cpu")

    def swap_in(self, mapping: tuple[tuple[int, int], ...]) -> None:
        """Copy host blocks back to device blocks: ``mapping`` is ``((host, device), ...)``."""
        if mapping:
            host = torch.tensor([m[0] for m in mapping])
            dev = torch.tensor([m[1] for m in mapping], device=self.data.device)
            self.data[:, :, dev] = self.host[:, :, host].to(self.data.device)


def check_pool_memory(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device, num_host_blocks: int = 0) -> None:
    """Raise ``InvalidArgument`` if the device pool, or the host pool, needs more memory than is free."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = num_layers * 2 * block_size * kv_heads * head_dim * elem      # K and V, every layer
    shape = (f"{num_layers} layers x 2 (K, V) x {block_size:,} tokens x {kv_heads} KV heads x {head_dim} "
             f"x {elem} bytes per block")
    hint = "lower num_blocks or block_size" + (" or num_host_blocks" if num_host_blocks else "")
    dev = torch.device(device)
    device_bytes, host_bytes = per_block * num_blocks, per_block * num_host_blocks
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0] if torch.cuda.is_available() else None
        check_fits(f"the KV cache ({num_blocks:,} blocks; {shape})", device_bytes, free, f"on {dev}", hint)
    else:
        host_bytes += device_bytes
    check_fits(f"the KV cache ({num_blocks:,} device + {num_host_blocks:,} host blocks; {shape})", host_bytes,
               available_cpu_bytes(), "in host memory", hint)
