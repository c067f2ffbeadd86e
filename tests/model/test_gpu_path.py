"""The GPU path, checked on the CPU: kernel inputs, the causal convention, backend selection, and the
flash-attn / torch-varlen backends' preparation against the reference backend.

The varlen kernels themselves need CUDA; here ``tests/varlen_standin.py`` stands in for them (an
explicit per-sequence bottom-right-causal attention with the kernels' signatures that also checks the
inputs as the kernels require). Everything else the backends do (writing the cache, gathering K/V
from pages, the int32 offsets, the block table, padding rows) is the real code. The tests that run
the real kernels are at the end and are skipped, with the reason, where there is no CUDA device.
"""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import minicb.model.backends as registry
import minicb.runtime.runner
from backend_checking import random_inputs, random_plan, relative_error, run_backend
from helpers import TINY, baseline_tokens, run_engine, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.core.sampling_params import SamplingParams
from minicb.fastpaths import cpu_paged
from minicb.fastpaths.backends import make_backend, resolve_backend, unavailable_reasons
from minicb.model.attention import ReferenceAttention
from minicb.model.backends.flash import FlashAttnBackend
from minicb.model.backends.torch_varlen import TorchVarlenBackend
from minicb.model.backends.varlen import build_varlen_plan, gather_key_slots
from minicb.model.kv_cache import KVCache
from minicb.runtime.packer import pack
from varlen_standin import (
    FlashAttnStandIn,
    OldTorchVarlenStandIn,
    TorchVarlenStandIn,
    explicit_varlen_attention,
)

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False on this machine)"


def mixed_plan(padding=()) -> StepPlan:
    """A 3-token prompt, a decode after 9 cached tokens, a 2-token chunk after 4: the packer's example."""
    return StepPlan(0, (ScheduledSeq("a", 0, (5, 6, 7), 0, (3,), True),
                        ScheduledSeq("b", 1, (8,), 9, (0, 5, 2), True),
                        ScheduledSeq("c", 2, (9, 10), 4, (4, 1), False)), padding=padding, block_size=4)


# --- what the packer hands the kernels ---------------------------------------------------------------
def test_packer_emits_int32_offsets_and_contiguous_tensors():
    b = pack(mixed_plan(padding=(2,)))
    m = b.attn
    assert m.cu_seqlens_q.tolist() == [0, 3, 4, 6, 8]
    assert m.cu_seqlens_k.tolist() == [0, 3, 13, 19, 21]        # cumulative context lengths
    assert m.context_lens.tolist() == [3, 10, 6, 2]
    assert (m.max_seqlen_q, m.max_seqlen_k) == (3, 10)
    assert type(m.max_seqlen_q) is int and type(m.max_seqlen_k) is int
    assert m.block_tables.tolist() == [[3, 0, 0], [0, 5, 2], [4, 1, 0], [0, 0, 0]]
    assert m.slot_mapping.tolist() == [12, 13, 14, 9, 4, 5, -1, -1]
    for t, dtype in ((m.cu_seqlens_q, torch.int32), (m.cu_seqlens_k, torch.int32),
                     (m.context_lens, torch.int32), (m.block_tables, torch.int32),
                     (m.slot_mapping, torch.int64), (m.start_pos, torch.int64),
                     (b.input_ids, torch.int64), (b.positions, torch.int64)):
        assert t.dtype == dtype and t.is_contiguous()


def test_varlen_plan_inputs():
    meta = pack(mixed_plan(padding=(2, 1))).attn
    gather = build_varlen_plan(meta, has_cache=True, mode="gather")
    assert gather.num_seqs == 3 and gather.num_cached_tokens == 6
    assert gather.cu_seqlens_q.tolist() == [0, 3, 4, 6] and gather.cu_seqlens_k.tolist() == [0, 3, 13, 19]
    assert (gather.max_seqlen_q, gather.max_seqlen_k) == (3, 10)
    assert gather.seqused_k.tolist() == [3, 10, 6]
    assert gather.pad_cu_seqlens.tolist() == [0, 2, 3] and gather.pad_max_seqlen == 2
    # a: block 3 -> slots 12..14; b: blocks 0, 5, 2 -> 0..3, 20..23, 8, 9; c: blocks 4, 1 -> 16..19, 4, 5
    assert gather.key_slots.tolist() == [12, 13, 14, 0, 1, 2, 3, 20, 21, 22, 23, 8, 9, 16, 17, 18, 19, 4, 5]
    assert gather.block_table is None
    paged = build_varlen_plan(meta, has_cache=True, mode="paged")
    assert paged.key_slots is None and paged.block_table.tolist() == [[3, 0, 0], [0, 5, 2], [4, 1, 0]]
    for t in (gather.cu_seqlens_q, gather.cu_seqlens_k, gather.seqused_k, gather.pad_cu_seqlens,
              paged.block_table):
        assert t.dtype == torch.int32 and t.is_contiguous()
    no_cache = build_varlen_plan(meta, has_cache=False)
    assert no_cache.num_seqs == 0 and no_cache.pad_cu_seqlens.tolist() == [0, 3, 4, 6, 8, 9]
    with pytest.raises(ValueError, match="mode"):
        build_varlen_plan(meta, True, mode="scatter")


