"""Benchmark one forward step of the real model (SmolLM2-135M, float32) on this machine.

    python bench/forward.py

Prints tokens/s of a decode step at 1, 8, 32 and 64 sequences (each with 128 cached tokens) and of a
512-token prefill, beside the machine's measured float32 matmul ceiling and the model's FLOPs per
token, so that achieved / ceiling can be quoted. Not a test: numbers depend on the machine.

A second table times only the matmuls of the 30 layers (Q, K, V, O, gate, up, down with the model's
own weights, one after another as in a step) for 16-64 rows, and fits ``time = a + b x rows``. The
layer weights (425 MB in float32) do not fit in any cache, so every step streams them from memory:
``a`` is that streaming (the bandwidth it implies is printed) and ``b`` is the compute per row (the
GFLOP/s it implies is printed). When ``a + b x rows`` fits well, the two happen one after the other,
not overlapped: a step of few rows pays ``a`` almost in full, and the per-row cost is the same
whatever the batch. That is the whole cost model of batching on this machine, and why the
continuous / static ratio of ``bench/throughput.py`` sits between the ratio of their rows and the
ratio of their steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import load_smollm2, machine_description, matmul_ceiling_gflops, median_time  # noqa: E402

from minicb.core.plan import ScheduledSeq, StepPlan  # noqa: E402
from minicb.measure.metrics import layer_matmul_params, matmul_flops, step_flops  # noqa: E402
from minicb.model.attention import ReferenceAttention  # noqa: E402
from minicb.model.kv_cache import KVCache  # noqa: E402
from minicb.runtime.packer import pack  # noqa: E402


def decode_plan(n_seqs: int, context: int, block_size: int) -> StepPlan:
    per = (context + block_size) // block_size + 1
    seqs = tuple(ScheduledSeq(str(i), i, (100 + i,), context, tuple(range(i * per, (i + 1) * per)), True)
                 for i in range(n_seqs))
    return StepPlan(0, seqs, block_size=block_size)


def prefill_plan(n_tokens: int, block_size: int) -> StepPlan:
    blocks = tuple(range((n_tokens + block_size - 1) // block_size))
    toks = tuple(range(1000, 1000 + n_tokens))
    return StepPlan(0, (ScheduledSeq("p", 0, toks, 0, blocks, True),), block_size=block_size)


def fit_line(points: dict[int, float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x`` through ``{x: y}``; returns ``a``, ``b`` and the largest relative
    distance of a point from the line."""
    xs = list(points)
    n = len(xs)
    mx, my = sum(xs) / n, sum(points.values()) / n
    b = sum((x - mx) * (points[x] - my) for x in xs) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(points[x] - (a + b * x)) / points[x] for x in xs)


def layer_matmul_sweep(model, rows=(16, 32, 48, 64), repeats: int = 3) -> dict:
    """Seconds of one step's layer matmuls per row count, and the line ``a + b x rows`` through them."""
    weights = []
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        weights += [m.weight for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj,
                                       mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    times = {}
    for m in rows:
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights}

        def step(xs=xs):
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        times[m] = median_time(step, repeats=repeats)
    a, b, worst = fit_line(times)
    weight_bytes = layer_matmul_params(model.config) * weights[0].element_size()
    flops_per_row = matmul_flops(model.config, 1, 0)
    readable = a > 0 and b > 0    # a line that does not slope up (a tiny model, a noisy machine) says nothing
    return {"rows": {str(m): t for m, t in times.items()}, "a_s": a, "b_s_per_row": b,
            "weight_bytes": weight_bytes, "flops_per_row": flops_per_row,
            "stream_gb_per_s": weight_bytes / a / 1e9 if readable else None,
            "compute_gflops": flops_per_row / b / 1e9 if readable else None,
            "fit_worst_rel_error": worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_smollm2()
    cfg = model.config
    bs, ctx = 16, 128
    kv = KVCache(cfg.num_hidden_layers, 64 * ((ctx + bs) // bs + 1), bs, cfg.num_key_value_heads,
                 cfg.head_dim, torch.float32)
    backend = ReferenceAttention(kv)
    rows = []
    cases = [("decode", n, decode_plan(n, ctx, bs)) for n in (1, 8, 32, 64)]
    cases.append(("prefill", 512, prefill_plan(512, bs)))
    for kind, n, plan in cases:
        batch = pack(plan)

        def step(batch=batch):
            model(batch.input_ids, batch.positions, backend, batch.attn, batch.logits_indices)

        t = median_time(step, repeats=args.repeats)
        gflops = step_flops(plan, cfg) / t / 1e9
        rows.append({"kind": kind, "tokens": n, "step_ms": t * 1e3, "tokens_per_s": n / t,
                     "gflops": gflops})
    ceiling = max(matmul_ceiling_gflops() for _ in range(3))   # after the runs, best of three
    for r in rows:
        r["of_ceiling"] = r["gflops"] / ceiling
    print(f"machine: {machine_description()}")
    print(f"float32 matmul ceiling: {ceiling:.1f} GFLOP/s")
    print(f"model: SmolLM2-135M, {cfg.num_params / 1e6:.1f} M parameters, "
          f"{cfg.flops_per_token(0) / 1e6:.1f} MFLOP per token (+ attention)")
    print(f"{'step':<10}{'tokens':>8}{'ms/step':>10}{'tokens/s':>11}{'GFLOP/s':>10}{'of ceiling':>12}")
    for r in rows:
        print(f"{r['kind']:<10}{r['tokens']:>8}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.1f}"
              f"{r['gflops']:>10.1f}{r['of_ceiling']:>11.1%}")
    sweep = layer_matmul_sweep(model)
    print()
    print(f"layer matmuls of one step (30 layers x 7 weights, {sweep['weight_bytes'] / 1e6:.0f} MB), "
          "by rows:")
    print("  " + "   ".join(f"{m} rows {t * 1e3:.1f} ms" for m, t in sweep["rows"].items()))
    fit = (f"  fit: {sweep['a_s'] * 1e3:.1f} ms + {sweep['b_s_per_row'] * 1e3:.2f} ms x rows "
           f"(worst point off by {sweep['fit_worst_rel_error']:.1%}): ")
    if sweep["stream_gb_per_s"]:
        fit += (f"weights streamed at {sweep['stream_gb_per_s']:.1f} GB/s, then computed at "
                f"{sweep['compute_gflops']:.0f} GFLOP/s")
    else:
        fit += "no positive streaming and compute terms to read off"
    print(fit)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"ceiling_gflops": ceiling, "rows": rows,
                                                       "layer_matmuls": sweep}, indent=2))


if __name__ == "__main__":
    main()
