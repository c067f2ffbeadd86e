"""W2 through ``LLM()`` on each linear path (``cpu_linear.PATHS``), alternating round by round: the ratio.

    python bench/linear_paths.py                                     # float32: onednn-f32 vs mkl, 3 rounds
    python bench/linear_paths.py --dtype bfloat16 --paths onednn-bf16,onednn-f32,mkl --rounds 2
    python bench/linear_paths.py --workload W1
    python bench/linear_paths.py --micro      # one layer-shaped product per path, and greedy argmax in bf16
    python bench/linear_paths.py --memory     # resident memory after packing, unpacked weights kept or not
    python bench/linear_paths.py --skinny     # few-row products from memory: oneDNN against skinny_gemm
    python bench/linear_paths.py --prefetch   # float32 from memory: the AVX2 tiles' prefetch on, bunched, off

``mkl`` is what minicb did before every layer was packed: MKL's float32 ``F.linear`` for the layers and
the LM head alone packed for oneDNN; ``onednn-f32`` / ``onednn-bf16`` pack every layer. One model per
path stays loaded (built as ``LLM()`` builds it: ``cpu_fast_paths`` with ``MINICB_LINEAR`` set), and each
round runs W2 (``bench/workloads.py``, 64 requests, EOS ignored, ``LLM()``'s defaults, the prefix cache
emptied first) once on every path in turn, so a slow spell of the shared machine hits all paths alike.
Prints tokens/s per run (and per CPU second of this process: on a machine shared with other jobs the
wall time counts the others' turns, the CPU time much less), the median per path, each path's ratio to
the first one round by round, and whether the paths' first 8 tokens agree request by request.

``--micro`` times the pieces instead, one thread, alternating, median of 7 rounds: the fused q/k/v
product of SmolLM2 (``[rows, 576] x [576, 960]``) at 1-256 rows through MKL's float32 ``F.linear``,
packed oneDNN float32, packed oneDNN bfloat16 (where oneDNN has bfloat16 products), torch's own
bfloat16 ``F.linear`` and the skinny kernel in both dtypes (GFLOP/s); and the
sampler's greedy argmax over a ``[64, 49152]`` bfloat16 logits matrix, as it is and widened to float32
first (what ``Sampler.sample`` does now).

``--skinny`` times what a decode step of few sequences multiplies: SmolLM2's 30 layers of weights (q/k/v
stacked, o, gate/up stacked, down: 270 MB in bfloat16, more than any cache, so they come from memory as
in a real step), each product once per pass, at 1-64 rows, through oneDNN's packed products and the
skinny kernel's panels (``minicb.fastpaths.skinny_gemm``), alternating, median of 5 passes, one thread:
ms per pass, the bandwidth it reads the weights at, and the ratio. oneDNN computes as ``LLM()`` would on
this CPU (``cpu_linear.choose_path``): a bfloat16 model on a CPU without bfloat16 products has its
weights packed in float32 and its rows widened, so oneDNN reads twice the kernel's bytes there. Where
the ratio crosses 1 is where ``skinny_gemm.ROWS`` belongs for the CPU's loop; one thread's read bandwidth
(``decode_floor.read_bandwidth``) is printed first, the ceiling for a pass. On a CPU with AVX-512 a
third column times the kernel built without it (``-mno-avx512f``: its AVX2 loops), beside the AVX-512
ones; ``--rows`` picks the row counts.

``--prefetch`` does the same (``--dtype``, ``--threads``) for three builds of the kernel
(``-DSKINNY_PREFETCH=2``, the default: the next panel's cache lines asked for at an even pace over the
panel's passes; ``=1``: bunched at the start of each pass; ``=0``: not asked for), beside oneDNN, at
4-256 rows: what asking for the next panel is worth, in the AVX2 tiles and in the AVX-512 loops (which
ask only when a call has at least 19 rows: ``skinny_gemm.c``, ``next_share512``).

``--memory`` loads SmolLM2 in a fresh process per case (float32 and bfloat16, on the path ``LLM()``
picks) and prints the process's resident memory (``VmRSS``) after the load and after the fast paths,
once with the unpacked layer weights kept beside the packed copies (``keep_unpacked=True``: what minicb
did before) and once dropped (the default), with the bytes of the model's parameters and packed buffers.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cpu_header, load_smollm2  # noqa: E402
from workloads import w1, w2  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402
from minicb.fastpaths.cpu_linear import linear_path  # noqa: E402


def _median_ms(fns: dict, rounds: int = 7, calls: int = 20) -> dict[str, float]:
    """Each function's median time per call (ms) over ``rounds`` rounds that run them in turn."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def micro() -> None:
    import torch.nn.functional as F

    from minicb.fastpaths import skinny_gemm
    from minicb.fastpaths.cpu_linear import _pack, _packed_matmul, no_bf16_packing_reason

    k, n = 576, 960
    w = torch.randn(n, k)
    wb = w.bfloat16()
    packed32, panels32, panels16 = _pack(w, torch.float32), skinny_gemm.pack(w), skinny_gemm.pack(wb)
    packed16 = _pack(w, torch.bfloat16) if no_bf16_packing_reason() is None else None
    print(f"q/k/v-shaped product [rows, {k}] x [{k}, {n}], GFLOP/s (median of 7 alternating rounds); "
          f"oneDNN bf16: {'packed' if packed16 is not None else 'none on this CPU (-)'}; skinny: the "
          f"{skinny_gemm.PATH_NAMES[torch.float32][skinny_gemm.path(torch.float32)]} / "
          f"{skinny_gemm.PATH_NAMES[torch.bfloat16][skinny_gemm.path(torch.bfloat16)]} loops, weights "
          "from the cache (--skinny reads them from memory)")
    print(f"{'rows':>5} {'MKL f32':>9} {'oneDNN f32':>11} {'oneDNN bf16':>12} {'torch bf16':>11} "
          f"{'skinny f32':>11} {'skinny bf16':>12}")
    for rows in (1, 4, 16, 64, 256):
        x = torch.randn(rows, k)
        xb = x.bfloat16()
        runs = {"mkl": lambda x=x: F.linear(x, w),
                "f32": lambda x=x: _packed_matmul(x, packed32, n, torch.float32),
                "torch": lambda xb=xb: F.linear(xb, wb),
                "s32": lambda x=x: skinny_gemm.matmul(x, panels32, k, n),
                "s16": lambda xb=xb: skinny_gemm.matmul(xb, panels16, k, n)}
        if packed16 is not None:
            runs["bf16"] = lambda xb=xb: _packed_matmul(xb, packed16, n, torch.bfloat16)
        ms = _median_ms(runs)
        gf = {name: 2 * rows * k * n / (t / 1e3) / 1e9 for name, t in ms.items()}
        bf16 = f"{gf['bf16']:>12.0f}" if "bf16" in gf else f"{'-':>12}"
        print(f"{rows:>5} {gf['mkl']:>9.0f} {gf['f32']:>11.0f} {bf16} {gf['torch']:>11.0f} "
              f"{gf['s32']:>11.0f} {gf['s16']:>12.0f}")
    logits = torch.randn(64, 49152).bfloat16()
    ms = _median_ms({"bf16": lambda: torch.argmax(logits, dim=-1),
                     "widened": lambda: torch.argmax(logits.float(), dim=-1)}, calls=5)
    print(f"greedy argmax over [64, 49152] bfloat16 logits: {ms['bf16']:.2f} ms as bfloat16, "
          f"{ms['widened']:.2f} ms widened to float32 first ({ms['bf16'] / ms['widened']:.1f}x)")


