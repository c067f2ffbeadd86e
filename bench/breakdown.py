"""Where the time of minicb continuous and minicb static goes on W2, and what that bounds.

    python bench/breakdown.py --threads 1          # W2 (about 3 min here)
    python bench/breakdown.py --threads 1 --quick  # 16 requests
    python bench/breakdown.py --threads 1 --attn-backend cpu-paged   # decode attention by the C kernel
    python bench/breakdown.py --threads 1 --vs-vllm bench/out/vllm-profile/float32   # beside vLLM

With ``--vs-vllm DIR`` it profiles only minicb continuous with ``LLM()``'s defaults (``--dtype``) and
prints it beside the op table vLLM's torch profiler wrote for the same W2 requests
(``python bench/peer_vllm.py --one-core --workloads W2 --dtypes float32 --repeats 1 --skip-minicb
--profile-vllm bench/out/vllm-profile``): per part, seconds of self time, vLLM's ops grouped the same
way (its linears are ``_C::onednn_mm``, its attention ``_C::cpu_attention_with_kv_cache`` and the
cache write ``_C::cpu_attn_reshape_and_cache``).

Both policies run the W2 workload of ``bench/throughput.py`` (SmolLM2 float32, greedy, EOS ignored) under
``cProfile``, and the wall time is split by the torch calls it went to:

* ``linear``: the matmuls (Q/K/V/O, MLP, and the LM head, packed for oneDNN or not): the work both
  policies must do per computed row;
* ``attention``: ``scaled_dot_product_attention`` calls of the reference backend;
* ``gather``: ``index_select`` calls (K/V read from the paged cache through block tables, query rows);
* ``kernel``: ``cpu_paged.decode_into``, the C decode kernel of the ``cpu-paged`` backend (0 with the
  reference backend, which does that work in ``gather`` and ``attention``);
* ``rest``: everything else (norms, RoPE, SiLU, cache writes, scheduling, packing, sampling, Python).

The time ratio static/continuous is a weighted mean of the per-part ratios, so it lies between the
smallest and the largest of them. An optimisation that speeds a part up by the same factor in both
policies (a faster kernel, less Python) keeps that part's ratio and only shifts the weights, so no such
change can lift the overall ratio above the largest part ratio; the last line prints that ceiling.
cProfile adds a few per cent of Python overhead to both runs.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pathlib
import pstats
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import load_smollm2, machine_description  # noqa: E402
from workloads import w2  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM  # noqa: E402
from minicb.model.backends import NAMES, resolve_backend  # noqa: E402

PARTS = {"linear": ("linear", "_linear_pointwise"), "attention": ("scaled_dot_product_attention",),
         "gather": ("index_select",), "kernel": ("decode_into",)}


def profile_run(model, wl, timer=time.perf_counter, **config) -> dict[str, float]:
    """Seconds per part (see the module docstring) of one ``LLM.generate`` over ``wl``, by ``timer``
    (wall clock, or ``time.process_time`` for CPU seconds)."""
    llm = LLM(model, **config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    prof = cProfile.Profile(timer)
    t0 = timer()
    prof.runcall(llm.generate, wl.prompts, params)
    wall = timer() - t0
    stats = pstats.Stats(prof).stats      # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    out = {part: 0.0 for part in PARTS}
    # builtins are named like "<built-in method torch._C._nn.linear>" or "<method 'index_select' of ...>"
    for (_, _, name), (_, _, tottime, _, _) in stats.items():
        for part, fns in PARTS.items():
            if any(name.endswith(f".{fn}>") or f"'{fn}'" in name or name == fn for fn in fns):
                out[part] += tottime
    out["rest"] = wall - sum(out.values())
    out["total"] = wall
    return out


VLLM_PARTS = {"linear": ("onednn_mm", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul"),
              "attention": ("cpu_attention", "cpu_attn", "scaled_dot_product")}
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def read_vllm_table(path: pathlib.Path) -> dict[str, float]:
    """Seconds of self CPU time per op in a torch profiler table (``key_averages().table()``)."""
    lines = path.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if "Self CPU" in line and "Name" in line)
    cols = [c.strip() for c in lines[header].split("  ") if c.strip()]
    col = cols.index("Self CPU")
    out: dict[str, float] = {}
    for line in lines[header + 2:]:
        fields = [c.strip() for c in line.split("  ") if c.strip()]
        if len(fields) != len(cols) or line.startswith("-"):      # the closing rule, the totals line
            continue
        value = fields[col]
        unit = value.lstrip("0123456789.")
        out[fields[0]] = out.get(fields[0], 0.0) + float(value[:len(value) - len(unit)]) * UNITS[unit]
    return out


def vllm_parts(ops: dict[str, float]) -> dict[str, float]:
    parts = {p: sum(t for name, t in ops.items() if any(k in name for k in keys))
             for p, keys in VLLM_PARTS.items()}
    parts["rest"] = sum(ops.values()) - sum(parts.values())
    return parts


def vs_vllm(args, wl) -> None:
    from minicb.entrypoints.llm import cpu_fast_paths
    from minicb.model.llama import DTYPES

    tables = sorted(pathlib.Path(args.vs_vllm).rglob("*profiler_out.txt"))
    if not tables:
        raise SystemExit(f"no *profiler_out.txt under {args.vs_vllm}; run bench/peer_vllm.py --profile-vllm")
    theirs = vllm_parts(read_vllm_table(tables[-1]))
    blocks: dict = {}
    model = load_smollm2(DTYPES[args.dtype], blocks)
    cpu_fast_paths(model, "cpu", gguf_blocks=blocks)   # what LLM() does for a model it loads itself
    ours = profile_run(model, wl, time.process_time)   # LLM()'s defaults; CPU seconds (a busy machine)
    ours["attention"] += ours.pop("gather") + ours.pop("kernel")
    print(f"machine: {machine_description()}; {args.dtype}; load average {os.getloadavg()[0]:.2f}")
    print(f"W2 ({len(wl.prompts)} requests): seconds per part; minicb: CPU seconds under cProfile; vLLM's "
          f"model worker: self time under the torch profiler ({tables[-1]})")
    total = sum(theirs.values())
    print(f"{'part':<11}{'minicb':>9}{'share':>7}{'vLLM':>9}{'share':>7}{'minicb/vLLM':>13}")
    for part in ("linear", "attention", "rest"):
        print(f"{part:<11}{ours[part]:>9.1f}{ours[part] / ours['total']:>7.0%}{theirs[part]:>9.1f}"
              f"{theirs[part] / total:>7.0%}{ours[part] / theirs[part]:>12.2f}x")
    print(f"{'total':<11}{ours['total']:>9.1f}{'':>7}{total:>9.1f}{'':>7}{ours['total'] / total:>12.2f}x")
    print("(vLLM's total: time inside profiled ops; its scheduler and front end run in other processes)")
    top = sorted(read_vllm_table(tables[-1]).items(), key=lambda kv: -kv[1])[:8]
    print("vLLM's largest ops: " + ", ".join(f"{name} {t:.1f} s" for name, t in top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--attn-backend", default="auto", choices=NAMES, help="minicb's attention backend")
    ap.add_argument("--vs-vllm", metavar="DIR", help="minicb (LLM() defaults) beside vLLM's profile in DIR")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="with --vs-vllm")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = w2(num=16) if args.quick else w2()
    if args.vs_vllm:
        vs_vllm(args, wl)
        return
    model = load_smollm2()
    backend = resolve_backend(args.attn_backend, "cpu", torch.float32, model.config.head_dim)
    cont = profile_run(model, wl, policy="continuous", max_num_seqs=64, max_num_batched_tokens=1024,
                       num_blocks=2048, attn_backend=backend)
    stat = profile_run(model, wl, policy="static", max_num_seqs=16, num_blocks=2048, attn_backend=backend)
    print(f"machine: {machine_description()}; minicb attention backend: {backend}")
    print(f"W2 ({len(wl.prompts)} requests), seconds under cProfile")
    print(f"{'part':<11}{'continuous':>11}{'static':>9}{'static/continuous':>19}")
    parts = [p for p in PARTS if cont[p] > 0] + ["rest"]          # the kernel only where it ran
    for part in [*parts, "total"]:
        print(f"{part:<11}{cont[part]:>11.1f}{stat[part]:>9.1f}{stat[part] / cont[part]:>18.2f}x")
    best = max(parts, key=lambda p: stat[p] / cont[p])
    print(f"ceiling: speeding a part up by the same factor in both policies cannot lift static/continuous "
          f"above {stat[best] / cont[best]:.2f}x ({best})")


if __name__ == "__main__":
    main()
