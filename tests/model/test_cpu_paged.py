"""The ``cpu-paged`` backend: the C decode kernel against an independent oracle, and the engine on it.

The oracle is written here, row by row, the plain way: look each key up through the block table,
softmax in float64, weight the values. The kernel must agree with it to rounding on any block size,
GQA shape, context length (1 included) and thread count; the engine on ``cpu-paged`` must give the
padded baseline's tokens for every policy, preemption mode and block size, as the reference does.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import TINY, baseline_tokens, greedy, random_prompts, run_engine, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.fastpaths import ckernels, cpu_paged
from minicb.fastpaths.backends import make_backend, resolve_backend
from minicb.fastpaths.ckernels import cpu_flags
from minicb.model.attention import ReferenceAttention
from minicb.model.kv_cache import KVCache
from minicb.runtime.packer import _to_tensors
from preconditions import unavailable


@pytest.fixture(scope="module", autouse=True)
def kernel():
    why = cpu_paged.unavailable_reason()
    if why:
        unavailable(f"the cpu-paged kernel cannot be built here: {why}")


def oracle(q, kc, vc, tables, ctx, bs):
    """Row by row, key by key through the table, in float64."""
    rows, hq, d = q.shape
    group = hq // kc.shape[1]
    out = torch.empty(rows, hq, d, dtype=torch.float64)
    for r in range(rows):
        slots = [int(tables[r, t // bs]) * bs + t % bs for t in range(int(ctx[r]))]
        k = kc[slots].double().repeat_interleave(group, dim=1)       # [L, hq, d]
        v = vc[slots].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[r].double(), k) / d ** 0.5, dim=-1)
        out[r] = torch.einsum("hl,lhd->hd", p, v)
    return out


def random_case(rows, hq, hkv, d, bs, max_ctx, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx + 1, (rows,), generator=g)
    ctx[0] = 1                                                      # a one-key context
    if rows > 1:
        ctx[1] = max_ctx - max_ctx % bs or max_ctx                   # ends on a block boundary
    max_blocks = -(-int(ctx.max()) // bs)
    num_blocks = rows * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=g)[:rows * max_blocks].view(rows, max_blocks)
    kc = torch.randn(num_blocks * bs, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    vc = torch.randn(num_blocks * bs, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    q = torch.randn(rows, hq, d, generator=g, dtype=torch.float64).to(dtype)
    return q, kc, vc, tables.to(torch.int32), ctx.to(torch.int32)


# The kernel as minicb builds it (on a CPU with AVX2 and FMA, head_dim 64 takes the AVX2 path), and built
# without that path (-DDECODE_AVX2=0: the portable loops, which every other head_dim takes anyway).
# On a CPU with AVX-512 the default build runs head_dim 64 on the AVX-512 row; "avx2-row" is the same
# file built without it (-DDECODE_AVX512=0), so the AVX2 row is tested there too.
BUILDS = {"default": (), "portable": ("-DDECODE_AVX2=0",), "avx2-row": ("-DDECODE_AVX512=0",)}


def decode(q, kc, vc, tables, ctx, bs, build="default"):
    """``paged_decode`` through the given build of the kernel."""
    if build == "default":
        return cpu_paged.paged_decode(q, kc, vc, tables, ctx, bs)
    out = torch.empty_like(q)
    max_context = cpu_paged.check_decode_args(q, kc, vc, tables, ctx, bs, None)
    kernel = getattr(cpu_paged.load(BUILDS[build]), cpu_paged.kernel_name(q.dtype))
    cpu_paged.decode_into(out, q, kc, vc, tables, ctx, bs, max_context, kernel=kernel)
    return out


# bfloat16: inputs and output are stored in 8 significant bits, the arithmetic is float32; the output's
# own rounding (half a unit in the last place, 2**-9 relative) dominates the error.
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bs", [1, 4, 16])
# head_dim 64 and 128 run as compile-time constants (64: the AVX2 path, with 1 to 8 query heads per kv
# head, fewer and more query heads than the 8 keys of its score vectors); 12 and 6 end in a part shorter
# than a vector
@pytest.mark.parametrize("shape", [(4, 2, 8), (9, 3, 64), (4, 2, 64), (8, 1, 64), (3, 3, 64), (6, 6, 16),
                                   (8, 1, 32), (4, 2, 128), (3, 1, 12), (2, 2, 6)])
def test_kernel_matches_oracle(dtype, tol, bs, shape, build):
    hq, hkv, d = shape
    q, kc, vc, tables, ctx = random_case(7, hq, hkv, d, bs, 70, dtype, seed=bs * 100 + d)
    got = decode(q, kc, vc, tables, ctx, bs, build)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), oracle(q, kc, vc, tables, ctx, bs), rtol=tol, atol=tol)


def proc_cpu_flags() -> set[str]:
    """Every flag of /proc/cpuinfo's first processor (a test that needs them is unavailable elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        unavailable("no /proc/cpuinfo flags line here (Linux x86 only)")


