"""``int8_gemm``: products on int8-rounded activations and a GGUF's Q4_1 blocks, and the layer stack on them.

The kernel is checked against ``int8_gemm.reference`` (the same arithmetic in float64, from the blocks
and activations directly, not from the packed layout), every build and thread count against each
other bit for bit; the stack's steps with ``MINICB_INT8_PRODUCTS=1`` against the layers' own calls,
whose products then read the same int8 panels, bit for bit; and what the model's tokens come to
beside the bfloat16 products is a measured figure, not asserted (bench/agreement.py --modes int8).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minicb.fastpaths import int8_gemm
from minicb.fastpaths.settings import Settings
from preconditions import unavailable

SHAPES = [(1, 576, 960), (5, 64, 100), (7, 1536, 576), (300, 96, 130)]   # rows, in, out (300: two chunks)


@pytest.fixture(autouse=True)
def built():
    if int8_gemm.ckernels.why_not(int8_gemm.load):
        unavailable("no C compiler here: the int8 kernel is not built")


@pytest.mark.parametrize("rows,in_f,out_f", SHAPES)
def test_the_product_is_the_block_sums_of_the_rounded_activations(rows, in_f, out_f):
    """Each output is the float64 sum of d s (q . p) + m s sum(p) over its blocks, to one bfloat16
    rounding (and float32's of the terms, where they cancel); a zero block (its max 0) adds nothing
    and a zero row gives zeros, not NaN."""
    blocks, x = int8_gemm.random_q4_1(out_f, in_f), torch.randn(rows, in_f).to(torch.bfloat16)
    x[0, :32] = 0                                          # a block of zeros: s = 0
    y = int8_gemm.matmul(x, int8_gemm.pack(blocks), in_f, out_f).double()
    want = int8_gemm.reference(x, blocks)
    assert y.shape == (rows, out_f) and torch.isfinite(y).all()
    # one bfloat16 rounding of the output, and float32's of the terms where they cancel
    bound = want.abs() * 2.0 ** -8 + int8_gemm.reference(x, blocks, magnitudes=True) * 2.0 ** -18
    assert ((y - want).abs() <= bound).all(), ((y - want).abs() / bound).max()
    assert want.abs().min() > 0 or rows == 1                # the bound is not vacuous: outputs away from 0
    zero = int8_gemm.matmul(torch.zeros(1, in_f, dtype=torch.bfloat16), int8_gemm.pack(blocks), in_f, out_f)
    assert torch.equal(zero, torch.zeros_like(zero))


def test_the_rounding_is_the_activations_own_not_the_weights():
    """Against the product of the blocks' exact weights (d q + m) and the unrounded activations, the
    int8 product differs by what rounding x costs (the reference's float64 sums of the rounded x are
    that far off too) and then by its bfloat16 output alone."""
    blocks, x = int8_gemm.random_q4_1(256, 576, seed=3), torch.randn(16, 576).to(torch.bfloat16)
    b = torch.from_numpy(blocks)
    d, m = (b[..., k:k + 2].contiguous().view(torch.float16).double() for k in (0, 2))
    w = (torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], dim=2).double() * d + m).flatten(1)
    exact = x.double() @ w.T
    y = int8_gemm.matmul(x, int8_gemm.pack(blocks), 576, 256).double()
    want = int8_gemm.reference(x, blocks)
    rel = float((want - exact).norm() / exact.norm())       # what rounding x to 8 bits a block costs
    assert 1e-3 < rel < 2e-2, rel
    assert float((y - exact).norm() / exact.norm()) > rel / 2   # the kernel's difference is that one,
    assert float((y - want).norm() / exact.norm()) < 2.0 ** -8  # and then only its bfloat16 output


def test_every_build_and_thread_count_gives_the_same_bits():
    """The plain C loop (``-mno-avx2``: any x86 CPU), the AVX2 loop (``-mno-avx512f``, on a CPU with
    AVX2: a Zen 2's) and the default build, on 1 to 3 threads."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), ":").split(":")[1].split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    assert int8_gemm.path() == (2 if {"avx512_vnni", "avx512bw"} <= flags else 1 if avx2 else 0)
    plain = int8_gemm.load(("-mno-avx2",))
    assert int8_gemm.path(plain) == 0
    builds = [int8_gemm.load(("-mno-avx512f",))]
    assert int8_gemm.path(builds[0]) == (1 if avx2 else 0)
    for rows, in_f, out_f in [(9, 576, 3072), (64, 1536, 576)]:      # big enough to split over threads
        blocks, x = int8_gemm.random_q4_1(out_f, in_f, seed=rows), torch.randn(rows, in_f).to(torch.bfloat16)
        packed = int8_gemm.pack(blocks)
        want = int8_gemm.matmul(x, packed, in_f, out_f, lib=plain)
        for lib in builds:
            assert torch.equal(int8_gemm.matmul(x, packed, in_f, out_f, lib=lib), want)
        before = torch.get_num_threads()
        try:
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                assert torch.equal(int8_gemm.matmul(x, packed, in_f, out_f), want), n
        finally:
            torch.set_num_threads(before)


def test_an_inf_or_nan_makes_nan_and_a_tiny_block_zeros_on_every_build():
    """A block holding an inf or a NaN makes its row's outputs NaN (as bfloat16's products would), not a
    plausible number; a block whose max is under 127 / FLT_MAX (where 127 / max overflows) counts as
    zeros; the same bits from the AVX-512, AVX2 and plain C builds, and the reference agrees."""
    blocks = int8_gemm.random_q4_1(64, 96)
    packed = int8_gemm.pack(blocks)
    x = torch.randn(6, 96).to(torch.bfloat16)
    x[0, 3], x[1, 40], x[2, 64:] = float("nan"), float("inf"), -float("inf")
    x[3, :32] = 1e-37                                       # 127 / 1e-37 overflows float32
    x[4, 32:64] = -1e-37
    builds = [int8_gemm.load(f) for f in ((), ("-mno-avx512f",), ("-mno-avx2",))]
    ys = [int8_gemm.matmul(x, packed, 96, 64, lib=lib) for lib in builds]
    want = int8_gemm.reference(x, blocks)
    for y in ys:
        assert y[:3].isnan().all() and not y[3:].isnan().any()
        assert torch.equal(y[3:], ys[0][3:])
    clean = x[3:].clone()
    clean[0, :32], clean[1, 32:64] = 0, 0
    assert torch.equal(ys[0][3:], int8_gemm.matmul(clean, packed, 96, 64))     # tiny blocks: zeros
    bound = want[3:].abs() * 2.0 ** -8 + int8_gemm.reference(x[3:], blocks, magnitudes=True) * 2.0 ** -18
    assert want[:3].isnan().all() and ((ys[0][3:].double() - want[3:]).abs() <= bound).all()


def test_bad_operands_and_settings_are_refused():
    blocks = int8_gemm.random_q4_1(64, 64)
    packed = int8_gemm.pack(blocks)
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        int8_gemm.pack(np.zeros((64, 2, 34), np.uint8))                       # Q8_0
    for x, in_f in [(torch.randn(2, 64), 64), (torch.randn(2, 32).to(torch.bfloat16), 32),
                    (torch.randn(2, 48).to(torch.bfloat16), 48)]:
        with pytest.raises(ValueError, match="do not fit"):
            int8_gemm.matmul(x, packed, in_f, 64)
    with pytest.raises(ValueError, match="MINICB_INT8_PRODUCTS must be 1"):
        int8_gemm.choose(Settings.from_env({"MINICB_INT8_PRODUCTS": "yes"}))
    assert int8_gemm.choose(Settings.from_env({})) == (False, "MINICB_INT8_PRODUCTS is not 1")
    on, why = int8_gemm.choose(Settings.from_env({"MINICB_INT8_PRODUCTS": "1"}))
    assert on == (int8_gemm.path() >= 1)
    loop = int8_gemm.PATH_NAMES[int8_gemm.path()]
    assert why == f"MINICB_INT8_PRODUCTS=1 ({loop})" if on else "nor AVX2" in why


@pytest.mark.parametrize("build", [(), ("-mno-avx512f",)], ids=["default", "avx2"])
def test_every_step_of_a_sequence_multiplies_int8_rounded_activations(tmp_path, monkeypatch, build):
    """A bfloat16 model from a Q4_1 GGUF with ``MINICB_INT8_PRODUCTS=1``. Prompts on the prompt kernel,
    so that prompt steps, mixed steps and steps of more than 256 rows are stacked too: every stacked
    step reads the int8 panels, and equals the layers' own calls (whose products are then
    ``int8_gemm.matmul`` on the same panels) bit for bit; the tokens are the same on 1 and 2 threads.
    Prompts on SDPA, so that prompt steps run the layers: those multiply int8-rounded activations too
    (no layer product reaches a bfloat16 kernel; the LM head does). A weight replaced after loading
    turns the int8 products off, in the stack and in the layers. Without AVX-512 VNNI or AVX2: off,
    saying why. ``avx2``: the same with the build a CPU without AVX-512 makes (its own loop)."""
    from gguf import GGMLQuantizationType as T
    from test_layer_stack import checked_runs
    from test_loader import tiny_hf_model, write_tiny_gguf

    from helpers import random_prompts
    from minicb.core.sampling_params import SamplingParams
    from minicb.entrypoints.llm import LLM, cpu_fast_paths
    from minicb.fastpaths import layer_stack, skinny_gemm
    from minicb.model.llama import LlamaForCausalLM
    from minicb.model.weights.loader import load_model

    load = int8_gemm.load
    monkeypatch.setattr(int8_gemm, "load", lambda flags=(): load(flags or build))

    def build_model(prompts_on: str):
        for var, value in {"MINICB_SKINNY_ROWS": "4096", "MINICB_LINEAR": "onednn-f32",
                           "MINICB_INT8_PRODUCTS": "1", "MINICB_PROMPT_ATTENTION": prompts_on}.items():
            monkeypatch.setenv(var, value)
        model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.bfloat16)
        return model, cpu_fast_paths(model, "cpu", gguf_blocks=loaded.gguf_blocks)

    def engine(model, budget: int = 32, blocks: int = 64):
        return LLM(model, dtype=torch.bfloat16, max_num_seqs=5, max_num_batched_tokens=budget, block_size=4,
                   num_blocks=blocks)

    path = write_tiny_gguf(tmp_path / "q4.gguf", tiny_hf_model(tie=True),
                           types=lambda name: T.Q8_0 if "embed" in name else T.Q4_1)
    loaded = load_model(path, dtype=torch.bfloat16)
    model, applied = build_model("kernel")
    stack = model.layer_stack
    if int8_gemm.path() == 0:
        assert "int8-products" not in applied and not stack.int8 and "nor AVX2" in stack.int8_why
        return
    assert "int8-products" in applied and stack.int8 and "blocks" not in stack.products
    assert int8_gemm.path() in ((1,) if build else (1, 2))        # the build asked for runs
    for layer, tensors in zip(model.model.layers, stack.products["int8"][0]):   # one set of panels
        assert [m.int8_panels for m in layer_stack._products(layer)] == list(tensors[1:3] + tensors[4:])
    rows, tables = checked_runs(monkeypatch, model), []
    table = layer_stack.LayerStack._layer_table
    monkeypatch.setattr(layer_stack.LayerStack, "_layer_table",
                        lambda self, kv, products="bf16": tables.append(products)
                        or table(self, kv, products))
    cfg = loaded.config
    prompts = random_prompts(5, 3, 30, cfg.vocab_size, seed=7)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 8, 12, 16, 20)]
    llm = engine(model)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        outs = llm.generate(prompts, params)
        assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(sp.max_tokens, "length")
                                                                      for sp in params]
        one = [o.token_ids for o in outs]
        torch.set_num_threads(2)
        assert [o.token_ids for o in llm.generate(prompts, params)] == one
        big = engine(model, budget=512, blocks=160)         # a step of over 256 rows: two runs of rows
        big.generate(random_prompts(4, 90, 100, cfg.vocab_size, seed=8), SamplingParams(max_tokens=2))
    finally:
        torch.set_num_threads(before)
    assert set(tables) == {"int8"} and {1, 5} <= set(rows) and max(rows) > 256, (set(tables), set(rows))
    assert len(set(rows)) > 5                                 # prompt and mixed steps too, stacked

    monkeypatch.undo()                 # a fresh model, prompts on SDPA: its prompt steps not stacked
    monkeypatch.setattr(int8_gemm, "load", lambda flags=(): load(flags or build))
    model, _ = build_model("sdpa")
    calls = {"int8": 0, "bf16 out": set()}
    int8_matmul, skinny, blocks = int8_gemm.matmul, skinny_gemm.matmul, skinny_gemm.matmul_blocks
    monkeypatch.setattr(int8_gemm, "matmul", lambda *a, **k: calls.__setitem__("int8", calls["int8"] + 1)
                        or int8_matmul(*a, **k))
    for name, fn in (("matmul", skinny), ("matmul_blocks", blocks)):
        monkeypatch.setattr(skinny_gemm, name, lambda x, p, i, o, *a, fn=fn, **k: calls["bf16 out"].add(o)
                            or fn(x, p, i, o, *a, **k))
    llm = engine(model)
    llm.generate(prompts, params)
    assert calls["int8"] > 0 and calls["bf16 out"] == {cfg.vocab_size}, calls      # the LM head only
    panels = model.model.layers[1].mlp.down_proj.weight_panels
    panels.data = panels.data.clone()                        # a weight replaced after loading
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not model.layer_stack.int8
    assert model.layer_stack.int8_why == "a weight was replaced after the blocks were packed"
    assert all(m.int8_panels is None for layer in model.model.layers for m in layer_stack._products(layer))