SKINNY_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def skinny(rows_list=SKINNY_ROWS) -> None:
    from decode_floor import read_bandwidth

    from minicb.fastpaths import skinny_gemm
    from minicb.fastpaths.cpu_linear import _pack, choose_path

    # on an AVX-512 CPU, the kernel's AVX2 loops too (built -mno-avx512f): which of its loops wins here
    avx2 = skinny_gemm.load(("-mno-avx512f",)) if skinny_gemm.path(torch.float32) == 2 else None

    print(f"one thread's read bandwidth (torch.sum over 256 MB, best of 5): {read_bandwidth():.1f} GB/s")
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30       # SmolLM2's layers, [out, in]
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        path, _ = choose_path(dtype)
        compute = torch.bfloat16 if path == "onednn-bf16" else torch.float32
        weights = [(0.05 * torch.randn(o, i, generator=g)).to(dtype) for o, i in shapes]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        dnn = [(_pack(w.to(compute), compute), *w.shape) for w in weights]      # (packed, out, in)
        panels = [(skinny_gemm.pack(w), *w.shape) for w in weights]
        del weights
        print(f"\n{str(dtype).removeprefix('torch.')}: {nbytes / 1e6:.0f} MB of weights a pass; ms per pass "
              f"(GB/s of {str(dtype).removeprefix('torch.')} weights), median of 5 alternating passes; "
              f"oneDNN computes in {str(compute).removeprefix('torch.')} (LLM() takes {path} here), the "
              f"skinny kernel runs its {skinny_gemm.PATH_NAMES[dtype][skinny_gemm.path(dtype)]} loop")
        print(f"{'rows':>5} {'oneDNN':>16} {'skinny':>16} {'ratio':>6}"
              + (f" {'its AVX2 loops':>16} {'ratio':>6}" if avx2 else ""))
        for rows in rows_list:
            xs = {i: torch.randn(rows, i, generator=g).to(dtype) for i in (576, 1536)}
            onednn = functools.partial(_onednn, dtype=compute)
            runs = {"dnn": functools.partial(_one_pass, onednn, dnn, xs),
                    "skinny": functools.partial(_one_pass, _skinny, panels, xs)}
            if avx2:
                runs["avx2"] = functools.partial(_one_pass, functools.partial(_skinny, lib=avx2), panels, xs)
            ms = _median_ms(runs, rounds=5, calls=1)
            gbs = {k: nbytes / (v / 1e3) / 1e9 for k, v in ms.items()}
            print(f"{rows:>5} {ms['dnn']:>8.2f} ({gbs['dnn']:>4.1f}) {ms['skinny']:>8.2f} "
                  f"({gbs['skinny']:>4.1f}) {ms['dnn'] / ms['skinny']:>5.2f}x"
                  + (f" {ms['avx2']:>8.2f} ({gbs['avx2']:>4.1f}) {ms['dnn'] / ms['avx2']:>5.2f}x"
                     if avx2 else ""))
        del dnn, panels
        gc.collect()