@pytest.mark.parametrize("seed", range(6))
def test_gather_key_slots_equal_a_loop(seed):
    plan, _ = random_plan(seed, block_size=[1, 4, 16][seed % 3], num_padding=seed % 2)
    meta = pack(plan).attn
    expected = [s.block_table[j // plan.block_size] * plan.block_size + j % plan.block_size
                for s in plan.seqs for j in range(s.context_len)]
    assert gather_key_slots(meta, len(plan.seqs)).tolist() == expected


# --- the causal convention -----------------------------------------------------------------------------
def test_sdpa_is_causal_is_top_left_and_the_reference_is_bottom_right():
    """3 new queries after 4 cached tokens: query i sits at position 4 + i and must see keys 0..4 + i.
    SDPA's ``is_causal=True`` aligns the mask top-left (query i sees keys 0..i), which would hide
    most of the cache from a prefill chunk; the reference backend and the varlen kernels align it
    bottom-right."""
    g = torch.Generator().manual_seed(0)
    lq, lk, h, d = 3, 7, 2, 8
    q = torch.randn(lq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(lk, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(lk, h, d, generator=g, dtype=torch.float64)

    def masked(mask):
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask).transpose(0, 1)

    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    top_left, bottom_right = masked(j <= i), masked(j <= i + lk - lq)
    sdpa_causal = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True).transpose(0, 1)
    assert torch.allclose(sdpa_causal, top_left, atol=1e-12)
    assert not torch.allclose(sdpa_causal, bottom_right, atol=1e-3)
    cu_q, cu_k = torch.tensor([0, lq], dtype=torch.int32), torch.tensor([0, lk], dtype=torch.int32)
    assert torch.allclose(explicit_varlen_attention(q, k, v, cu_q, cu_k), bottom_right, atol=1e-12)

    # the reference backend on the same numbers: the 4 older keys in the cache, the 3 new ones appended
    kv = KVCache(1, 2, 4, h, d, torch.float64)
    kv.write(0, k[:4], v[:4], torch.tensor([4, 5, 6, 7]))                   # block 1 holds positions 0..3
    plan = StepPlan(0, (ScheduledSeq("x", 0, (1, 2, 3), 4, (1, 0), True),), block_size=4)
    backend = ReferenceAttention(kv)
    out = backend.attend(0, q, k[4:], v[4:], backend.prepare(pack(plan).attn))
    assert torch.allclose(out, bottom_right, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_reference_backend_equals_per_sequence_explicit_attention(seed):
    plan, nb = random_plan(seed, block_size=4, num_padding=seed % 2)
    inp = random_inputs(plan, nb, heads=6, kv_heads=2, head_dim=8, seed=seed)
    out, kv = run_backend(ReferenceAttention, inp, torch.float64, "cpu")
    # the explicit computation, one sequence at a time, from the (now complete) cache
    kc, vc = kv.layer(0)
    meta = pack(plan).attn
    slots = gather_key_slots(meta, len(plan.seqs))
    r = len(plan.seqs)
    n = meta.cu_seqlens_q[r]
    expected = explicit_varlen_attention(inp.q[:n], kc[slots], vc[slots], meta.cu_seqlens_q[: r + 1],
                                         meta.cu_seqlens_k[: r + 1])
    assert relative_error(out[:n], expected) < 1e-12
    if plan.padding:   # padding rows attend to their own tokens only
        cu = meta.cu_seqlens_q[r:] - meta.cu_seqlens_q[r]
        exp_pad = explicit_varlen_attention(inp.q[n:], inp.k[n:], inp.v[n:], cu, cu)
        assert relative_error(out[n:], exp_pad) < 1e-12


# --- the varlen backends with CPU stand-ins for the kernels -------------------------------------------
BACKENDS = {
    "flash-attn": lambda kv, paged: FlashAttnBackend(kv, FlashAttnStandIn(), paged),
    "torch-varlen": lambda kv, paged: TorchVarlenBackend(kv, TorchVarlenStandIn(), paged),
    "torch-varlen-old": lambda kv, paged: TorchVarlenBackend(kv, OldTorchVarlenStandIn(), paged),
}


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("name,paged", [("flash-attn", False), ("flash-attn", True), ("torch-varlen", False),
                                        ("torch-varlen", True), ("torch-varlen-old", False)])
def test_varlen_backend_equals_reference(name, paged, heads):
    made = []

    def factory(kv):
        made.append(BACKENDS[name](kv, paged))
        return made[-1]

    for seed in range(3):
        plan, nb = random_plan(seed, block_size=[4, 16, 1][seed], num_padding=seed % 2)
        inp = random_inputs(plan, nb, heads=heads[0], kv_heads=heads[1], head_dim=8, seed=seed)
        ref, ref_kv = run_backend(ReferenceAttention, inp, torch.float64, "cpu")
        out, kv = run_backend(factory, inp, torch.float64, "cpu")
        assert relative_error(out, ref) < 1e-12
        assert torch.equal(kv.data, ref_kv.data)             # the same K/V written to the same slots
        backend = made[-1]
        assert backend.mode == ("paged" if paged else "gather")
        calls = backend.kernel.calls
        assert len(calls) == 1 + bool(plan.padding)          # one call for the cached rows (+ padding)
        assert calls[0]["paged"] == paged
        if plan.padding:
            assert not calls[-1]["paged"]


def test_paged_mode_is_automatic_for_blocks_of_256():
    kv256, kv16 = KVCache(1, 2, 256, 2, 8), KVCache(1, 2, 16, 2, 8)
    assert FlashAttnBackend(kv256, FlashAttnStandIn()).mode == "paged"
    assert FlashAttnBackend(kv16, FlashAttnStandIn()).mode == "gather"
    assert TorchVarlenBackend(kv256, TorchVarlenStandIn()).mode == "paged"
    assert TorchVarlenBackend(kv256, OldTorchVarlenStandIn()).mode == "gather"   # no block_table there
    assert FlashAttnBackend(None, FlashAttnStandIn()).mode == "gather"
    with pytest.raises(ValueError, match="KV cache"):
        FlashAttnBackend(None, FlashAttnStandIn(), paged=True)
    with pytest.raises(ValueError, match="cannot read a paged cache"):
        TorchVarlenBackend(kv256, OldTorchVarlenStandIn(), paged=True)


def test_varlen_backend_without_cache_equals_flat_reference():
    """``kv_cache=None`` (whole prompts, nothing cached): every row attends to its own tokens."""
    from minicb.model.llama import LlamaForCausalLM
    from minicb.runtime.packer import pack_prompts

    model = LlamaForCausalLM.random(TINY, seed=3)
    b = pack_prompts([[5, 6, 7, 8], [9], [10, 11, 12]])
    ref = model(b.input_ids, b.positions, ReferenceAttention(None), b.attn, b.logits_indices)
    out = model(b.input_ids, b.positions, FlashAttnBackend(None, FlashAttnStandIn()), b.attn,
                b.logits_indices)
    assert relative_error(out, ref) < 1e-12


@pytest.mark.parametrize("case", [
    dict(policy="continuous", mode="recompute", block_size=4, paged=False),
    dict(policy="continuous", mode="swap", block_size=4, paged=True),
    dict(policy="static", mode="recompute", block_size=4, paged=False),     # padding rows
    dict(policy="dynamic", mode="recompute", block_size=256, paged=None),   # paged by block size
])
def test_engine_with_standin_kernel_is_token_exact(monkeypatch, case):
    """The whole engine on the flash-attn backend (stand-in kernel): chunked prefill, preemption, padding
    rows; every request gets the padded baseline's tokens (float64)."""
    backends = []

    def make(name, kv_cache, device=None, paged=None):
        backends.append(FlashAttnBackend(kv_cache, FlashAttnStandIn(), case["paged"]))
        return backends[-1]

    monkeypatch.setattr(minicb.runtime.runner, "_reference_backend", make)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 61, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (8,))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    bs = case["block_size"]
    small = bs == 4
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24 if small else 512, block_size=bs,
                          num_blocks=16 if small else 8, num_host_blocks=8 if case["mode"] == "swap" else 0,
                          policy=case["policy"], preemption_mode=case["mode"])
    model = tiny_model()
    outs, eng = run_engine(model, cfg, prompts, params, [i // 2 for i in range(8)], fast_paths=False)
    assert [o.token_ids for o in outs] == baseline_tokens(model, prompts, params, None)
    assert backends[0].mode == ("paged" if case["paged"] or bs == 256 else "gather")
    assert backends[0].kernel.calls
    if small and case["policy"] == "continuous":
        assert eng.scheduler.stats.num_preemptions > 0


# --- selection ------------------------------------------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend: CUDA present (compute capability 9.0), flash-attn installed, torch has varlen_attn."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = FlashAttnStandIn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(registry, "torch_varlen_kernel", lambda: TorchVarlenStandIn())
    return monkeypatch


def no_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)     # ``import flash_attn`` raises ImportError


CUDA_DEV = torch.device("cuda")
# what ``auto`` picks on the CPU: the C decode kernel where the machine's compiler builds it
CPU_AUTO = "cpu-paged" if cpu_paged.unavailable_reason() is None else "reference"


def test_auto_prefers_flash_attn_then_torch_varlen_then_reference(fake_gpu):
    bf16 = torch.bfloat16
    assert resolve_backend("auto", CUDA_DEV, bf16, 64) == "flash-attn"
    assert resolve_backend("auto", CUDA_DEV, torch.float16, 128) == "flash-attn"
    no_flash_attn(fake_gpu)
    assert resolve_backend("auto", CUDA_DEV, bf16, 64) == "torch-varlen"
    fake_gpu.setattr(registry, "torch_varlen_kernel", lambda: None)
    assert resolve_backend("auto", CUDA_DEV, bf16, 64) == "reference"


def test_auto_takes_reference_where_the_kernels_cannot_run(fake_gpu):
    assert resolve_backend("auto", CUDA_DEV, torch.float32, 64) == "reference"     # dtype
    assert resolve_backend("auto", CUDA_DEV, torch.float64, 64) == "reference"
    assert resolve_backend("auto", "cpu", torch.bfloat16, 64) == CPU_AUTO            # device
    assert resolve_backend("auto", CUDA_DEV, torch.bfloat16, 512) == "reference"   # head_dim
    fake_gpu.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert resolve_backend("auto", CUDA_DEV, torch.bfloat16, 64) == "reference"    # Turing


def test_unavailable_backend_is_a_clear_error_here():
    """On this machine as it is (the CPU wheel of torch; flash-attn absent unless installed)."""
    assert resolve_backend("auto", "cpu", torch.float32, 64) == CPU_AUTO
    assert resolve_backend("reference", "cpu", torch.float64, 64) == "reference"
    for name in ("flash-attn", "torch-varlen"):
        with pytest.raises(InvalidArgument) as e:
            resolve_backend(name, "cpu", torch.bfloat16, 64)
        msg = str(e.value)
        assert f"'{name}'" in msg and "unavailable" in msg
        if not CUDA:
            assert "no CUDA" in msg


def test_error_messages_name_every_reason(fake_gpu):
    no_flash_attn(fake_gpu)
    fake_gpu.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidArgument) as e:
        resolve_backend("flash-attn", CUDA_DEV, torch.float32, 64)
    msg = str(e.value)
    assert "'flash-attn'" in msg and "flash_attn package is not installed" in msg and "no CUDA" in msg
    assert "float32" in msg and "bfloat16" in msg
    fake_gpu.setattr(torch.cuda, "is_available", lambda: True)
    assert unavailable_reasons("torch-varlen", "cpu", torch.bfloat16, 64) == [
        "the model is on cpu, not on a CUDA device (use device='cuda')"]
    assert "head_dim" in unavailable_reasons("torch-varlen", CUDA_DEV, torch.bfloat16, 260)[0]
    fake_gpu.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "compute capability 7.5" in unavailable_reasons("torch-varlen", CUDA_DEV, torch.float16, 64)[0]
    with pytest.raises(InvalidArgument, match="attn_backend must be one of .*'reference'.*'flash9'"):
        resolve_backend("flash9", CUDA_DEV, torch.float16, 64)


