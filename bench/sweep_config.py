"""``LLM()``'s defaults against other scheduler settings on W1 and W2: are the defaults the fast ones?

    python bench/sweep_config.py                      # float32, 2 rounds (about 15 min here)
    python bench/sweep_config.py --dtype bfloat16 --repeats 1 --configs 256/2048,64/1024
    python bench/sweep_config.py --configs default@t1,default@t2      # one torch thread against two
    python bench/sweep_config.py --configs default@t2,default@t2@reference   # ... per attention backend

Every configuration (``max_num_seqs/max_num_batched_tokens``; ``default`` is ``LLM()`` with nothing
set: slots, budget, KV pool and attention backend all chosen by minicb; a suffix ``@tN`` runs it with N
torch threads) runs each workload of ``bench/workloads.py`` (SmolLM2-135M, greedy, EOS ignored) once per
round, round-robin, ``--threads`` torch threads unless the name says otherwise. The table gives each
configuration's median tokens/s and its ratio to the best median of the workload: the defaults are
"fast" when they are within 5% of the best.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import load_smollm2, machine_description  # noqa: E402
from workloads import w1, w2  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402
from minicb.model.llama import DTYPES  # noqa: E402

CONFIGS = "default,16/512,64/1024,256/512,256/4096"


def parse(name: str) -> dict:
    """``"64/1024@t2@reference"`` -> the ``LLM()`` keywords (``@tN``: threads, read by ``threads_of``;
    any other ``@name``: the attention backend)."""
    base, *tags = name.split("@")
    out = {} if base == "default" else dict(zip(("max_num_seqs", "max_num_batched_tokens"),
                                                 map(int, base.split("/"))))
    for t in tags:
        if not (t.startswith("t") and t[1:].isdigit()):
            out["attn_backend"] = t
    return out


def threads_of(name: str, default: int) -> int:
    tags = [t for t in name.split("@")[1:] if t.startswith("t") and t[1:].isdigit()]
    return int(tags[0][1:]) if tags else default


def run(model, wl, config: dict) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second) of one ``generate`` over ``wl``."""
    llm = LLM(model, **config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(wl.prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert sum(len(o.token_ids) for o in outs) == wl.num_output_tokens
    return wl.num_output_tokens / dt, wl.num_output_tokens / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", default="W1,W2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    blocks: dict = {}                 # the GGUF's blocks, which LLM() hands the fast paths
    model = load_smollm2(DTYPES[args.dtype], blocks)
    cpu_fast_paths(model, "cpu", gguf_blocks=blocks)   # what LLM() does for a model it loads itself
    names = args.configs.split(",")
    wls = [w for w in (w1(), w2()) if w.name in args.workloads.split(",")]
    run(model, w1(num=2, new_tokens=4), {})         # first-call costs out of the way
    tps: dict[tuple[str, str], list[float]] = {(wl.name, n): [] for wl in wls for n in names}
    per_cpu: dict[tuple[str, str], list[float]] = {(wl.name, n): [] for wl in wls for n in names}
    for rnd in range(args.repeats):
        for wl in wls:
            for name in names:
                torch.set_num_threads(threads_of(name, args.threads))
                wall, cpu = run(model, wl, parse(name))
                tps[wl.name, name].append(wall)
                per_cpu[wl.name, name].append(cpu)
                print(f"  round {rnd + 1} {wl.name} {name:<10} {wall:7.1f} tokens/s {cpu:7.1f} per CPU s",
                      flush=True)
    print(f"\nmachine: {machine_description()}; {args.dtype}; load average {os.getloadavg()[0]:.2f} "
          "at the end")
    default = LLM(model).engine.config
    print(f"default = max_num_seqs {default.max_num_seqs}, max_num_batched_tokens "
          f"{default.max_num_batched_tokens}, num_blocks {default.num_blocks}, attention "
          f"{LLM(model).engine.runner.backend.name}")
    print(f"{'workload':<9}{'config':<11}{'tokens/s':>9}{'range':>18}{'of best':>9}{'per CPU s':>11}"
          f"{'of best':>9}")
    for wl in wls:
        med = {n: statistics.median(tps[wl.name, n]) for n in names}
        cpu = {n: statistics.median(per_cpu[wl.name, n]) for n in names}
        best, best_cpu = max(med.values()), max(cpu.values())
        for n in names:
            lo, hi = min(tps[wl.name, n]), max(tps[wl.name, n])
            print(f"{wl.name:<9}{n:<11}{med[n]:>9.1f}{lo:>10.1f} - {hi:<6.1f}{med[n] / best:>8.0%}"
                  f"{cpu[n]:>11.1f}{cpu[n] / best_cpu:>8.0%}")


if __name__ == "__main__":
    main()