PREFETCH_ROWS = (4, 8, 16, 24, 32, 48, 64, 128, 256)


def prefetch(rows_list=PREFETCH_ROWS, dtype: torch.dtype = torch.float32) -> None:
    from decode_floor import read_bandwidth

    from minicb.fastpaths import skinny_gemm
    from minicb.fastpaths.cpu_linear import _pack

    print(f"read bandwidth on {torch.get_num_threads()} thread(s) (torch.sum over 256 MB, best of 5): "
          f"{read_bandwidth():.1f} GB/s")
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30       # SmolLM2's layers, [out, in]
    g = torch.Generator().manual_seed(0)
    weights = [(0.05 * torch.randn(o, i, generator=g)).to(dtype) for o, i in shapes]
    dnn = [(_pack(w, dtype), *w.shape) for w in weights]
    panels = [(skinny_gemm.pack(w), *w.shape) for w in weights]
    flops = 2 * sum(o * i for o, i in shapes)
    builds = {f"prefetch={v}": skinny_gemm.load((f"-DSKINNY_PREFETCH={v}",)) for v in (2, 1, 0)}
    loop = skinny_gemm.PATH_NAMES[dtype][skinny_gemm.path(dtype)]
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(f"{str(dtype).removeprefix('torch.')}, {mb:.0f} MB of weights a pass; GFLOP/s from memory, "
          f"median of 5 alternating passes; the skinny kernel's {loop} loop")
    del weights
    print(f"{'rows':>5} {'oneDNN':>8} " + " ".join(f"{b:>11}" for b in builds)
          + "   prefetch=2/oneDNN  prefetch=2/0")
    for rows in rows_list:
        xs = {i: torch.randn(rows, i, generator=g).to(dtype) for i in (576, 1536)}
        runs = {"dnn": functools.partial(_one_pass, functools.partial(_onednn, dtype=dtype), dnn, xs)}
        for b, lib in builds.items():
            runs[b] = functools.partial(_one_pass, functools.partial(_skinny, lib=lib), panels, xs)
        ms = _median_ms(runs, rounds=5, calls=1)
        gf = {k: flops * rows / (v / 1e3) / 1e9 for k, v in ms.items()}
        print(f"{rows:>5} {gf['dnn']:>8.1f} " + " ".join(f"{gf[b]:>11.1f}" for b in builds)
              + f"   {ms['dnn'] / ms['prefetch=2']:>17.2f}x  {ms['prefetch=0'] / ms['prefetch=2']:>11.2f}x")


def _onednn(p, x, out_f, in_f, dtype):
    from minicb.fastpaths.cpu_linear import _packed_matmul
    return _packed_matmul(x, p, out_f, dtype)


def _skinny(p, x, out_f, in_f, lib=None):
    from minicb.fastpaths import skinny_gemm
    return skinny_gemm.matmul(x, p, in_f, out_f, lib=lib)


def _one_pass(run, packed: list, xs: dict) -> None:
    """Every product of ``packed`` (``(weights, out, in)``) once: ``run(weights, x, out, in)`` on the input
    of its size."""
    for p, out_f, in_f in packed:
        run(p, xs[in_f], out_f, in_f)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def memory_child(dtype_name: str, keep: bool) -> None:
    """One case of ``--memory``: load, fast paths (unpacked weights kept or dropped), print JSON."""
    from minicb.fastpaths import cpu_fused, cpu_linear

    dtype = getattr(torch, dtype_name)
    model = load_smollm2(dtype)
    gc.collect()
    loaded = _rss_mb()
    if cpu_fused.unavailable_reason() is None:
        cpu_fused.fuse_elementwise(model)
    cfg = model.config
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    path, _ = cpu_linear.choose_path(dtype, cfg.hidden_size, qkv)
    cpu_linear.apply_path(model, path, keep_unpacked=keep)
    gc.collect()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    print(json.dumps({"path": path, "loaded_mb": loaded, "packed_mb": _rss_mb(),
                      "tensor_mb": sum(t.numel() * t.element_size() for t in tensors) / 2 ** 20}))


