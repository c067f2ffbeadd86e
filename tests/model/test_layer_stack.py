"""``layer_stack``: every decoder layer of a step in one C call computes what the layers compute.

Checked from outside the stack: every step it takes is also run through the layers' own calls (on a
copy of the step's input, before the stack: both write the same K/V to the same slots), and the two
final hidden states must be equal bit for bit, in float32 and bfloat16, with prompts on SDPA (so
its prompt steps fall back to the layers) and on the kernel (every step stacked), with preemption
and prefix caching. Then the engine's tokens with the stack against without it, and the cases where
it must stand aside.
"""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import random_prompts
from minicb.core.config import ModelConfig
from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM, cpu_fast_paths
from minicb.fastpaths import cpu_paged, layer_stack
from minicb.model.llama import LlamaForCausalLM
from preconditions import unavailable

# head_dim 64: the decode kernel's fast rows (AVX-512 or AVX2) where the CPU has them
CFG = ModelConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=64, rope_theta=10000.0,
                  max_position_embeddings=4096, eos_token_id=3)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def paths(monkeypatch):
    """The packed products on the skinny kernel for every step, whatever this CPU would choose."""
    if cpu_paged.unavailable_reason() or layer_stack.unavailable_reason():
        unavailable("no C compiler here: the stack and the kernels it calls are not built")
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "4096")
    monkeypatch.setenv("MINICB_LINEAR", "onednn-f32")
    monkeypatch.delenv("MINICB_LAYER_STACK", raising=False)


def stacked(dtype, seed: int = 1) -> LlamaForCausalLM:
    model = LlamaForCausalLM.random(CFG, seed=seed, dtype=dtype, std=0.3)
    assert "layer-stack" in cpu_fast_paths(model, "cpu")
    assert isinstance(model, layer_stack.StackedLlama)
    return model


def checked_runs(monkeypatch, model) -> list[int]:
    """Make every stacked step also run the layers one by one first and compare; the rows of each."""
    rows = []
    run = layer_stack.LayerStack.run

    def both(self, x, cos, sin, backend, state):
        y = x.clone()
        for i, layer in enumerate(model.model.layers):
            y = layer(y, cos, sin, i, backend, state)
        want = model.model.norm(y)
        got = run(self, x, cos, sin, backend, state)
        assert torch.equal(got, want), (x.shape, (got.float() - want.float()).abs().max())
        assert torch.equal(x, y)                       # the residual stream, updated in place
        rows.append(x.shape[0])
        return got

    monkeypatch.setattr(layer_stack.LayerStack, "run", both)
    return rows