def test_torch_without_varlen_attn(monkeypatch):
    import torch.nn.attention.varlen as tv

    monkeypatch.delattr(tv, "varlen_attn")
    assert registry.torch_varlen_kernel() is None
    msg = "; ".join(unavailable_reasons("torch-varlen", "cpu", torch.bfloat16, 64))
    assert f"torch {torch.__version__} lacks torch.nn.attention.varlen.varlen_attn" in msg


def test_make_backend_builds_what_resolve_picks(fake_gpu):
    kv = KVCache(1, 4, 16, 2, 8, torch.bfloat16)
    assert isinstance(make_backend("auto", kv), ReferenceAttention)       # the cache is on the CPU
    built = make_backend("flash-attn", kv, device=CUDA_DEV)               # pretend it is on the GPU
    assert isinstance(built, FlashAttnBackend)
    assert built.kernel is sys.modules["flash_attn"].flash_attn_varlen_func
    built = make_backend("torch-varlen", kv, device=CUDA_DEV)
    assert isinstance(built, TorchVarlenBackend) and built.mode == "gather"
    with pytest.raises(InvalidArgument, match="'flash-attn' is unavailable here: the model is on cpu"):
        make_backend("flash-attn", kv)


def test_llm_and_cli_report_unavailable_backends(capsys):
    from minicb.entrypoints.cli import main
    from minicb.entrypoints.llm import LLM

    with pytest.raises(InvalidArgument, match="attn_backend 'flash-attn' is unavailable"):
        LLM(tiny_model(), attn_backend="flash-attn")
    assert LLM(tiny_model(), attn_backend="reference").engine.runner.backend.name == "reference"
    assert LLM(tiny_model()).engine.runner.backend.name == CPU_AUTO     # the model is on the CPU
    if not CUDA:
        with pytest.raises(InvalidArgument, match="device 'cuda' needs CUDA"):
            LLM(tiny_model(), device="cuda")
        assert main(["generate", "hi", "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("minicb: error: device 'cuda' needs CUDA") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--attn-backend", "flash9"])
    assert "invalid choice: 'flash9'" in capsys.readouterr().err


