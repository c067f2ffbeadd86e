"""The paged KV cache (``model/kv_cache.py``): where a write lands, the padding rule, layers kept apart,
swapping, and the CUDA-only branches (lazy allocation, the device-memory check) run with CUDA faked.

Expected values are written out by hand from the layout ``[layers, 2 (K, V), blocks, block_size,
kv_heads, head_dim]``: the token at flat slot ``s`` of layer ``l`` is ``data[l, 0|1, s // bs, s % bs]``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import minicb.fastpaths.host_memory as host_memory
import minicb.model.kv_cache as kv_cache
from helpers import TINY, baseline_tokens, run_engine, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.model.kv_cache import KVCache, check_pool_memory, lazy_zeros


def small_cache(num_layers=3, num_blocks=4, block_size=2, kv_heads=1, head_dim=2, host=0) -> KVCache:
    return KVCache(num_layers, num_blocks, block_size, kv_heads, head_dim, torch.float64,
                   num_host_blocks=host)


def kv(values: list[float], head_dim=2) -> torch.Tensor:
    """One ``[1 head, head_dim]`` row per value, every element equal to the value."""
    return torch.tensor(values, dtype=torch.float64)[:, None, None].expand(-1, 1, head_dim).clone()


def stored(cache: KVCache, layer: int, which: int) -> list[float]:
    """The first element of every slot of one layer's K (0) or V (1), slot order."""
    return cache.data[layer, which].flatten(0, 1)[:, 0, 0].tolist()


def test_shape_and_num_layers_with_three_layers():
    c = small_cache(num_layers=3, num_blocks=4, block_size=2)
    assert c.data.shape == (3, 2, 4, 2, 1, 2)
    assert c.num_layers == 3 and c.num_blocks == 4 and c.block_size == 2
    assert small_cache(num_layers=5).num_layers == 5


def test_a_write_lands_at_its_slots_in_its_layer_only():
    c = small_cache()
    c.write(1, kv([1.0, 2.0, 3.0]), kv([10.0, 20.0, 30.0]), torch.tensor([0, 5, 7]))
    assert stored(c, 1, 0) == [1.0, 0, 0, 0, 0, 2.0, 0, 3.0]
    assert stored(c, 1, 1) == [10.0, 0, 0, 0, 0, 20.0, 0, 30.0]
    assert stored(c, 0, 0) == stored(c, 2, 0) == stored(c, 0, 1) == stored(c, 2, 1) == [0.0] * 8
    k, v = c.layer(1)                              # the flat views read back what was written
    assert k[5, 0, 0] == 2.0 and v[7, 0, 1] == 30.0 and c.data[1, 0, 2, 1, 0, 0] == 2.0


def test_padding_rows_with_slot_minus_one_are_not_stored():
    """Rows marked invalid carry slot -1; writing them would hit the pool's last slot (index -1)."""
    c = small_cache()
    c.write(0, kv([9.0, 9.0, 9.0]), kv([9.0, 9.0, 9.0]), torch.tensor([6, 6, 7]))   # something there
    slots = torch.tensor([2, -1, 3, -1])
    c.write(0, kv([1.0, 5.0, 2.0, 6.0]), kv([11.0, 15.0, 12.0, 16.0]), slots, valid=slots >= 0)
    assert stored(c, 0, 0) == [0, 0, 1.0, 2.0, 0, 0, 9.0, 9.0]          # slot 7 (= -1) kept its 9
    assert stored(c, 0, 1) == [0, 0, 11.0, 12.0, 0, 0, 9.0, 9.0]


def test_an_all_valid_mask_writes_every_row():
    c = small_cache()
    slots = torch.tensor([1, 4])
    c.write(2, kv([1.0, 2.0]), kv([3.0, 4.0]), slots, valid=torch.tensor([True, True]))
    assert stored(c, 2, 0) == [0, 1.0, 0, 0, 2.0, 0, 0, 0]
    assert stored(c, 2, 1) == [0, 3.0, 0, 0, 4.0, 0, 0, 0]


def test_swap_out_and_in_copy_whole_blocks_of_every_layer():
    c = small_cache(num_blocks=3, block_size=2, host=2)
    for layer in range(3):
        c.write(layer, kv([layer + 1.0, layer + 2.0]), kv([-1.0, -2.0]), torch.tensor([2, 3]))   # block 1
    c.swap_out(((1, 0),))
    assert c.host[:, :, 0].equal(c.data[:, :, 1]) and c.host[:, :, 1].abs().sum() == 0
    c.data.zero_()
    c.swap_in(((0, 2),))                           # host block 0 back into device block 2
    for layer in range(3):
        assert stored(c, layer, 0) == [0, 0, 0, 0, layer + 1.0, layer + 2.0]
        assert stored(c, layer, 1) == [0, 0, 0, 0, -1.0, -2.0]
    c.swap_out(())                                 # nothing to copy: nothing changes
    c.swap_in(())
    assert stored(c, 0, 0) == [0, 0, 0, 0, 1.0, 2.0]


