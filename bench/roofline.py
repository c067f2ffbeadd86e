"""How far a workload's steps are from what this machine allows: each step's time beside its floor.

    python bench/roofline.py                          # W2 and LP, bfloat16, torch's threads
    python bench/roofline.py --workloads LP --dtype float32 --threads 1
    python bench/roofline.py --peer-json bench/results/peers/X.json --bars W2=1.5,LP=1.3   # a bar's time

A step must do its arithmetic and read its bytes. Its arithmetic: every scheduled token through every
layer's products (2 x the layers' weights), the LM head for each sampled row, and attention (QK and PV:
4 x query heads x head_dim per key a query attends, every layer). Its bytes: the weights once (269 MB
for SmolLM2 in bfloat16) and the keys and values of every row's context. Two rates turn them into
time, both measured here on the threads the engine uses:

* the products' rate: the skinny kernel's best GFLOP/s on a [256, 576] x [576, 3072] product with its
  weights in the caches (what the chunk's and the batch's products can reach; in float32
  ``bench/cpu_ceilings.py`` puts the same kernel at 97% of a Zen 4 core's multiply-add peak);
* the read bandwidth: ``torch.sum`` over 256 MB (``decode_floor.read_bandwidth``).

Two floors per step: ``max`` (arithmetic and reading overlap perfectly: the roofline) and
``serial`` (one after the other, as a step whose parts meet at barriers does: products, then the
attention that reads the cache). Then it runs the workload through ``LLM()`` (its defaults, the prefix
cache emptied, EOS ignored), times every ``step()``, and prints per kind of step (prompt-bearing;
decode-only by rows) the time, both floors and the ratios. A workload whose steps sit near the
``serial`` floor has little left to win without overlapping the two (the arithmetic of one
micro-batch with the memory reads of another). The header names the CPU.

``--peer-json`` (``bench/peer_vllm.py --json``'s file: ``{dtype: {"W2/vllm-all": [{"seconds": ...}]}}``)
with ``--bars W2=1.5,...`` puts a bar beside the floors: the time a workload must take to be that many
times faster than the peer's median round (``--peer``, default ``vllm-all``), as a multiple of each
floor and of this run. A bar below the ``serial`` floor can only be met by overlapping the two kinds of
work; one near the ``max`` floor asks every step to be both at the products' best rate and at the
memory's, with nothing else (norms, sampling, scheduling, Python) taking any time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

import torch
from common import cpu_header
from cpu_ceilings import skinny_rate
from decode_floor import read_bandwidth
from workloads import WORKLOADS

from minicb import LLM, SamplingParams


def step_cost(seqs, cfg, elem: int) -> tuple[float, float]:
    """``(flops, bytes)`` of one step of ``seqs`` (``ScheduledSeq``-like: ``num_tokens``, ``start_pos``,
    ``sample``, ``context_len``) for a LLaMA ``cfg`` whose weights and cache are ``elem`` bytes a value."""
    h, layers, d = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    qd, kvd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (qd + 2 * kvd) + qd * h + 3 * h * cfg.intermediate_size
    flops = bytes_ = 0.0
    for s in seqs:
        keys = s.num_tokens * s.start_pos + s.num_tokens * (s.num_tokens + 1) // 2   # causal: p + 1 each
        flops += 2 * s.num_tokens * per_layer * layers + 4 * qd * keys * layers
        flops += 2 * h * cfg.vocab_size * s.sample
        bytes_ += s.context_len * 2 * kvd * elem * layers
    bytes_ += (per_layer * layers + h * cfg.vocab_size) * elem
    return flops, bytes_


def bar_seconds(peer: dict, dtype: str, workload: str, name: str, times: float) -> tuple[float, float]:
    """``(peer's median seconds, the time that is `times` x faster)`` for ``workload`` from a
    ``peer_vllm.py --json`` dict."""
    runs = sorted(r["seconds"] for r in peer[dtype][f"{workload}/{name}"])
    mid = len(runs) // 2
    median = runs[mid] if len(runs) % 2 else (runs[mid - 1] + runs[mid]) / 2
    return median, median / times


def kind_of(seqs) -> str:
    if any(s.num_tokens > 1 for s in seqs):
        return "prompt-bearing"
    n = len(seqs)
    return "decode 1-7 rows" if n < 8 else "decode 8-31 rows" if n < 32 else "decode 32+ rows"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W2,LP")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's choice)")
    ap.add_argument("--peer-json", help="peer_vllm.py --json's file: put --bars beside the floors")
    ap.add_argument("--peer", default="vllm-all", help="with --peer-json: the engine (default vllm-all)")
    ap.add_argument("--bars", default="W2=1.5,LP=1.3", help="with --peer-json: WORKLOAD=TIMES,...")
    args = ap.parse_args()
    peer = json.loads(pathlib.Path(args.peer_json).read_text()) if args.peer_json else None
    bars = {k: float(v) for k, v in (b.split("=") for b in args.bars.split(","))}
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rate, bw = skinny_rate(7, 256, 576, 3072, dtype) * 1e9, read_bandwidth() * 1e9
    print(f"{cpu_header()}; {os.cpu_count()} CPUs; {torch.get_num_threads()} threads; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"products {rate / 1e9:.0f} GFLOP/s, reading {bw / 1e9:.1f} GB/s ({args.dtype})")
    llm = LLM(dtype=args.dtype)
    eng, cfg = llm.engine, llm.engine.runner.model.config
    steps: list = []
    step = eng.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        if eng.last_plan is not None and eng.last_plan.seqs:
            steps.append((eng.last_plan.seqs, time.perf_counter() - t0))
        return out

    eng.step = timed_step
    for name in args.workloads.split(","):
        wl = WORKLOADS[name]()
        params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0) for o in wl.output_lens]
        llm.generate(wl.prompts[:2], params[:2], use_tqdm=False)          # warm up
        llm.reset_prefix_cache()
        steps.clear()
        llm.generate(wl.prompts, params, use_tqdm=False)
        rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
        for seqs, t in steps:
            flops, nbytes = step_cost(seqs, cfg, dtype.itemsize)
            for key in (kind_of(seqs), "all"):
                r = rows[key]
                r[0] += 1
                r[1] += t
                r[2] += max(flops / rate, nbytes / bw)
                r[3] += flops / rate + nbytes / bw
        print(f"\n{name} ({wl.num_output_tokens} output tokens): steps, seconds, floors (max / serial) "
              f"and the time over each")
        for key in sorted(rows, key=lambda k: (k == "all", k)):
            n, t, fmax, fser = rows[key]
            print(f"  {key:<16} {n:>5} steps {t:7.2f} s   max {fmax:6.2f} s {t / fmax:5.2f}x   "
                  f"serial {fser:6.2f} s {t / fser:5.2f}x   {1e3 * t / n:7.1f} ms a step")
        if peer is not None and name in bars:
            n, t, fmax, fser = rows["all"]
            theirs, goal = bar_seconds(peer, args.dtype, name, args.peer, bars[name])
            print(f"  the bar, {bars[name]:g}x {args.peer}'s {theirs:.2f} s (median of its rounds in "
                  f"{args.peer_json}): {goal:.2f} s = {goal / fmax:.2f}x the max floor, {goal / fser:.2f}x "
                  f"the serial floor; this run took {t / goal:.2f}x it")
    eng.step = step


if __name__ == "__main__":
    sys.exit(main())