def memory() -> None:
    print("resident memory (VmRSS, MiB) of a fresh process: after loading SmolLM2, after LLM()'s fast paths")
    print(f"{'dtype':<9} {'path':<12} {'unpacked':<9} {'loaded':>7} {'packed':>7} {'growth':>7} "
          f"{'tensors':>8}")
    for dname in ("float32", "bfloat16"):
        for keep in (True, False):
            out = subprocess.run([sys.executable, __file__, "--memory-child", dname, str(int(keep))],
                                 capture_output=True, text=True, check=True, timeout=600).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{dname:<9} {r['path']:<12} {'kept' if keep else 'dropped':<9} {r['loaded_mb']:>7.0f} "
                  f"{r['packed_mb']:>7.0f} {r['packed_mb'] - r['loaded_mb']:>+7.0f} {r['tensor_mb']:>8.0f}",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--paths", default="onednn-f32,mkl", help="cpu_linear.PATHS, the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workload", default="W2", choices=["W1", "W2"])
    ap.add_argument("--micro", action="store_true", help="time the pieces instead (see the docstring)")
    ap.add_argument("--skinny", action="store_true",
                    help="few-row products from memory: oneDNN against the skinny kernel (see the docstring)")
    ap.add_argument("--prefetch", action="store_true",
                    help="products from memory (--dtype, --threads): the next panel asked for spread, "
                         "bunched, not at all (the docstring)")
    ap.add_argument("--rows", help="with --prefetch or --skinny: the row counts, comma-separated (default 4 "
                                   "to 256, 1 to 256)")
    ap.add_argument("--memory", action="store_true", help="resident memory after packing (the docstring)")
    ap.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args.memory_child[0], bool(int(args.memory_child[1])))
    print(cpu_header(), flush=True)
    if args.micro:
        return micro()
    rows = tuple(int(r) for r in args.rows.split(",")) if args.rows else None
    if args.skinny:
        return skinny(rows or SKINNY_ROWS)
    if args.prefetch:
        return prefetch(rows or PREFETCH_ROWS, getattr(torch, args.dtype))
    if args.memory:
        return memory()
    wl = w2() if args.workload == "W2" else w1()
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    paths = args.paths.split(",")
    llms = {}
    for path in paths:
        os.environ["MINICB_LINEAR"] = path
        blocks: dict = {}                 # the GGUF's blocks, which LLM() hands the fast paths
        model = load_smollm2(getattr(torch, args.dtype), blocks)
        applied = cpu_fast_paths(model, "cpu", gguf_blocks=blocks)
        print(f"{path}: {linear_path(model)} ({', '.join(applied)})", flush=True)
        llms[path] = LLM(model)
    runs: dict[str, list[float]] = {p: [] for p in paths}
    per_cpu: dict[str, list[float]] = {p: [] for p in paths}   # tokens per CPU second: less hit by sharing
    first8: dict[str, list] = {}
    for rnd in range(args.rounds):
        for path in paths:
            llm = llms[path]
            llm.reset_prefix_cache()
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(wl.prompts, params)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            runs[path].append(sum(len(o.token_ids) for o in outs) / dt)
            per_cpu[path].append(sum(len(o.token_ids) for o in outs) / dc)
            first8[path] = [o.token_ids[:8] for o in outs]
            print(f"  round {rnd + 1} {path:<12} {runs[path][-1]:7.1f} tokens/s, "
                  f"{per_cpu[path][-1]:7.1f} per CPU s  "
                  f"({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f})", flush=True)
    base = paths[0]
    print(f"\n{wl.name} {args.dtype}, {args.threads} thread(s), {args.rounds} rounds:")
    for path in paths:
        ratios = [b / a for a, b in zip(runs[path], runs[base])]
        cpu_ratios = [b / a for a, b in zip(per_cpu[path], per_cpu[base])]
        same = sum(a == b for a, b in zip(first8[path], first8[base]))
        print(f"  {path:<12} median {statistics.median(runs[path]):7.1f} tokens/s "
              f"({statistics.median(per_cpu[path]):.1f} per CPU s); {base} / {path} per round: wall "
              f"{', '.join(f'{r:.2f}x' for r in ratios)}, CPU {', '.join(f'{r:.2f}x' for r in cpu_ratios)}; "
              f"first 8 tokens as {base}'s in {same}/{len(wl.prompts)}")


if __name__ == "__main__":
    main()
