"""Validate the ``smollm2-135m`` simulation against a measured ``minicb bench`` run on this CPU.

    minicb bench --clock cpu --policy all ... --out bench/out/validate      # the measured run
    python bench/validate_sim.py bench/out/validate/bench.json --md bench/out/validate/validation.md

Two comparisons, both against the very run in ``bench.json`` (same requests, same arrival times, same
scheduler limits):

1. **Step times.** Every step's plan is stored in ``bench.json`` (its rows' start positions, token
   counts, sampling, and the padding rows). The cost model prices each plan and the price is compared
   with the step's measured duration: median and 90th-percentile relative error, and the error of the
   total, for steps with prompt tokens and for decode-only steps.
2. **The table.** ``minicb.simulate.simulate`` runs the same requests through a fresh ``Scheduler`` on
   the simulated clock, and its table (throughput, queueing delay, TTFT, inter-token latency, padding
   waste, compute utilisation against the run's measured ceiling) is compared with the measured one.

The bar (issue 5): within 25%. The script prints Markdown tables (``--md`` writes them to a file too).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from minicb.core.config import SchedulerConfig
from minicb.measure.bench_cli import shape_plan
from minicb.measure.metrics import percentile
from minicb.measure.workloads import Request
from minicb.simulate.simulator import load_calibration, preset, simulate

FIGURES = (("throughput (tok/s)", "output_tokens_per_s", 1.0),
           ("compute util (%)", "compute_utilisation", 100.0),
           ("mean queueing delay (ms)", "queueing_delay_mean", 1e3),
           ("TTFT P50 (ms)", "ttft_p50", 1e3),
           ("TTFT P99 (ms)", "ttft_p99", 1e3),
           ("ITL P50 (ms)", "itl_p50", 1e3),
           ("ITL P99 (ms)", "itl_p99", 1e3),
           ("padding waste (%)", "padding_waste", 100.0),
           ("duration (s)", "duration", 1.0))


def step_errors(cost, run: dict) -> dict:
    out = {}
    pairs = []
    for shape, step in zip(run["plans"], run["steps"], strict=True):
        plan = shape_plan(shape)
        pairs.append((plan, cost.step_time(plan), step["end"] - step["start"]))
    groups = {"all steps": pairs,
              "steps with prompt tokens": [p for p in pairs if any(s.num_tokens > 1 or s.start_pos == 0
                                                                   for s in p[0].seqs)],
              "decode-only steps": [p for p in pairs if all(s.num_tokens == 1 and s.start_pos > 0
                                                            for s in p[0].seqs)]}
    for name, ps in groups.items():
        if not ps:
            continue
        rel = [pred / meas - 1 for _, pred, meas in ps]
        absolute = [abs(r) for r in rel]
        out[name] = {"steps": len(ps), "median_abs": percentile(absolute, 50),
                     "p90_abs": percentile(absolute, 90), "median_signed": statistics.median(rel),
                     "total": sum(p for _, p, _ in ps) / sum(m for _, _, m in ps) - 1,
                     "measured_ms_median": 1e3 * statistics.median(m for _, _, m in ps),
                     "simulated_ms_median": 1e3 * statistics.median(p for _, p, _ in ps),
                     # how much the step times spread (P90 / P10): the model's spread comes from the
                     # plans alone; what the measurement adds on top is the machine's noise
                     "measured_spread": _spread([m for _, _, m in ps]),
                     "simulated_spread": _spread([p for _, p, _ in ps])}
    return out


def _spread(xs: list[float]) -> float:
    return percentile(xs, 90) / percentile(xs, 10)


def fmt(x, scale):
    return "-" if x is None else f"{x * scale:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench_json")
    ap.add_argument("--calibration", help="a bench/calibrate_cpu.py JSON (default: the shipped one)")
    ap.add_argument("--md", help="also write the Markdown here")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    blob = json.loads(pathlib.Path(args.bench_json).read_text())
    meta = blob["meta"]
    cal = load_calibration(args.calibration) if args.calibration else None
    cost = preset("smollm2-135m", calibration=cal)
    peak = meta["peak_gflops"] * 1e9
    requests = [Request(r["id"], r["prompt_len"], r["output_len"], r["arrival"]) for r in meta["workload"]]
    lines = [f"Measured run: `{args.bench_json}` ({meta['date']}, {meta['args']['clock']} clock; "
             f"{meta['machine']}). Cost model: `smollm2-135m` calibrated {cost.description}.", ""]
    lines += ["**Step times** (each measured step's plan priced by the cost model; error = simulated / "
              "measured - 1):", "",
              "| policy | steps | median measured ms | median simulated ms | median abs error "
              "| P90 abs error | error of the total | spread P90/P10 measured / simulated |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    result = {"steps": {}, "table": {}}
    sims = {}
    for policy, run in blob["runs"].items():
        errs = step_errors(cost, run)
        result["steps"][policy] = errs
        for name, e in errs.items():
            lines.append(f"| {policy} | {name}: {e['steps']} | {e['measured_ms_median']:,.0f} | "
                         f"{e['simulated_ms_median']:,.0f} | {100 * e['median_abs']:.1f}% | "
                         f"{100 * e['p90_abs']:.1f}% | {100 * e['total']:+.1f}% | "
                         f"{e['measured_spread']:.2f} / {e['simulated_spread']:.2f} |")
        sims[policy] = simulate(requests, SchedulerConfig(policy=policy, **meta["scheduler"]), cost,
                                label=policy).summary
    lines += ["", "**The table** (measured by `minicb bench` vs simulated by "
              "`minicb.simulate.simulator` on the same requests and arrivals; compute utilisation of "
              "both against the run's measured ceiling, "
              f"{meta['peak_gflops']:.1f} GFLOP/s):", ""]
    head = "| figure | " + " | ".join(f"{p} measured | {p} simulated | error" for p in blob["runs"]) + " |"
    lines += [head, "|---|" + "---:|" * (3 * len(blob["runs"]))]
    for title, field, scale in FIGURES:
        cells = []
        for policy, run in blob["runs"].items():
            m = run["summary"][field]
            s = getattr(sims[policy], field)
            if field == "compute_utilisation":
                s = sims[policy].useful_flops / sims[policy].duration / peak
            err = None if (m in (None, 0) or s is None) else s / m - 1
            result["table"].setdefault(policy, {})[field] = {"measured": m, "simulated": s, "error": err}
            e = "-" if err is None else f"{100 * err:+.0f}%"
            cells.append(f"{fmt(m, scale)} | {fmt(s, scale)} | {e}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        pathlib.Path(args.md).write_text(text + "\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