def test_the_avx2_path_is_built_where_the_cpu_has_avx2():
    """So that on such a CPU the tests above run both paths, and no other CPU claims it."""
    has = {"avx2", "fma"} <= proc_cpu_flags()
    assert cpu_paged.avx2_path() == has
    assert not cpu_paged.load(BUILDS["portable"]).minicb_paged_decode_avx2()


@pytest.mark.parametrize("d", [64, 32])
def test_head_dim_64_takes_the_avx2_path(d):
    """The two builds agree to rounding (above); here, which loops ran: on an AVX2 CPU the default build
    sums head_dim 64 in another order than the portable loops (so some output differs in its last
    bits), and every other head_dim in the same order (so all are equal, bit for bit)."""
    if not cpu_paged.avx2_path():
        unavailable("this CPU has no AVX2 with FMA: the kernel has no AVX2 path to take")
    q, kc, vc, tables, ctx = random_case(9, 9, 3, d, 16, 120, torch.float32, seed=5)
    default, portable = decode(q, kc, vc, tables, ctx, 16), decode(q, kc, vc, tables, ctx, 16, "portable")
    torch.testing.assert_close(default, portable, rtol=2e-6, atol=2e-6)
    assert torch.equal(default, portable) == (d != 64)


def test_the_avx512_row_is_built_where_the_cpu_has_avx512():
    """The default build runs head_dim 64 on the AVX-512 row exactly where the CPU has AVX-512 (and AVX2);
    -DDECODE_AVX512=0 leaves it out, and there the two rows sum in another order: a float32 output
    that differs in its last bits shows which ran."""
    has = {"avx2", "fma", "avx512f"} <= proc_cpu_flags()
    assert cpu_paged.avx512_path() == has
    assert not cpu_paged.load(BUILDS["avx2-row"]).minicb_paged_decode_avx512()
    assert not cpu_paged.load(BUILDS["portable"]).minicb_paged_decode_avx512()
    q, kc, vc, tables, ctx = random_case(9, 9, 3, 64, 16, 120, torch.float32, seed=5)
    default, avx2 = decode(q, kc, vc, tables, ctx, 16), decode(q, kc, vc, tables, ctx, 16, "avx2-row")
    torch.testing.assert_close(default, avx2, rtol=2e-6, atol=2e-6)
    assert torch.equal(default, avx2) == (not has)


def test_bfloat16_head_dim_64_on_native_dot_products_where_the_avx512_row_has_them(monkeypatch):
    """The default bfloat16 kernel runs head_dim 64 on the AVX-512 row's vdpbf16ps where the CPU has
    AVX-512 BF16 (scores summed in another order than the widening row: some output differs), and on
    the widening rows elsewhere (the AVX2 row on an AVX2 CPU without AVX-512: equal to the widening
    kernel bit for bit). Other head sizes keep the native loops where the CPU has them."""
    if not cpu_paged.avx2_path():
        unavailable("this CPU has no AVX2 with FMA: the kernel has no AVX2 path to take")
    out = {}
    for d in (64, 128):        # 32 rows of up to 250 keys: enough that another order shows in bfloat16
        q, kc, vc, tables, ctx = random_case(32, 9, 3, d, 16, 250, torch.bfloat16, seed=7)
        for mode in ("native", "widen"):
            monkeypatch.setenv("MINICB_BF16_DECODE", mode)
            out[d, mode] = cpu_paged.paged_decode(q, kc, vc, tables, ctx, 16)
    native = cpu_paged.bf16_native()
    assert torch.equal(out[64, "native"], out[64, "widen"]) == (not (native and cpu_paged.avx512_path()))
    assert torch.equal(out[128, "native"], out[128, "widen"]) == (not native)