# --- bench/gpu_check.py ---------------------------------------------------------------------------------
def test_gpu_check_dry_run_on_cpu(tmp_path):
    """The GPU script's CPU-possible parts at tiny sizes: it runs, passes, and prints one table."""
    import json

    report = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-dry-run",
                           "--json", str(report)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("== summary") == 1 and "0 FAIL" in out
    rows = json.loads(report.read_text())["rows"]
    by = {(r["part"][0], r["check"]): r for r in rows}
    assert all(r["status"] != "FAIL" for r in rows)
    assert by["1", "reference float32 block 16"]["status"] == "PASS"
    flash = by["1", "flash-attn bfloat16"]
    assert flash["status"] == "SKIP" and ("no CUDA" in flash["detail"] or CUDA)
    assert by["2", "float64 reference block 16"]["detail"].startswith("4/4 identical")
    for policy in ("continuous", "dynamic", "static"):
        assert "tokens/s" in by["3", f"minicb {policy} ({CPU_AUTO})"]["detail"]
    assert by["3", "hf generate_batch"]["status"] == "SKIP"


def test_first_divergence_margin():
    gpu_check = _import_gpu_check()
    model = tiny_model()
    prompt = [5, 6, 7]
    assert gpu_check.first_divergence_margin(model, prompt, [1, 2, 3], [1, 2, 3]) is None
    i, gap = gpu_check.first_divergence_margin(model, prompt, [9, 10, 11], [9, 12, 11])
    from minicb.runtime.packer import pack_prompts

    flat = pack_prompts([prompt + [9]])
    logits = model(flat.input_ids, flat.positions, ReferenceAttention(None), flat.attn)[-1]
    # load-independent: a gap between logits, not a time
    assert i == 1 and gap == pytest.approx(float((logits[10] - logits[12]).abs()), rel=1e-12)
    i, _ = gpu_check.first_divergence_margin(model, prompt, [9, 10], [9, 10, 11])   # one stopped at EOS
    assert i == 2


