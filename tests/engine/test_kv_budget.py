"""``LLM()``'s defaults: the KV pool sized from memory (``kv_budget``), fast scheduler limits, and bfloat16
models loaded on a CPU without bfloat16 matmul computing their linears in float32."""

import pytest
import torch

from helpers import TINY, tiny_model
from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument
from minicb.core.kv_budget import DEFAULT_MAX_BYTES, GIB, bytes_per_block, default_budget, num_blocks_for
from minicb.entrypoints.llm import FAST_DEFAULTS, LLM
from minicb.fastpaths.cpu_linear import Float32ComputeLinear, PackedLinear, needs_float32_compute

SMOLLM2_SHAPE = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def test_bytes_per_block():
    # 30 layers x (K, V) x 16 tokens x 3 kv heads x 64 dims x 4 bytes, written out
    assert bytes_per_block(SMOLLM2_SHAPE, 16, 4) == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    assert bytes_per_block(SMOLLM2_SHAPE, 16, 2) == 368_640


def test_default_budget_is_capped_both_ways():
    assert default_budget(None) == DEFAULT_MAX_BYTES == 2 * GIB
    assert default_budget(100 * GIB) == 2 * GIB
    assert default_budget(GIB) == GIB // 4
    assert default_budget(0) == 0


def test_num_blocks():
    kw = dict(block_size=16, dtype_size=4, max_num_seqs=256, max_model_len=8192)
    assert num_blocks_for(SMOLLM2_SHAPE, kv_cache_memory_bytes=GIB, **kw) == GIB // 737_280 == 1456
    assert num_blocks_for(SMOLLM2_SHAPE, available=8 * GIB, **kw) == (2 * GIB) // 737_280
    assert num_blocks_for(SMOLLM2_SHAPE, available=1 << 20, **kw) == 1     # never zero blocks
    # never more than max_num_seqs sequences of max_model_len can use
    few = {**kw, "max_num_seqs": 2}
    assert num_blocks_for(SMOLLM2_SHAPE, kv_cache_memory_bytes=100 * GIB, **few) == 2 * 8192 // 16
    for bad in (0, -1, 1.5, "1G"):
        with pytest.raises(InvalidArgument, match="kv_cache_memory_bytes"):
            num_blocks_for(SMOLLM2_SHAPE, kv_cache_memory_bytes=bad, **kw)


def test_llm_defaults():
    model = tiny_model()
    cfg = LLM(model).engine.config
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.prefill_tokens_per_seq) == (256, 2048, 4)
    assert tuple(FAST_DEFAULTS.values()) == (256, 2048, 4)
    # stall-free batching: offline, no cap by default (serve sets one); a cap given gets 4 per sequence held;
    # 0 is no cap too; the padded policies have none
    assert cfg.max_prefill_tokens_while_decoding is None
    capped = LLM(model, max_prefill_tokens_while_decoding=8).engine.config
    assert (capped.max_prefill_tokens_while_decoding, capped.prefill_tokens_per_seq) == (8, 4)
    off = LLM(model, max_prefill_tokens_while_decoding=0).engine.config
    assert off.max_prefill_tokens_while_decoding is None
    assert LLM(model, policy="dynamic").engine.config.max_prefill_tokens_while_decoding is None
    assert cfg.num_blocks == num_blocks_for(TINY, block_size=16, dtype_size=8, max_num_seqs=256,
                                            max_model_len=cfg.max_model_len)
    # what the caller says wins; None means "the default" (the command line passes None)
    cfg = LLM(model, max_num_seqs=8, num_blocks=40, max_num_batched_tokens=None).engine.config
    assert (cfg.max_num_seqs, cfg.num_blocks, cfg.max_num_batched_tokens) == (8, 40, 2048)
    per_block = bytes_per_block(TINY, 4, 8)
    cfg = LLM(model, block_size=4, kv_cache_memory_bytes=100 * per_block + 5).engine.config
    assert (cfg.num_blocks, cfg.max_num_seqs) == (100, 100)     # default slots never exceed the pool
    assert LLM(model, num_blocks=40).engine.config.max_num_seqs == 40
    assert LLM(model, policy="static").engine.config.max_num_seqs == 16     # the padded policies keep 16
    with pytest.raises(InvalidArgument, match="kv_cache_memory_bytes"):
        LLM(model, kv_cache_memory_bytes=0)


def test_llm_generates_with_the_defaults():
    from minicb.core.sampling_params import SamplingParams

    llm = LLM(tiny_model())
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]


def test_bfloat16_model_loaded_by_llm_computes_linears_in_float32(tmp_path):
    from tiny_files import write_gguf

    llm = LLM(str(write_gguf(tmp_path / "m.gguf")), dtype="bfloat16")
    model = llm.engine.runner.model
    assert model.dtype == torch.bfloat16
    down = model.model.layers[0].mlp.down_proj       # float32 products: MKL's, or oneDNN's packed ones
    swapped = isinstance(down, Float32ComputeLinear) or (
        isinstance(down, PackedLinear) and down.compute_dtype == torch.float32)
    assert swapped == needs_float32_compute(torch.bfloat16, "cpu")
    assert not isinstance(LLM(str(tmp_path / "m.gguf")).engine.runner.model.lm_head, Float32ComputeLinear)


def test_cli_kv_cache_memory_must_be_positive(capsys):
    from minicb.entrypoints.cli import main

    assert main(["generate", "hi", "--kv-cache-memory", "-1"]) == 2
    assert "--kv-cache-memory must be a positive number of GiB" in capsys.readouterr().err


def test_a_budget_smaller_than_one_block_still_gives_one_block():
    per_block = bytes_per_block(TINY, 16, 4)
    for budget in (1, per_block - 1, per_block):
        assert num_blocks_for(TINY, block_size=16, dtype_size=4, max_num_seqs=4, max_model_len=64,
                              kv_cache_memory_bytes=budget) == 1
    assert num_blocks_for(TINY, block_size=16, dtype_size=4, max_num_seqs=4, max_model_len=64,
                          kv_cache_memory_bytes=2 * per_block) == 2


def test_the_gib_flag_must_be_positive():
    from minicb.core.kv_budget import gib_flag

    assert gib_flag(None) is None and gib_flag(0.5) == GIB // 2 and gib_flag(1e-9) == int(1e-9 * GIB)
    for bad in (0, 0.0, -1, float("nan")):
        with pytest.raises(InvalidArgument, match="--kv-cache-memory must be a positive"):
            gib_flag(bad)