@pytest.mark.parametrize("prompts_on", ["sdpa", "kernel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_stacked_step_equals_the_layers_bit_for_bit(dtype, prompts_on, monkeypatch):
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", prompts_on)
    model = stacked(dtype)
    rows = checked_runs(monkeypatch, model)
    prompts = random_prompts(10, 3, 60, CFG.vocab_size, seed=3)
    prompts += [prompts[0] + [5, 6, 7]]                   # a cached prefix: a chunk that starts mid-sequence
    llm = LLM(model, dtype=dtype, max_num_seqs=6, max_num_batched_tokens=48, block_size=4, num_blocks=40,
              enable_prefix_caching=True)                 # few blocks: preemption
    out = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert all(len(o.token_ids) == 24 for o in out)
    stats = llm.engine.stats
    cached = stats.num_cached_prompt_tokens + stats.num_cached_reprefill_tokens
    assert stats.num_preemptions > 0 and cached > 0, stats
    assert len(rows) > 20 and max(rows) > 1
    if prompts_on == "kernel":              # every step is kernel rows: prompt chunks stacked too
        assert max(rows) > 6 and len(rows) == stats.num_steps, (max(rows), len(rows), stats.num_steps)
    else:                                   # prompt chunks go to SDPA: those steps run the layers
        assert max(rows) <= 6 and len(rows) < stats.num_steps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_threads_give_the_same_bits_as_one(dtype, monkeypatch):
    """The stack is one parallel region whose threads split the products' panels and the other parts'
    rows: every stacked step (one-row decodes and prompt chunks on the kernel, more rows than
    threads and fewer) is run on 1 thread, then on 2 and 3 from the same input, and all agree bit for
    bit (each writes the same K/V to the same slots). Then on 2 threads of a build whose second thread
    never comes (``-DTEAM_ABSENT_THREADS``): the first takes every item, as a running thread takes a
    descheduled one's (``team_queue.h``), and the bits are the same. (A barrier would wait forever.)
    And on 2 and 3 threads of a build whose products' items take 5 rows each (``-DPRODUCT_ROWS=5``;
    256 otherwise, more than these steps have): each share of the panels cut into runs of rows, the
    last one short, gives the same bits too. Every run gets buffers full of NaN and finds the step's
    K/V slots set to NaN, so a build that leaves a row or a slot unwritten fails, rather than pass on
    what the run before left there."""
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", "kernel")
    model = stacked(dtype)
    run, rows = layer_stack.LayerStack.run, []
    before, empty, full = torch.get_num_threads(), torch.empty, torch.full

    normal, absent = layer_stack.load(), layer_stack.load(("-DTEAM_ABSENT_THREADS",))
    short_runs = layer_stack.load(("-DPRODUCT_ROWS=5",))

    def poisoned(*size, dtype=None, **kw):           # a buffer the stack fails to write stays NaN
        return full(size[0] if len(size) == 1 and not isinstance(size[0], int) else size, float("nan"),
                    dtype=dtype, **kw)

    def on_threads(self, x, cos, sin, backend, state):
        results, stored = [], state.slot_mapping[state.slot_mapping >= 0]
        try:
            for threads, self.lib in ((1, normal), (2, normal), (3, normal), (2, absent), (2, short_runs),
                                      (3, short_runs)):
                torch.set_num_threads(threads)
                for i in range(len(self.tensors)):       # this step's K/V slots, which it must write
                    for cache in backend.kv_cache.layer(i):
                        cache[stored] = float("nan")
                y = x.clone()
                monkeypatch.setattr(torch, "empty", poisoned)
                try:
                    results.append((run(self, y, cos, sin, backend, state).clone(), y))
                finally:
                    monkeypatch.setattr(torch, "empty", empty)
        finally:
            torch.set_num_threads(before)
            self.lib = normal
        for got, residual in results[1:]:
            assert torch.equal(got, results[0][0]) and torch.equal(residual, results[0][1]), x.shape
        rows.append(x.shape[0])
        x.copy_(results[0][1])
        return results[0][0]

    monkeypatch.setattr(layer_stack.LayerStack, "run", on_threads)
    llm = LLM(model, dtype=dtype, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=64)
    llm.generate(random_prompts(5, 3, 40, CFG.vocab_size, seed=6),
                 SamplingParams(max_tokens=12, ignore_eos=True))
    assert 1 in rows and max(rows) > 3, rows        # single rows (threads idle) and rows split three ways
    assert any(r > 5 and r % 5 for r in rows), rows  # runs of 5 rows and a short last one


# prompts on SDPA: their steps fall back to the layers (StackedLlama.hidden's other branch)
@pytest.mark.parametrize("prompts_on", ["sdpa", "kernel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tokens_with_and_without_the_stack_are_the_same(dtype, prompts_on, monkeypatch):
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", prompts_on)
    prompts = random_prompts(12, 2, 50, CFG.vocab_size, seed=9)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("MINICB_LAYER_STACK", on)
        model = LlamaForCausalLM.random(CFG, seed=2, dtype=dtype, std=0.3)
        assert ("layer-stack" in cpu_fast_paths(model, "cpu")) == (on == "1")
        llm = LLM(model, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=64, block_size=16, num_blocks=64)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]


def test_the_stack_stands_aside_where_it_does_not_apply(monkeypatch):
    model = stacked(torch.float32)
    rows = checked_runs(monkeypatch, model)
    # more rows than the skinny kernel takes: the layers' own calls (their oneDNN products); the
    # last steps, of one sequence, are stacked
    model.layer_stack.skinny_rows = 1
    LLM(model, max_num_seqs=4, block_size=4, num_blocks=64).generate(
        random_prompts(3, 4, 9, CFG.vocab_size, seed=4),
        [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 4, 9)])
    assert rows == [1] * 5
    # another backend: the reference's attention, no kernel rows
    rows.clear()
    LLM(model, attn_backend="reference", max_num_seqs=4, block_size=4, num_blocks=64).generate(
        random_prompts(2, 4, 9, CFG.vocab_size, seed=5), SamplingParams(max_tokens=5, ignore_eos=True))
    assert rows == []


def test_which_models_get_the_stack(monkeypatch):
    plain = LlamaForCausalLM.random(CFG, seed=3, dtype=torch.float32)
    assert layer_stack.install(copy.deepcopy(plain)) == "the final norm is not fused"
    monkeypatch.setenv("MINICB_LAYER_STACK", "0")
    assert "layer-stack" not in cpu_fast_paths(copy.deepcopy(plain), "cpu")
    monkeypatch.setenv("MINICB_LAYER_STACK", "1")
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "0")          # no skinny panels: nothing for the stack to call
    model = copy.deepcopy(plain)
    assert "layer-stack" not in cpu_fast_paths(model, "cpu")
    assert layer_stack.install(model) == "layer 0 has no skinny panels"
    assert type(model) is LlamaForCausalLM
    f64 = LlamaForCausalLM.random(CFG, seed=3, dtype=torch.float64)
    assert "layer-stack" not in cpu_fast_paths(f64, "cpu") and type(f64) is LlamaForCausalLM


def test_steps_of_few_rows_read_the_ggufs_blocks_and_give_the_same_bits(tmp_path, monkeypatch):
    """A bfloat16 model loaded from a GGUF of SmolLM2's formats (the layers' weights Q4_1, their Q and K
    rows permuted by the writer and un-permuted by the loader, blocks and all; the tied embedding Q8_0):
    its stacked steps of up to ``MINICB_BLOCK_ROWS`` rows read the blocks (``skinny_gemm.pack_blocks``),
    the others the bfloat16 panels, and every stacked step equals the layers' own calls on the
    bfloat16 panels bit for bit; so do the LM head's products from its Q8_0 blocks. Blocks that do not
    stand for the model's weights are refused, and so is a model of another dtype."""
    from gguf import GGMLQuantizationType as T
    from test_loader import tiny_hf_model, write_tiny_gguf

    from minicb.fastpaths import skinny_gemm
    from minicb.model.weights.loader import load_model

    path = write_tiny_gguf(tmp_path / "blocks.gguf", tiny_hf_model(tie=True),
                           types=lambda name: T.Q8_0 if "embed" in name else T.Q4_1)
    monkeypatch.setenv("MINICB_BLOCK_ROWS", "3")
    loaded = load_model(path, dtype=torch.bfloat16)
    assert sorted({b.shape[2] for b in loaded.gguf_blocks.values()}) == [20, 34]
    assert len(loaded.gguf_blocks) == 2 * 7 + 1               # every 2-D weight: 7 a layer, the embedding

    def build(blocks):
        model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.bfloat16)
        return model, cpu_fast_paths(model, "cpu", gguf_blocks=blocks)

    model, applied = build(loaded.gguf_blocks)
    if skinny_gemm.path(torch.bfloat16) != 2:                 # no AVX-512 BF16: the panels, even pinned
        assert model.layer_stack.block_rows == model.lm_head.block_rows == 0
        assert model.layer_stack.block_why == "the blocks' loop needs AVX-512 BF16"
        return
    assert "gguf-blocks-3-rows" in applied and model.layer_stack.block_rows == model.lm_head.block_rows == 3
    x = torch.randn(3, loaded.config.hidden_size).to(torch.bfloat16)
    logits = model.lm_head(x)                                  # from the Q8_0 blocks
    model.lm_head.block_rows = 0
    assert torch.equal(logits, model.lm_head(x))               # from the bfloat16 panels
    model.lm_head.block_rows = 3
    rows, tables = checked_runs(monkeypatch, model), []
    table = layer_stack.LayerStack._layer_table
    monkeypatch.setattr(layer_stack.LayerStack, "_layer_table",
                        lambda self, kv, products="bf16": tables.append(products == "blocks")
                        or table(self, kv, products))
    llm = LLM(model, dtype=torch.bfloat16, max_num_seqs=5, max_num_batched_tokens=32, block_size=4,
              num_blocks=64)
    llm.generate(random_prompts(5, 3, 30, loaded.config.vocab_size, seed=7),
                 [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 8, 12, 16, 20)])
    assert tables == [r <= 3 for r in rows] and {1, 2, 3} <= set(rows) and max(rows) > 3, rows
    # a prompt longer than a step's budget: its first steps ask the LM head for no row at all
    out = llm.generate([list(range(5, 75))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 3
    # a weight replaced after loading (new storage, here the same values): the blocks would be the
    # old weight's, so they are dropped at the next step that would read them
    panels = model.model.layers[1].mlp.down_proj.weight_panels
    panels.data = panels.data.clone()
    del tables[:], rows[:]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert model.layer_stack.block_rows == model.lm_head.block_rows == 0 and rows and not any(tables)
    assert model.layer_stack.block_why == "a weight was replaced after the blocks were packed"
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "2")              # the LM head: no more rows than its panels'
    assert build(loaded.gguf_blocks)[0].lm_head.block_rows == 2
    monkeypatch.setenv("MINICB_SKINNY_ROWS", "4096")

    other = dict(loaded.gguf_blocks)
    name = "model.layers.1.mlp.down_proj.weight"
    other[name] = other[name].copy()
    other[name][5, 1, 7] ^= 0x10                             # one weight's 4 bits, changed
    model, applied = build(other)
    assert not any(a.startswith("gguf-blocks") for a in applied)
    assert model.layer_stack.block_why == f"{name}'s blocks are not its bfloat16 weights"
    assert model.lm_head.block_rows == 0
    del other[name]
    assert build(other)[0].layer_stack.block_why == f"{name} has no blocks of one kind"
    mixed = load_model(write_tiny_gguf(tmp_path / "mixed.gguf", tiny_hf_model(tie=True),
                                       types=lambda n: T.Q8_0 if "embed" in n or n == name else T.Q4_1),
                       dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_state_dict(mixed.config, mixed.state_dict, torch.bfloat16)
    cpu_fast_paths(model, "cpu", gguf_blocks=mixed.gguf_blocks)
    assert model.layer_stack.block_why == "the layers' blocks are of more than one kind"
    f32 = LlamaForCausalLM.from_state_dict(loaded.config, load_model(path).state_dict, torch.float32)
    cpu_fast_paths(f32, "cpu", gguf_blocks=loaded.gguf_blocks)
    assert f32.layer_stack.block_rows == 0 and load_model(path).gguf_blocks == {}