def _import_gpu_check():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_check


def test_gpu_check_prompts_are_the_smollm2_test_prompts():
    gpu_check = _import_gpu_check()
    from test_smollm2 import NEW_TOKENS, PROMPTS

    assert tuple(gpu_check.PROMPTS) == tuple(PROMPTS) and gpu_check.NEW_TOKENS == NEW_TOKENS


# --- the real kernels (a CUDA device is a real precondition) -------------------------------------------
def _kernel_backends():
    return [n for n in ("flash-attn", "torch-varlen")
            if CUDA and not unavailable_reasons(n, "cuda", torch.bfloat16, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_real_kernels_match_float64_reference(dtype, bound, block_size):
    names = _kernel_backends()
    if not names:
        pytest.skip("neither flash-attn nor torch's varlen_attn can run on this GPU: "
                    + "; ".join(unavailable_reasons("torch-varlen", "cuda", dtype, 64)))
    for seed in range(3):
        plan, nb = random_plan(seed, block_size, num_padding=seed % 2, max_context=700)
        inp = random_inputs(plan, nb, heads=9, kv_heads=3, head_dim=64, seed=seed)
        ref, _ = run_backend(ReferenceAttention, inp, torch.float64, "cpu")
        for name in names:
            out, _ = run_backend(lambda kv, n=name: make_backend(n, kv), inp, dtype, "cuda")
            assert relative_error(out, ref) < bound, (name, seed)
