"""What the fused CPU ops (``minicb.fastpaths.cpu_fused``) save: per op, and on a cold W2 run.

    python bench/fused_ops.py --micro            # each op at a decode step's and a prefill step's shape
    python bench/fused_ops.py --ab --rounds 3     # W2 (SmolLM2, float32): fused against reference ops
    python bench/fused_ops.py --ab --dtype bfloat16 --num 16

``--micro`` times RMSNorm, the residual add with the RMSNorm after it, the rotary embedding of q and k
and SiLU-and-mul, the reference ops of ``llama.py`` against the fused ones, best of 5 loops, one
thread, at 64 rows (a decode step of W2) and 2,048 rows (a prefill step at ``LLM()``'s token budget),
in float32 (``--dtype bfloat16``: bfloat16), and adds up what they save on a step of SmolLM2 (30
layers: each op once, and the final norm).

``--ab`` loads the model twice, one copy switched to the fused ops, and alternates the two on W2 in one
process (one engine each, ``LLM()``'s defaults), emptying each engine's prefix cache before every run
so that every round computes its prompts in full. It prints tokens/s and CPU seconds per round, their
medians, and how many requests gave identical tokens.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import load_smollm2, machine_description  # noqa: E402
from workloads import w2  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402
from minicb.fastpaths import cpu_fused  # noqa: E402
from minicb.model.llama import RMSNorm, apply_rope, rope_cos_sin  # noqa: E402


def best_us(fn, n: int = 300) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def op_times(rows: int, dtype: torch.dtype = torch.float32) -> dict[str, tuple[float, float]]:
    """{op: (reference us, fused us)} at ``rows`` tokens of SmolLM2's shapes."""
    x, d, w = (torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype), torch.ones(576).to(dtype))
    norm = RMSNorm(576, 1e-5).to(dtype)
    q, k = torch.randn(rows, 9, 64).to(dtype), torch.randn(rows, 3, 64).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(rows), 64, 1e5, dtype)
    gate_up = torch.randn(rows, 2 * 1536).to(dtype)
    g, u = gate_up.split(1536, dim=-1)
    return {
        "rmsnorm": (best_us(lambda: norm(x)), best_us(lambda: cpu_fused.rms_norm(x, w, 1e-5))),
        "add + norm": (best_us(lambda: norm(x + d)), best_us(lambda: cpu_fused.add_rms_norm_(x, d, w, 1e-5))),
        "rope q, k": (best_us(lambda: (apply_rope(q, cos, sin), apply_rope(k, cos, sin))),
                      best_us(lambda: cpu_fused.rope_(q, k, cos, sin))),
        "silu * up": (best_us(lambda: F.silu(g) * u), best_us(lambda: cpu_fused.silu_mul(gate_up, 1536))),
    }


def micro(dtype: torch.dtype = torch.float32) -> None:
    print(f"machine: {machine_description()}; one thread; {dtype}; microseconds per call, best of 5 loops")
    print(f"{'rows':>5}  {'op':<12}{'reference':>10}{'fused':>9}")
    for rows in (64, 2048):
        pairs = op_times(rows, dtype)
        for name, (ref, fused) in pairs.items():
            print(f"{rows:>5}  {name:<12}{ref:>10.1f}{fused:>9.1f}")
        # a layer runs each op once (its first norm alone, its second after the residual add); then
        # the final norm
        norm_ref, norm_fused = pairs["rmsnorm"]
        saved = sum(30 * (ref - fused) for ref, fused in pairs.values()) + norm_ref - norm_fused
        print(f"{rows:>5}  a step of SmolLM2 (30 layers and the final norm) saves {saved / 1e3:.2f} ms")


def ab(args) -> None:
    dtype = getattr(torch, args.dtype)
    wl = w2(num=args.num)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    reference, fused = load_smollm2(dtype), load_smollm2(dtype)
    os.environ["MINICB_FUSED_OPS"] = "0"
    cpu_fast_paths(reference, "cpu")            # bfloat16: float32 linears, as LLM() does; no fused ops
    del os.environ["MINICB_FUSED_OPS"]
    print("fused copy:", cpu_fast_paths(fused, "cpu"))
    engines = {"reference": LLM(reference), "fused": LLM(fused)}
    cpu = {name: [] for name in engines}
    tokens = {}
    for rnd in range(args.rounds):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            t, c = time.perf_counter(), time.process_time()
            outs = llm.generate(wl.prompts, params)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            tokens[name] = [o.token_ids for o in outs]
            cpu[name].append(dc)
            print(f"  round {rnd + 1} {name:<9} {wl.num_output_tokens / dt:6.1f} tokens/s  {dc:5.1f} CPU s",
                  flush=True)
    same = sum(a == b for a, b in zip(tokens["reference"], tokens["fused"]))
    print(f"machine: {machine_description()}; {args.dtype}; W2 ({len(wl.prompts)} requests); load average "
          f"{os.getloadavg()[0]:.2f} at the end")
    for name, secs in cpu.items():
        rounds = ", ".join(f"{x:.1f}" for x in secs)
        print(f"{name:<9} median {statistics.median(secs):5.1f} CPU s  ({rounds})")
    print(f"identical outputs: {same}/{len(wl.prompts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro", action="store_true", help="time each op (default when --ab is not given)")
    ap.add_argument("--ab", action="store_true", help="fused against reference ops on W2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num", type=int, default=64, help="W2 requests (default all 64)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    if cpu_fused.unavailable_reason():
        raise SystemExit(f"the fused ops do not build here: {cpu_fused.unavailable_reason()}")
    if args.micro or not args.ab:
        micro(getattr(torch, args.dtype))
    if args.ab:
        ab(args)


if __name__ == "__main__":
    main()
