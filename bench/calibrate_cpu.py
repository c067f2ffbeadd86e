"""Calibrate the ``smollm2-135m`` cost model of ``minicb simulate`` on this machine.

    python bench/calibrate_cpu.py                      # ~3 min; one torch thread, process CPU time
    python bench/calibrate_cpu.py --write              # and replace minicb/data/calibration/smollm2_cpu.json
    python bench/calibrate_cpu.py --refit FILE --write # fit again from stored measurements

What it measures (all with ``torch.set_num_threads(1)``, SmolLM2-135M in float32, the reference
attention backend the engine uses on the CPU):

1. the forward steps of ``bench/forward.py`` (decode at 1, 8, 32, 64 sequences with 128 cached tokens,
   a 512-token prefill), plus decodes at other context lengths, shorter prefills, a prefill chunk
   beside decodes and a padded static-batch prefill, so every term of the model is exercised;
2. the machine's float32 matmul ceiling (as ``bench/common.py``, on the same clock) and a large-copy
   memory bandwidth;
3. the engine's own per-step cost outside the forward (schedule, pack, sample, update) with the tiny
   random model, as a fixed part plus a part per sequence.

Then it fits the step-time model of ``minicb.simulate.CostModel`` (``overlap=False``: on one core the
compute and memory terms add) by non-negative least squares on relative errors::

    t_forward = linear FLOPs / (ceiling x compute_eff) + weight and activation bytes / (bandwidth x
                memory_eff) + attention FLOPs / (ceiling x attn_eff) + attention K/V bytes / (bandwidth
                x attn_memory_eff) + linear ops x op_launch + attention calls x attn_group

and prints every case's measured and fitted time. Not a test: numbers depend on the machine and on
what else runs on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import load_smollm2  # noqa: E402
from forward import decode_plan, prefill_plan  # noqa: E402

from minicb.core.plan import ScheduledSeq, StepPlan  # noqa: E402
from minicb.measure.bench_cli import machine_description, matmul_ceiling_gflops  # noqa: E402
from minicb.model.attention import ReferenceAttention  # noqa: E402
from minicb.model.kv_cache import KVCache  # noqa: E402
from minicb.runtime.packer import pack  # noqa: E402
from minicb.simulate.simulator import SMOLLM2_135M, CostModel, Device  # noqa: E402

OUT = HERE.parent / "src" / "minicb" / "data" / "calibration" / "smollm2_cpu.json"
BS = 16
CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
clock = time.process_time


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median of ``repeats`` timings on ``clock`` (process CPU time by default: on a shared machine
    other processes do not inflate it; with one torch thread it is the forward's own work)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def mixed_plan(chunk: int, n_dec: int, ctx: int) -> StepPlan:
    per = (ctx + chunk) // BS + 2
    seqs = [ScheduledSeq("p", 0, tuple(range(1000, 1000 + chunk)), 0, tuple(range(per)), True)]
    seqs += [ScheduledSeq(str(i), i + 1, (100 + i,), ctx, tuple(range((i + 1) * per, (i + 2) * per)), True)
             for i in range(n_dec)]
    return StepPlan(0, tuple(seqs), block_size=BS)


def padded_prefill_plan(lens: list[int]) -> StepPlan:
    """A static batch's first step: prompts of ``lens`` padded to the longest."""
    longest = max(lens)
    per = longest // BS + 2
    seqs = tuple(ScheduledSeq(str(i), i, tuple(range(1000, 1000 + n)), 0,
                              tuple(range(i * per, (i + 1) * per)), True) for i, n in enumerate(lens))
    return StepPlan(0, seqs, padding=tuple(longest - n for n in lens if longest - n), block_size=BS)


def padded_decode_plan(n: int, n_pad: int, ctx: int) -> StepPlan:
    """A padded batch's decode step: ``n`` decodes and ``n_pad`` one-token padding rows."""
    return replace(decode_plan(n, ctx, BS), padding=(1,) * n_pad)


