"""``minicb simulate``: the benchmark table at any scale, from the real scheduler and a cost model.

    minicb simulate                  # llama-3-70b on 8 x A100-80GB: 200 requests at 2, 8 and 16 req/s
    minicb simulate --full           # the full table: 1,000 requests at 2, 4, 8, 12, 16 req/s (minutes)
    minicb simulate --preset llama-3-8b --rates 5,10,20,40
    minicb simulate --preset smollm2-135m --max-prompt 32 --output-div 8 --max-output 32 --min-len 1 \\
        --max-total 0 --max-num-seqs 24 --max-num-batched-tokens 12 --long-prefill-chunk 8 \\
        --num-requests 32 --rates 0.5,1,1.5,2                 # this CPU, the measured table's settings

For every arrival rate and policy it runs ``minicb.simulate.simulate`` (the engine's ``Scheduler``
on a simulated clock; Poisson arrivals in simulated time) and prints the table; ``--out`` gets
``simulate.json`` and ``curve.png`` (throughput against P99 inter-token latency and P99 TTFT, one line
per policy), plus the throughput bars, latency CDFs and slot occupancy of ``--plot-rate``.
Torch-free. The cost is the scheduler's own: about 8 us per scheduled sequence per step on this
machine, so 1,000 ShareGPT requests (about 350,000 sequence-steps) take 2-4 s per policy and rate;
the default (200 requests, three rates: 1,800 simulated requests) takes 5 s of CPU on the 2-core
AMD EPYC VM (``python bench/readme_times.py``), ``--full`` (15,000) several minutes. Progress goes
to stderr (``minicb.measure.progress``): one line per policy and rate, and a heartbeat every few
seconds when stderr is not a terminal.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from minicb.core.errors import InvalidArgument, check_float, check_int
from minicb.measure.bench_cli import POLICY_ORDER, add_workload_args
from minicb.measure.metrics import format_table, records_to_json

DEFAULT_REQUESTS, DEFAULT_RATES = 200, "2,8,16"        # 5 s of CPU here (bench/readme_times.py)
FULL_REQUESTS, FULL_RATES = 1000, "2,4,8,12,16"        # --full: 15,000 simulated requests, minutes


def add_parser(sub) -> None:
    from minicb.simulate.simulator import PRESETS

    p = sub.add_parser("simulate", help="simulate the benchmark table at scale (cost model, same scheduler)",
                       description="Drive minicb's Scheduler with a cost-model executor on a simulated "
                                   "clock: the benchmark table of the static-batching note per "
                                   "policy and arrival rate, and a "
                                   "throughput-latency curve.")
    add_workload_args(p, num_requests=None)
    p.set_defaults(min_len=4, max_total=2048)     # the usual ShareGPT filter (SOURCES.md)
    p.add_argument("--full", action="store_true",
                   help=f"the full run: {FULL_REQUESTS:,} requests per rate at {FULL_RATES} req/s "
                        f"(15,000 simulated requests, minutes), unless --num-requests / --rates say "
                        f"otherwise (default: {DEFAULT_REQUESTS} at {DEFAULT_RATES})")
    p.add_argument("--preset", default="llama-3-70b", choices=list(PRESETS),
                   help="model and hardware of the cost model (default llama-3-70b on 8 x A100-80GB)")
    p.add_argument("--policy", default="all", choices=list(POLICY_ORDER) + ["all"],
                   help="one policy, or all three (default)")
    p.add_argument("--rates", default=None,
                   help=f"comma-separated Poisson rates, requests/s (default {DEFAULT_RATES}; --full: "
                        f"{FULL_RATES})")
    p.add_argument("--max-num-seqs", type=int, default=256, help="slots (the static batch size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of a step")
    p.add_argument("--long-prefill-chunk", type=int, default=512,
                   help="prompt tokens one request may prefill in a step (chunked prefill)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: what fits in the devices' memory after the weights)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="longest prompt + output a request may have")
    p.add_argument("--step-overhead-ms", type=float, default=None, help="override the preset's")
    p.add_argument("--seq-overhead-us", type=float, default=None, help="override the preset's")
    p.add_argument("--calibration", default=None,
                   help="smollm2-135m: a CPU calibration JSON (the source repository's calibration "
                        "script writes one)")
    p.add_argument("--plot-rate", type=float, default=None, help="rate of the bar/CDF/occupancy plots "
                                                                 "(default: the highest)")
    p.add_argument("--out", default=None, help="directory for simulate.json and the PNGs")
    p.add_argument("--detail", action="store_true", help="also store every request and step of --plot-rate")
    p.add_argument("--no-plots", action="store_true", help="with --out: write the JSON only")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--wide", action="store_true", help="print the table on one line per row, however wide "
                                                       "(default: it fits 100 columns)")
    p.set_defaults(run=cmd_simulate)


def _rates(text: str) -> list[float]:
    from minicb.measure.flags import check_rate

    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates:
        raise InvalidArgument(f"--rates must be positive request rates, got {text!r}")
    return [check_rate("--rates", r) for r in rates]


def build(args):
    """(cost model, scheduler config, rates, policies) from the parsed arguments."""
    from minicb.core.config import SchedulerConfig
    from minicb.measure.flags import check_out_dir, check_plots_possible, check_workload_args
    from minicb.simulate.simulator import MAX_STEP_SECONDS, load_calibration, preset

    if args.num_requests is None:
        args.num_requests = FULL_REQUESTS if args.full else DEFAULT_REQUESTS
    if args.rates is None:
        args.rates = FULL_RATES if args.full else DEFAULT_RATES
    check_workload_args(args)
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
        check_int(f"--{name.replace('_', '-')}", getattr(args, name), lo=1)
    if args.num_blocks is not None:
        check_int("--num-blocks", args.num_blocks, lo=1)
    over = {}   # a NaN overhead used to stop the simulated clock: an endless run
    if args.step_overhead_ms is not None:
        over["step_overhead_s"] = check_float("--step-overhead-ms", args.step_overhead_ms, lo=0.0,
                                              hi=MAX_STEP_SECONDS * 1e3, finite=True) * 1e-3
    if args.seq_overhead_us is not None:
        over["seq_overhead_s"] = check_float("--seq-overhead-us", args.seq_overhead_us, lo=0.0,
                                             hi=MAX_STEP_SECONDS * 1e6, finite=True) * 1e-6
    rates = _rates(args.rates)
    if args.plot_rate is not None and args.plot_rate not in rates:
        raise InvalidArgument(f"--plot-rate {args.plot_rate} is not one of --rates {rates}")
    check_out_dir("--out", args.out)
    check_plots_possible("--out", bool(args.out) and not args.no_plots)
    cal = load_calibration(args.calibration) if args.calibration else None
    cost = preset(args.preset, calibration=cal, **over)
    blocks = args.num_blocks if args.num_blocks is not None else cost.num_kv_blocks(args.block_size)
    cfg = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               long_prefill_chunk=args.long_prefill_chunk, block_size=args.block_size, num_blocks=blocks,
               max_model_len=args.max_model_len)
    SchedulerConfig(**cfg)        # validate once, before any work
    policies = list(POLICY_ORDER) if args.policy == "all" else [args.policy]
    return cost, cfg, rates, policies


def cmd_simulate(args) -> int:
    from minicb.core.config import SchedulerConfig
    from minicb.measure.workloads import make_requests
    from minicb.simulate.simulator import simulate

    cost, cfg, rates, policies = build(args)
    print(f"preset {cost.name}: {cost.description}; peak {cost.peak_flops / 1e12:,.1f} TFLOP/s; "
          f"{cfg['num_blocks']} KV blocks of {cfg['block_size']}; {args.max_num_seqs} slots", flush=True)
    from minicb.measure.progress import Progress

    results: dict[float, dict[str, object]] = {}
    t_wall = time.perf_counter()
    for rate in rates:
        reqs = make_requests(args.trace, args.num_requests, rate=rate, seed=args.seed,
                             max_prompt=args.max_prompt, output_div=args.output_div,
                             max_output=args.max_output, min_len=args.min_len,
                             max_total=args.max_total or None)
        too_long = [r for r in reqs if r.prompt_len + r.output_len > args.max_model_len]
        if too_long:
            raise InvalidArgument(f"{len(too_long)} requests exceed --max-model-len "
                                  f"{args.max_model_len}; raise it or lower --max-total")
        results[rate] = {}
        for policy in policies:
            with Progress(f"simulate {policy} @ {rate:g} req/s", total=len(reqs), unit="requests",
                          enabled=False if args.no_progress else None) as prog:

                def tick(step, n_done, prog=prog, total=args.num_requests):
                    if step.step % 64 == 0 or n_done == total:       # the line is redrawn far less often
                        prog.update(done=n_done, info=f"simulated {step.end:,.1f} s")

                res = simulate(reqs, SchedulerConfig(policy=policy, **cfg), cost,
                               label=f"{policy} @ {rate:g}/s", on_step=tick)
            results[rate][policy] = res
    wall = time.perf_counter() - t_wall
    summaries = [results[r][p].summary for r in rates for p in policies]
    print(format_table(summaries, width=None if args.wide else 100))
    n_sim = len(summaries) * args.num_requests
    print(f"simulated {n_sim:,} requests in {wall:.1f} s of wall time")
    if args.out:
        _write(args, cost, cfg, rates, policies, results)
    return 0


def _write(args, cost, cfg, rates, policies, results) -> None:
    os.makedirs(args.out, exist_ok=True)
    meta = {"command": " ".join(["minicb"] + sys.argv[1:]) if sys.argv[0].endswith("minicb") else None,
            "args": {k: v for k, v in vars(args).items() if k != "run"},
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cost_model": cost.to_dict(), "scheduler": cfg}
    runs = {}
    for rate in rates:
        for p in policies:
            res = results[rate][p]
            runs[res.label] = {"rate": rate, "policy": p, "summary": res.summary.to_dict(),
                               "breakdown_s": res.breakdown}
    plot_rate = args.plot_rate if args.plot_rate is not None else max(rates)
    if plot_rate not in results:
        raise InvalidArgument(f"--plot-rate {plot_rate} is not one of --rates {rates}")
    blob = {"meta": meta, "table": format_table([results[r][p].summary for r in rates for p in policies],
                                                markdown=True), "runs": runs}
    if args.detail:     # every request's timeline and every step at --plot-rate (large)
        blob["detail_rate"] = plot_rate
        blob["detail"] = {p: records_to_json(results[plot_rate][p].summary, results[plot_rate][p].requests,
                                             results[plot_rate][p].steps) for p in policies}
    path = os.path.join(args.out, "simulate.json")
    with open(path, "w") as f:
        json.dump(blob, f)
    written = [path]
    if not args.no_plots:
        from minicb.measure import plots

        title = f"simulated {cost.name} ({cost.description}), {args.trace}, {args.num_requests} requests"
        curve = {p: [results[r][p].summary for r in rates] for p in policies}
        written.append(plots.throughput_latency_curve(curve, os.path.join(args.out, "curve.png"), title))
        at = results[plot_rate]
        sub = f"{title}, {plot_rate:g} req/s"
        written.append(plots.throughput_bars([at[p].summary for p in policies],
                                             os.path.join(args.out, "throughput.png"), sub))
        written.append(plots.latency_cdfs({p: at[p].requests for p in policies},
                                          os.path.join(args.out, "latency_cdf.png"), sub))
        written.append(plots.occupancy_timeline({p: at[p].steps for p in policies}, args.max_num_seqs,
                                                os.path.join(args.out, "occupancy.png"), sub))
    print("wrote " + ", ".join(written))