# --- a model with three layers ------------------------------------------------------------------------
THREE = dataclasses.replace(TINY, num_hidden_layers=3)


def test_a_three_layer_model_keeps_each_layer_in_its_own_cache_rows():
    """Every layer writes its own K/V: with three layers a cache that mixed up its layer axis (or
    wrote every layer into one place) would change the tokens, and the engine must still equal the
    padded baseline under preemption."""
    model = tiny_model(THREE, seed=3)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, num_blocks=9, block_size=2,
                             preemption_mode="recompute")
    outs, eng = run_engine(model, config, prompts, params, arrivals=[0, 1, 2])
    assert [o.token_ids for o in outs] == baseline_tokens(model, prompts, params, eos=None)
    assert eng.scheduler.stats.num_preemptions > 0          # the pool was small enough to preempt


def test_the_engine_s_cache_has_one_layer_per_model_layer():
    from minicb.runtime.runner import ModelRunner

    model = tiny_model(THREE, seed=3)
    runner = ModelRunner(model, num_blocks=4, block_size=2)
    assert runner.kv_cache.num_layers == 3 == runner.kv_cache.data.shape[0]


# --- the CUDA-only branches, with CUDA faked on the CPU -----------------------------------------------
def test_lazy_zeros_on_a_gpu_asks_the_device_allocator(monkeypatch):
    """Off the CPU, lazy_zeros is a plain ``torch.zeros`` on that device (no mmap)."""
    calls = []

    def fake_zeros(shape, dtype=None, device=None):
        calls.append((tuple(shape), dtype, str(device)))
        return torch.empty(0)

    monkeypatch.setattr(host_memory.torch, "zeros", fake_zeros)
    monkeypatch.setattr(host_memory.mmap, "mmap", lambda *a, **k: pytest.fail("mmap used for a GPU pool"))
    lazy_zeros((2, 3), torch.float16, "cuda")
    assert calls == [((2, 3), torch.float16, "cuda")]


def fake_cuda(monkeypatch, free_bytes: int | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: free_bytes is not None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 2 * (free_bytes or 0)))


PER_BLOCK = 3 * 2 * 4 * 2 * 8 * 4          # layers, K/V, block_size, heads, head_dim, float32 bytes


def test_a_gpu_pool_larger_than_the_free_device_memory_is_refused(monkeypatch):
    fake_cuda(monkeypatch, free_bytes=10 * PER_BLOCK)
    monkeypatch.setattr(kv_cache, "available_cpu_bytes", lambda: 10**15)
    check_pool_memory(3, 10, 4, 2, 8, torch.float32, "cuda")                 # exactly fits
    with pytest.raises(InvalidArgument, match="on cuda"):
        check_pool_memory(3, 11, 4, 2, 8, torch.float32, "cuda")


def test_a_gpu_pool_does_not_count_against_host_memory_but_its_host_pool_does(monkeypatch):
    fake_cuda(monkeypatch, free_bytes=10**15)
    monkeypatch.setattr(kv_cache, "available_cpu_bytes", lambda: 5 * PER_BLOCK)
    check_pool_memory(3, 1000, 4, 2, 8, torch.float32, "cuda")               # device blocks: GPU memory
    check_pool_memory(3, 1000, 4, 2, 8, torch.float32, "cuda", num_host_blocks=5)
    with pytest.raises(InvalidArgument, match="in host memory"):
        check_pool_memory(3, 1000, 4, 2, 8, torch.float32, "cuda", num_host_blocks=6)
    # on the CPU the same device pool is host memory
    with pytest.raises(InvalidArgument, match="in host memory"):
        check_pool_memory(3, 6, 4, 2, 8, torch.float32, "cpu")
    check_pool_memory(3, 5, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(InvalidArgument, match="in host memory"):
        check_pool_memory(3, 3, 4, 2, 8, torch.float32, "cpu", num_host_blocks=3)


def test_without_a_usable_cuda_runtime_the_device_check_is_skipped(monkeypatch):
    fake_cuda(monkeypatch, free_bytes=None)                  # is_available() False: free memory unknown
    monkeypatch.setattr(kv_cache, "available_cpu_bytes", lambda: 10**15)
    check_pool_memory(3, 10**6, 4, 2, 8, torch.float32, "cuda")