def cases() -> list[tuple[str, StepPlan]]:
    out = [(f"decode {n} @128", decode_plan(n, 128, BS)) for n in (1, 8, 32, 64)]     # bench/forward.py
    out.append(("prefill 512", prefill_plan(512, BS)))                                # bench/forward.py
    out += [(f"decode {n} @{c}", decode_plan(n, c, BS)) for n, c in ((8, 32), (32, 32), (8, 512), (32, 512))]
    # the small decode steps a lightly loaded server runs most of the time
    out += [(f"decode {n} @{c}", decode_plan(n, c, BS)) for n, c in ((2, 48), (4, 32), (12, 40), (16, 64),
                                                                     (24, 48))]
    out += [(f"prefill {n}", prefill_plan(n, BS)) for n in (32, 128, 256)]
    out += [("chunk 128 + 16 decodes @256", mixed_plan(128, 16, 256)),
            ("padded prefill 8 rows", padded_prefill_plan([12, 40, 64, 20, 8, 33, 64, 50]))]
    # small steps of two and three attention groups (chunked-prefill steps, padded decode steps)
    out += [("chunk 8 + 8 decodes @48", mixed_plan(8, 8, 48)),
            ("chunk 4 + 4 decodes @32", mixed_plan(4, 4, 32)),
            ("decode 4 + 4 padding rows @48", padded_decode_plan(4, 4, 48)),
            ("decode 16 + 8 padding rows @48", padded_decode_plan(16, 8, 48)),
            ("chunk 8 + 4 decodes + 2 padding", replace(mixed_plan(8, 4, 32), padding=(1, 1)))]
    return out