@pytest.mark.parametrize("build", BUILDS)
def test_long_contexts_over_many_rows(build):
    """Contexts of hundreds of keys (the AVX2 path asks for the memory 32 keys ahead, across a row's
    keys, its values and the next row's keys), float32, against the oracle."""
    q, kc, vc, tables, ctx = random_case(5, 9, 3, 64, 16, 300, torch.float32, seed=11)
    got = decode(q, kc, vc, tables, ctx, 16, build)
    torch.testing.assert_close(got.double(), oracle(q, kc, vc, tables, ctx, 16), rtol=2e-6, atol=2e-6)


def test_kernel_is_the_same_on_two_threads():
    q, kc, vc, tables, ctx = random_case(33, 9, 3, 64, 16, 200, torch.float32, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_paged.paged_decode(q, kc, vc, tables, ctx, 16)
        torch.set_num_threads(2)
        two = cpu_paged.paged_decode(q, kc, vc, tables, ctx, 16)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)       # rows are independent: threads change who computes, not what


def test_kernel_rejects_bad_input():
    q, kc, vc, tables, ctx = random_case(3, 4, 2, 8, 4, 20, torch.float32, seed=1)
    with pytest.raises(ValueError, match="float32, float64 or bfloat16"):
        cpu_paged.paged_decode(q.half(), kc, vc, tables, ctx, 4)
    with pytest.raises(ValueError, match="of one dtype"):
        cpu_paged.paged_decode(q.bfloat16(), kc, vc, tables, ctx, 4)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_paged.paged_decode(q.transpose(0, 1), kc, vc, tables, ctx, 4)
    with pytest.raises(ValueError, match="int32"):
        cpu_paged.paged_decode(q, kc, vc, tables.long(), ctx, 4)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        cpu_paged.paged_decode(q, kc[:, :1].contiguous(), vc[:, :1].contiguous(), tables[:2], ctx, 4)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_paged.paged_decode(q, kc, vc, tables, ctx, 4, max_context=tables.shape[1] * 4 + 1)
    with pytest.raises(ValueError, match="below the longest context"):
        cpu_paged.paged_decode(q, kc, vc, tables, ctx, 4, max_context=int(ctx.max()) - 1)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_paged.paged_decode(q, kc, vc, tables + kc.shape[0] // 4, ctx, 4)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_paged.paged_decode(q, kc, vc, tables - 1 - tables.max(), ctx, 4)
    assert cpu_paged.paged_decode(q[:0], kc, vc, tables[:0], ctx[:0], 4).shape == (0, 4, 8)


def test_build_failure_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICB_CACHE_DIR", str(tmp_path))
    with pytest.raises(cpu_paged.KernelUnavailable, match="failed to compile"):
        cpu_paged.build(["false"])                  # a "compiler" that always fails
    assert not list(tmp_path.rglob("*.so"))         # no half-written library is left behind
    not_executable = tmp_path / "cc.txt"
    not_executable.write_text("not a program")
    with pytest.raises(cpu_paged.KernelUnavailable, match="cannot be run"):
        cpu_paged.build([str(not_executable)])
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(ckernels.sysconfig, "get_config_var", lambda name: None)
    monkeypatch.setattr(ckernels.shutil, "which", lambda cmd: None)
    with pytest.raises(cpu_paged.KernelUnavailable, match="no C compiler"):
        cpu_paged.compiler()


def test_build_without_openmp_falls_back_to_one_thread(tmp_path, monkeypatch):
    """A compiler that rejects -fopenmp still builds the kernel (its pragmas are then ignored)."""
    monkeypatch.setenv("MINICB_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "cc-without-openmp"
    real = cpu_paged.compiler()
    fake.write_text("#!/bin/sh\ncase \"$*\" in *-fopenmp*) echo 'no OpenMP' >&2; exit 1;; esac\n"
                    f'exec {" ".join(real)} "$@"\n')
    fake.chmod(0o755)
    lib = ctypes.CDLL(str(cpu_paged.build([str(fake)])))
    assert lib.minicb_paged_decode_f32 and lib.minicb_paged_decode_f64


def test_unwritable_cache_dir_falls_back_to_a_temporary_one(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would go")
    monkeypatch.setenv("MINICB_CACHE_DIR", str(blocked))
    where = cpu_paged.cache_dir()
    assert where.is_dir() and blocked not in where.parents


def test_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICB_CACHE_DIR", str(tmp_path))
    first = cpu_paged.build()
    stamp = first.stat().st_mtime_ns
    # load-independent: an unchanged file stamp, not a duration
    assert cpu_paged.build() == first and first.stat().st_mtime_ns == stamp   # not rebuilt


def test_registry(caplog, monkeypatch):
    import minicb.fastpaths.backends as backends

    monkeypatch.setattr(backends, "_FALLBACKS_LOGGED", set())     # another test may have logged it
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert resolve_backend("cpu-paged", "cpu", dtype, 64) == "cpu-paged"
        assert resolve_backend("auto", "cpu", dtype, 64) == "cpu-paged"     # the fastest that runs here
    assert not caplog.records
    with pytest.raises(InvalidArgument, match="float32, float64 or bfloat16"):
        resolve_backend("cpu-paged", "cpu", torch.float16, 64)
    # auto falls back to the reference backend where cpu-paged cannot run, and says why in one line
    with caplog.at_level("WARNING", logger="minicb"):
        assert resolve_backend("auto", "cpu", torch.float16, 64) == "reference"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "using reference, not cpu-paged: cpu-paged takes float32, float64 or bfloat16" in line
    assert "\n" not in line


def test_registry_reports_a_broken_compiler(monkeypatch, caplog):
    import minicb.fastpaths.backends as backends

    monkeypatch.setattr(backends, "_FALLBACKS_LOGGED", set())
    monkeypatch.setattr(cpu_paged, "unavailable_reason", lambda: "no C compiler found (stand-in)")
    with pytest.raises(InvalidArgument, match="cpu-paged.*no C compiler found"):
        resolve_backend("cpu-paged", "cpu", torch.float32, 64)
    with caplog.at_level("WARNING", logger="minicb"):
        assert resolve_backend("auto", "cpu", torch.float32, 64) == "reference"
        assert resolve_backend("auto", "cpu", torch.float32, 64) == "reference"
    assert [r.getMessage() for r in caplog.records] == [    # said once, not once per engine
        "minicb: attn_backend auto: using reference, not cpu-paged: no C compiler found (stand-in)"]


@pytest.mark.parametrize("policy", ["continuous", "static", "dynamic"])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("prompts_on", ["sdpa", "kernel"])
def test_engine_on_cpu_paged_matches_baseline(policy, bs, prompts_on, monkeypatch):
    """Token for token against the padded baseline (float64), with prompt chunks on SDPA and on the
    prompt kernel (chunks that start at 0 and chunks after cached tokens alike)."""
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", prompts_on)
    model = tiny_model()
    prompts = random_prompts(24, 1, 60, TINY.vocab_size, seed=bs)
    params = [greedy(1 + (i * 7) % 20) for i in range(len(prompts))]
    cfg = SchedulerConfig(policy=policy, max_num_seqs=6, max_num_batched_tokens=32, block_size=bs,
                          num_blocks=max(12, 240 // bs), num_host_blocks=max(12, 240 // bs),
                          preemption_mode="swap" if bs == 4 else "recompute", long_prefill_chunk=16)
    outs, eng = run_engine(model, cfg, prompts, params, attn_backend="cpu-paged")
    assert eng.runner.backend.name == "cpu-paged"
    assert eng.runner.backend.prompts_on_kernel == (prompts_on == "kernel")
    if policy == "continuous":
        assert eng.scheduler.stats.num_preemptions > 0     # the pool is small enough to force it
    assert [o.token_ids for o in outs] == baseline_tokens(model, prompts, params, TINY.eos_token_id)


def test_prompts_on_kernel_is_chosen_by_dtype_head_dim_and_cpu(monkeypatch):
    monkeypatch.delenv("MINICB_PROMPT_ATTENTION", raising=False)
    native_row = cpu_paged.avx512_path() and cpu_paged.bf16_native()
    assert cpu_paged.prompts_on_kernel(torch.bfloat16, 64) == native_row
    assert not cpu_paged.prompts_on_kernel(torch.bfloat16, 128)        # no fast row for it: SDPA
    assert cpu_paged.prompts_on_kernel(torch.float32, 64) == cpu_paged.avx512_path()   # then stacked
    assert not cpu_paged.prompts_on_kernel(torch.float64, 64)          # the exactness dtype: SDPA
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", "kernel")
    assert cpu_paged.prompts_on_kernel(torch.float64, 12)
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", "sdpa")
    assert not cpu_paged.prompts_on_kernel(torch.bfloat16, 64)
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", "fast")
    with pytest.raises(ValueError, match="'kernel' or 'sdpa'"):
        cpu_paged.prompts_on_kernel(torch.bfloat16, 64)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_a_mixed_step_on_the_kernel_equals_the_reference_backend(dtype, tol, monkeypatch):
    """One step of decodes, a whole prompt and a chunk after cached tokens: every layer's output with
    the decode on paged_decode and the chunks on paged_prompt is the reference backend's (to rounding
    in float32 and bfloat16: another order)."""
    monkeypatch.setenv("MINICB_PROMPT_ATTENTION", "kernel")
    hq, hkv, d, bs = 9, 3, 64, 4
    cache = KVCache(1, 64, bs, hkv, d, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g, dtype=torch.float64).to(dtype))
    # three sequences: 1 new token after 9 cached, a 7-token prompt, 5 tokens after 6 cached
    starts, q_lens, tables = [9, 0, 6], [1, 7, 5], [[0, 1, 2], [5, 6], [8, 9, 10]]
    pos = [s + i for s, q in zip(starts, q_lens) for i in range(q)]
    slots = [t[p // bs] * bs + p % bs for s, q, t in zip(starts, q_lens, tables) for p in range(s, s + q)]
    ctx = [s + q for s, q in zip(starts, q_lens)]
    b = _to_tensors([1] * len(pos), pos, slots, q_lens, starts, ctx, tables, [], [], bs, "cpu")
    n = len(pos)
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(n, hkv, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    kernel = cpu_paged.CpuPagedAttention(cache)
    assert kernel.prompts_on_kernel
    state = kernel.prepare(b.attn)
    (tiles,) = state.groups                 # one group: the chunks' tiles, the decode row inside it
    assert isinstance(tiles, cpu_paged._PromptTiles) and tiles.decodes.tokens.tolist() == [0]
    got = kernel.attend(0, q, k, v, state)
    assert tiles.tiles.tolist() == [[1, 7, 0, 1], [8, 5, 6, 2]]
    want = ReferenceAttention(cache).attend(0, q, k, v, ReferenceAttention(cache).prepare(b.attn))
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_engine_backend_builds_at_start(monkeypatch):
    """A broken kernel surfaces when the engine is made, not in the middle of a run."""
    import minicb.fastpaths.cpu_paged as mod

    kv = make_backend("reference", _small_cache()).kv_cache
    monkeypatch.setattr(mod, "load", lambda: (_ for _ in ()).throw(mod.KernelUnavailable("stand-in")))
    with pytest.raises(mod.KernelUnavailable, match="stand-in"):
        mod.CpuPagedAttention(kv)


def _small_cache():
    return KVCache(2, 8, 4, 2, 8, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 8), (6, 2, 48)])
def test_bfloat16_kernel_is_the_float32_kernel_rounded(shape, monkeypatch):
    """The widening bfloat16 kernel widens to float32, computes as the float32 kernel does and rounds once
    at the end: its output is the float32 kernel's on the widened inputs, rounded by torch (nearest-even)."""
    monkeypatch.setenv("MINICB_BF16_DECODE", "widen")
    hq, hkv, d = shape
    q, kc, vc, tables, ctx = random_case(11, hq, hkv, d, 16, 90, torch.bfloat16, seed=d)
    got = cpu_paged.paged_decode(q, kc, vc, tables, ctx, 16)
    want = cpu_paged.paged_decode(q.float(), kc.float(), vc.float(), tables, ctx, 16).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 8), (6, 2, 48)])
def test_native_bfloat16_kernel_is_a_rounding_from_float64(shape, monkeypatch):
    """The default bfloat16 kernel (native bfloat16 dot products where the CPU has them: the scores are
    summed in another order) is within one bfloat16 rounding of the float64 kernel on the same values,
    as the widening one is."""
    monkeypatch.delenv("MINICB_BF16_DECODE", raising=False)
    hq, hkv, d = shape
    q, kc, vc, tables, ctx = random_case(12, hq, hkv, d, 16, 90, torch.bfloat16, seed=d + 1)
    exact = cpu_paged.paged_decode(q.double(), kc.double(), vc.double(), tables, ctx, 16)
    for mode in ("native", "widen"):
        monkeypatch.setenv("MINICB_BF16_DECODE", mode)
        got = cpu_paged.paged_decode(q, kc, vc, tables, ctx, 16).double()
        # one rounding of the output (2^-8 relative) plus float32 sums of scores and weights (far smaller)
        assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all(), mode
    assert cpu_paged.kernel_name(torch.bfloat16) == cpu_paged.WIDEN_BF16
    assert not cpu_paged.bf16_native() or "avx512_bf16" in cpu_flags()    # native only on such a CPU


# A library preloaded into a child process (LD_PRELOAD) that watches the kernels from outside: it counts
# the OpenMP teams opened (libgomp's GOMP_parallel, which every `omp parallel` calls) and, once armed,
# makes the malloc calls of at least `min_size` bytes fail (the `which`-th only, or all with -1).
TEAM_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
extern void *__libc_malloc(size_t);
static atomic_long armed, which, seen, failed, teams;
void shim_arm(long min_size, long nth) { seen = 0; failed = 0; teams = 0; which = nth; armed = min_size; }
long shim_failed(void) { armed = 0; return failed; }
long shim_teams(void) { return teams; }
void *malloc(size_t n) {
    const long m = armed;
    if (m && (long)n >= m) {
        const long k = atomic_fetch_add(&seen, 1);
        if (which < 0 || k == which) { atomic_fetch_add(&failed, 1); return NULL; }
    }
    return __libc_malloc(n);
}
void GOMP_parallel(void (*fn)(void *), void *data, unsigned threads, unsigned flags) {
    typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
    static gomp_parallel_t real;
    if (!real) {        /* the kernels load libgomp privately (ctypes): look it up by name, not RTLD_NEXT */
        void *gomp = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
        real = (gomp_parallel_t)dlsym(gomp ? gomp : RTLD_NEXT, "GOMP_parallel");
        if (!real) abort();
    }
    atomic_fetch_add(&teams, 1);
    real(fn, data, threads, flags);
}
"""

# The child: numpy and ctypes only (the libraries' paths in argv), one JSON object of results.
TEAM_CHILD = r"""
import ctypes, json, sys
import numpy as np
fused, decode, prompt = (ctypes.CDLL(p) for p in sys.argv[1:4])
shim = ctypes.CDLL(None)
shim.shim_arm.argtypes = [ctypes.c_long, ctypes.c_long]
shim.shim_failed.restype = shim.shim_teams.restype = ctypes.c_long
i64, ptr, dbl, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_int
P = lambda a: a.ctypes.data
rng = np.random.default_rng(0)
norm = fused.minicb_rmsnorm_f32
norm.argtypes = [ptr, ptr, ptr, i64, i64, dbl, cint]
dec = decode.minicb_paged_decode_f32
dec.argtypes, dec.restype = [ptr] * 6 + [i64] * 7 + [dbl, cint], cint
pro = prompt.minicb_paged_prompt_f32
pro.argtypes, pro.restype = [ptr] * 5 + [i64, ptr] + [i64] * 5 + [dbl, cint, i64], cint
qh, kh, hd, bs = 9, 3, 64, 16

def run_norm(rows, threads):
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    w, out = np.ones(64, np.float32), np.empty_like(x)
    shim.shim_arm(0, -1)
    norm(P(x), P(w), P(out), rows, 64, 1e-6, threads)
    return {"teams": shim.shim_teams()}

def run_decode(threads, fail):          # 6 rows of 600 keys; fail: which scratch malloc fails (None: none)
    rows, maxb, ctx = 6, 40, 600
    k = rng.standard_normal((rows * maxb * bs, kh, hd)).astype(np.float32)
    q = rng.standard_normal((rows, qh, hd)).astype(np.float32)
    tables = np.arange(rows * maxb, dtype=np.int32).reshape(rows, maxb)
    lens, out = np.full(rows, ctx, np.int32), np.empty_like(q)
    shim.shim_arm(20000 if fail is not None else 0, -1 if fail is None else fail)
    ret = dec(P(q), P(k), P(k), P(tables), P(lens), P(out), rows, qh, kh, hd, maxb, bs, ctx, 0.125, threads)
    return {"ret": ret, "teams": shim.shim_teams(), "failed": shim.shim_failed()}

def run_prompt(threads, fail, item=-1):   # one 128-token prompt in 8 tiles
    k = rng.standard_normal((16 * bs, kh, hd)).astype(np.float32)
    q = rng.standard_normal((128, qh, hd)).astype(np.float32)
    tiles = np.array([(a, 16, a, 0) for a in range(0, 128, 16)], np.int32)
    tables, out = np.arange(16, dtype=np.int32).reshape(1, 16), np.empty_like(q)
    shim.shim_arm(1000 if fail is not None else 0, -1 if fail is None else fail)
    ret = pro(P(q), P(k), P(k), P(tables), P(tiles), len(tiles), P(out), qh, kh, hd, 16, bs, 0.125, threads,
              item)
    return {"ret": ret, "teams": shim.shim_teams(), "failed": shim.shim_failed()}

print(json.dumps({
    "openmp": "libgomp" in open("/proc/self/maps").read(),     # a build without OpenMP opens no teams
    "norm 1 thread, 4 rows": run_norm(4, 1), "norm 1 thread, 4096 rows": run_norm(4096, 1),
    "norm 2 threads, 4096 rows": run_norm(4096, 2),
    "decode 1 thread": run_decode(1, None), "decode 2 threads": run_decode(2, None),
    "decode 1 thread, its scratch refused": run_decode(1, 0),
    "decode 2 threads, one scratch refused": run_decode(2, 0),
    "decode 2 threads, both refused": run_decode(2, -1),
    "prompt 1 thread": run_prompt(1, None), "prompt 1 thread, one item": run_prompt(1, None, item=3),
    "prompt 2 threads": run_prompt(2, None),
    "prompt 1 thread, its scratch refused": run_prompt(1, 0),
    "prompt 2 threads, one scratch refused": run_prompt(2, 0),
}))
"""


def test_one_thread_opens_no_team_and_a_refused_scratch_reaches_the_caller(tmp_path):
    """The layer stack calls these kernels for one thread from inside its own OpenMP team, where an
    ``omp parallel`` (even of one thread, or with a false ``if``) opens a nested team on every call:
    counted from outside (a preloaded ``GOMP_parallel``), a one-thread call opens none and a two-thread
    call of enough work does. And a scratch allocation refused (a preloaded ``malloc``) makes the call
    return 1, whether one thread or both are refused: before, a two-thread decode call hung when one
    thread's was (the other waited at the end of an ``omp for`` the first never entered)."""
    from minicb.fastpaths import cpu_fused

    shim = tmp_path / "shim.so"
    subprocess.run([*ckernels.compiler(), "-O1", "-shared", "-fPIC", "-x", "c", "-", "-o", str(shim), "-ldl"],
                   input=TEAM_SHIM, text=True, check=True, capture_output=True)
    libs = [ckernels.build(cpu_fused.SOURCE, extra_flags=cpu_fused.EXTRA_FLAGS), cpu_paged.build(),
            ckernels.build(cpu_paged.PROMPT_SOURCE, extra_flags=cpu_paged.EXTRA_FLAGS)]
    proc = subprocess.run([sys.executable, "-c", TEAM_CHILD, *map(str, libs)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "LD_PRELOAD": str(shim)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    for name in ("norm 1 thread, 4 rows", "norm 1 thread, 4096 rows", "decode 1 thread", "prompt 1 thread",
                 "prompt 1 thread, one item", "decode 1 thread, its scratch refused",
                 "prompt 1 thread, its scratch refused"):
        assert r[name]["teams"] == 0, (name, r[name])
    for name in ("norm 2 threads, 4096 rows", "decode 2 threads", "prompt 2 threads"):
        assert r[name]["teams"] >= 1 or not r["openmp"], (name, r[name])     # the shim does see teams
    for name in ("decode 1 thread", "decode 2 threads", "prompt 1 thread", "prompt 1 thread, one item",
                 "prompt 2 threads"):
        assert r[name]["ret"] == 0 and r[name].get("failed", 0) == 0, (name, r[name])
    for name in ("decode 1 thread, its scratch refused", "decode 2 threads, one scratch refused",
                 "decode 2 threads, both refused", "prompt 1 thread, its scratch refused",
                 "prompt 2 threads, one scratch refused"):
        assert r[name]["ret"] == 1 and r[name]["failed"] >= 1, (name, r[name])