def memory_bandwidth_gbs(mb: int = 256, repeats: int = 5) -> float:
    """Large-tensor copy: (read + write) bytes / best time."""
    x = torch.empty(mb * 2**20 // 4, dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        y.copy_(x)
        best = min(best, clock() - t0)
    return 2 * x.numel() * 4 / best / 1e9


def time_forward(model, plan: StepPlan, repeats: int) -> float:
    cfg = model.config
    nblocks = max((max(s.block_table) for s in plan.seqs), default=0) + 1
    kv = KVCache(cfg.num_hidden_layers, nblocks, BS, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    backend = ReferenceAttention(kv)
    batch = pack(plan)

    def step():
        model(batch.input_ids, batch.positions, backend, batch.attn, batch.logits_indices)

    return median_time(step, repeats=repeats)


def engine_overhead(repeats: int = 30) -> list[tuple[int, float]]:
    """(sequences, seconds outside the forward) of decode steps of the engine with the tiny model."""
    from minicb.core.config import SchedulerConfig
    from minicb.core.sampling_params import SamplingParams
    from minicb.measure.bench_cli import build_model
    from minicb.runtime.runner import engine_for

    model, _ = build_model("tiny", "float32")
    out = []
    for n in (1, 4, 8, 16):
        eng = engine_for(model, SchedulerConfig(max_num_seqs=n, num_blocks=256, max_model_len=512), seed=0)
        for i in range(n):
            eng.add_request(f"r{i}", [5 + i] * 8, SamplingParams(max_tokens=repeats + 4, ignore_eos=True))
        eng.step()                                   # the prefill
        step_t, fwd_t = [], []
        for _ in range(repeats):
            t0 = clock()
            eng.step()
            step_t.append(clock() - t0)
            plan = eng.last_plan
            fwd_t.append(time_forward(model, plan, 1))
        out.append((n, max(statistics.median(step_t) - statistics.median(fwd_t), 0.0)))
    return out


def fit(points, ceiling: float, bw: float) -> dict:
    """Non-negative least squares on relative error (rows divided by the measured time), with every
    efficiency at most 1 (nothing beats the measured ceiling or the copy bandwidth): each coefficient
    is 1 + a non-negative excess."""
    from scipy.optimize import nnls

    base = CostModel("fit", SMOLLM2_135M, Device("cpu", ceiling, bw, 8e9, overlap=False), dtype_bytes=4,
                     attention="grouped")
    rows, ts = [], []
    for _, plan, t in points:
        f = base.features(plan)
        rows.append([f["linear_flops"] / ceiling, (f["linear_bytes"] + f["elementwise_bytes"]) / bw,
                     f["attn_flops"] / ceiling, f["attn_bytes"] / bw, f["linear_ops"], f["attn_calls"]])
        ts.append(t)
    a, t = np.array(rows), np.array(ts)
    floor = a[:, :4].sum(axis=1)              # every efficiency at 1
    coef, _ = nnls(a / t[:, None], 1 - floor / t)
    u_c, u_m, u_a, u_am = (1 + float(x) for x in coef[:4])
    return {"ceiling_gflops": ceiling / 1e9, "mem_bw_gbs": bw / 1e9, "compute_eff": 1 / u_c,
            "memory_eff": 1 / u_m, "elementwise_eff": 1 / u_m, "attn_eff": 1 / u_a,
            "attn_memory_eff": 1 / u_am, "op_launch_s": float(coef[4]), "elementwise_launch_s": 0.0,
            "attn_group_s": float(coef[5])}


def measure(args) -> dict:
    """Run every measurement; returns the raw numbers (what --refit reads back)."""
    torch.set_num_threads(1)
    model = load_smollm2()
    ceiling = matmul_ceiling_gflops(clock=clock) * 1e9
    bw = memory_bandwidth_gbs() * 1e9
    print(f"machine: {machine_description()}")
    print(f"float32 matmul ceiling {ceiling / 1e9:.1f} GFLOP/s, copy bandwidth {bw / 1e9:.1f} GB/s",
          flush=True)
    cases_t = {}
    for name, plan in cases():
        cases_t[name] = time_forward(model, plan, args.repeats)
        print(f"  {name:<34} {1e3 * cases_t[name]:9.1f} ms", flush=True)
    over = engine_overhead()
    print("engine overhead outside the forward: " + ", ".join(f"{n} seqs {1e3 * t:.2f} ms" for n, t in over))
    return {"measured_ceiling_gflops": ceiling / 1e9, "measured_bw_gbs": bw / 1e9,
            "machine": machine_description(), "date": datetime.date.today().isoformat(),
            "clock": args.clock, "cases": cases_t, "engine_overhead": {str(n): t for n, t in over}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(HERE.parent)}")
    ap.add_argument("--json", help="write the calibration here")
    ap.add_argument("--clock", default="cpu", choices=list(CLOCK),
                    help="cpu: process CPU time (default; matches minicb bench --clock cpu), wall: real time")
    ap.add_argument("--refit", metavar="JSON", help="fit again from the measurements stored in a calibration "
                                                    "JSON instead of measuring")
    args = ap.parse_args()
    global clock
    clock = CLOCK[args.clock]
    if args.refit:
        raw = json.loads(pathlib.Path(args.refit).read_text())
    else:
        raw = measure(args)
    plans = dict(cases())
    points = [(name, plans[name], t) for name, t in raw["cases"].items()]
    over = sorted((int(n), t) for n, t in raw["engine_overhead"].items())
    slope, icpt = np.polyfit([n for n, _ in over], [t for _, t in over], 1)
    cal = fit(points, raw["measured_ceiling_gflops"] * 1e9, raw["measured_bw_gbs"] * 1e9)
    cal["step_overhead_s"] = max(float(icpt), 0.0)
    cal["seq_overhead_s"] = max(float(slope), 0.0)
    keep = ("measured_ceiling_gflops", "measured_bw_gbs", "machine", "date", "clock", "cases",
            "engine_overhead")
    cal.update({k: raw[k] for k in keep})
    wall = " --clock wall" if raw["clock"] == "wall" else ""
    cal["command"] = "python bench/calibrate_cpu.py --write" + wall
    from minicb.simulate.simulator import preset

    cm = preset("smollm2-135m", calibration=cal)
    print(f"fit: compute_eff {cal['compute_eff']:.3f} of {cal['ceiling_gflops']:.1f} GFLOP/s, memory_eff "
          f"{cal['memory_eff']:.3f} of {cal['mem_bw_gbs']:.1f} GB/s, attn_eff {cal['attn_eff']:.3f}, "
          f"attn_memory_eff {cal['attn_memory_eff']:.3f}, launch {1e6 * cal['op_launch_s']:.1f} us/op, "
          f"{1e6 * cal['attn_group_s']:.0f} us per attention call, step overhead "
          f"{1e3 * cal['step_overhead_s']:.2f} ms "
          f"+ {1e3 * cal['seq_overhead_s']:.3f} ms/seq")
    print(f"{'case':<34}{'measured ms':>12}{'model ms':>10}{'error':>8}")
    errs = []
    for name, plan, t in points:
        p = cm.step_time(plan) - cm.breakdown(plan)["overhead"]
        errs.append(abs(p / t - 1))
        print(f"{name:<34}{1e3 * t:>12.1f}{1e3 * p:>10.1f}{100 * (p / t - 1):>7.1f}%")
    cal["fit_median_abs_error"] = statistics.median(errs)
    cal["fit_max_abs_error"] = max(errs)
    print(f"median |error| {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%")
    text = json.dumps(cal, indent=1)
    if args.json:
        pathlib.Path(args.json).write_text(text)
    if args.write:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(text + "\n")
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
