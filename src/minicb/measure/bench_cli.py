"""``minicb bench``: the benchmark table measured on this machine, with requests arriving over wall time.

    minicb bench --policy all --rate 2 --num-requests 24 --out bench/out/cpu
    minicb bench --model tiny --num-requests 8 --rate 50 --out /tmp/b      # seconds, random tiny model
    minicb bench --trace azure-conv --replay --time-scale 4 --policy continuous

For each policy a fresh engine (same model, same limits) serves the same requests: prompts of random
token ids with the trace's lengths, exactly the trace's output lengths (EOS ignored), both scaled as
``bench/throughput.py`` does (``--max-prompt``, ``--output-div``, ``--max-output``). Arrivals follow
a Poisson process (``--rate``) or the trace's own timestamps (``--replay``, Azure traces), through
``minicb.engine.arrivals.drive`` on the wall clock::

    while requests remain:
        add every request whose arrival time has passed (its arrival_time is the scheduled one)
        if nothing is runnable: sleep until the next arrival
        else: engine.step()            # one forward; a StepRecorder listening to step events times it

It prints the table (throughput, compute utilisation against the measured matmul ceiling, queueing
delay, P99 inter-token latency, padding waste, TTFT and more: ``minicb.measure.metrics``) and writes
``bench.json`` (summaries, every request's timeline, every step) and three PNGs to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time

from minicb.core.errors import InvalidArgument
from minicb.measure.metrics import RequestRecord, StepRecorder, format_table, records_to_json, summarize
from minicb.measure.models import build_model
from minicb.measure.workloads import TRACES, Request, make_requests, random_prompt

POLICY_ORDER = ("static", "dynamic", "continuous")


def add_workload_args(p: argparse.ArgumentParser, num_requests: int | None) -> None:
    p.add_argument("--trace", default="sharegpt", choices=list(TRACES),
                   help="the lengths (and, for azure-*, the timestamps) requests are drawn from "
                        "(default sharegpt)")
    p.add_argument("--num-requests", type=int, default=num_requests,
                   help="requests per policy" + (f" (default {num_requests})" if num_requests else ""))
    p.add_argument("--seed", type=int, default=0, help="lengths, arrivals and prompt ids")
    p.add_argument("--max-prompt", type=int, default=None, help="clip prompts to this many tokens")
    p.add_argument("--output-div", type=float, default=1.0, help="divide output lengths by this")
    p.add_argument("--max-output", type=int, default=None, help="clip output lengths to this")
    p.add_argument("--min-len", type=int, default=1, help="drop trace rows shorter than this (raw lengths)")
    p.add_argument("--max-total", type=int, default=None,
                   help="drop rows with prompt + output above this (0: no limit)")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure the benchmark table (throughput, latency, padding) here",
                       description="Serve trace-shaped requests arriving over wall time with each policy; "
                                   "print the table, write JSON and PNG plots.")
    add_workload_args(p, num_requests=24)
    p.add_argument("--policy", default="all", choices=list(POLICY_ORDER) + ["all"],
                   help="one policy, or all three in turn (default)")
    arr = p.add_mutually_exclusive_group()
    arr.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default 1)")
    arr.add_argument("--replay", action="store_true", help="the trace's own timestamps (azure-*)")
    p.add_argument("--time-scale", type=float, default=1.0, help="with --replay: speed-up factor")
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M), 'tiny' (random, instant) or a GGUF file / HF directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                   help="weights and activations (default float32)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="slots (the static batch size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of a step")
    p.add_argument("--long-prefill-chunk", type=int, default=None,
                   help="prompt tokens one request may prefill in a step (default: no limit)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the pool")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="'wall': real time; 'cpu': this process's CPU time, idle gaps skipped (a dedicated "
                        "machine's timeline on a shared one; use with --threads 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a busy 2-core machine a second OpenMP "
                        "thread costs more than it gives; 0 = torch's default)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="the ceiling for compute utilisation (default: measure a float32 matmul)")
    p.add_argument("--out", default=None, help="directory for bench.json and the PNGs")
    p.add_argument("--no-plots", action="store_true", help="with --out: write the JSON only")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--wide", action="store_true", help="print the table on one line per row, however wide "
                                                       "(default: it fits 100 columns)")
    p.set_defaults(run=cmd_bench)


# --- machine ------------------------------------------------------------------------------------------
def matmul_ceiling_gflops(n: int = 1024, repeats: int = 10, clock=time.perf_counter) -> float:
    """This machine's float32 matmul throughput (best of ``repeats`` n x n products), GFLOP/s, timed on
    ``clock`` (``time.process_time`` with one torch thread: what other processes do not disturb)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        a @ b
        best = min(best, clock() - t0)
    return 2 * n**3 / best / 1e9


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), "
            f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()}")


# --- the run ------------------------------------------------------------------------------------------
class CpuClock:
    """This thread's CPU time plus the idle time skipped by ``sleep``: the timeline the engine would
    have on a machine of its own. Other processes on a shared machine do not advance it (with one
    torch thread every op runs on the calling thread, so its CPU time is the engine's work; a progress
    display's refresh thread is not counted)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.thread_time() + self.skipped

    def sleep(self, seconds: float) -> None:
        self.skipped += max(seconds, 0.0)


def make_prompts(requests: list[Request], vocab: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {r.request_id: random_prompt(rng, r.prompt_len, vocab) for r in requests}


def run_policy(model, policy: str, requests: list[Request], prompts: dict[str, list[int]], sched_kwargs: dict,
               progress=None, clock=time.perf_counter, sleep=time.sleep):
    """Serve ``requests`` with a fresh engine, arriving in wall-clock time (``minicb.engine.arrivals.drive``);
    return (request records, step records, scheduler stats, the shape of every step's plan)."""
    from minicb.core.config import SchedulerConfig
    from minicb.core.sampling_params import SamplingParams
    from minicb.engine.arrivals import Arrival, drive
    from minicb.fastpaths.install import runner_kwargs
    from minicb.runtime.runner import engine_for

    cfg = SchedulerConfig(policy=policy, **sched_kwargs)
    engine = engine_for(model, cfg, None, seed=0, clock=clock, **runner_kwargs())
    shapes: list = []
    engine.listen(on_plan=lambda ev: shapes.append(plan_shape(ev.plan)) if (ev.plan.seqs or ev.plan.padding)
                  else None)
    rec = StepRecorder(model.config).attach(engine)
    done: list[RequestRecord] = []

    def on_step(outs) -> None:
        done.extend(RequestRecord.from_output(o) for o in outs if o.finished)
        if progress is not None:
            progress(len(done), rec.steps[-1] if rec.steps else None)

    t0 = clock() + 0.01
    drive(engine, [Arrival(t0 + r.arrival, r.request_id, prompts[r.request_id],
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True)) for r in requests],
          now=clock, wait=lambda until: sleep(max(0.0, until - clock())), on_step=on_step)
    return done, rec.steps, engine.stats, shapes


def plan_shape(plan) -> list:
    """A step's plan as JSON: ``[[start_pos, num_tokens, sample], ...], padding`` (what a cost model
    needs to price it again: ``bench/validate_sim.py``)."""
    return [[[s.start_pos, s.num_tokens, int(s.sample)] for s in plan.seqs], list(plan.padding)]


def shape_plan(shape, block_size: int = 16):
    """The inverse of ``plan_shape``: a ``StepPlan`` with dummy token ids of the same shape."""
    from minicb.core.plan import ScheduledSeq, StepPlan

    rows, padding = shape
    seqs = tuple(ScheduledSeq(str(i), i, (1,) * n, start, (), bool(sample))
                 for i, (start, n, sample) in enumerate(rows))
    return StepPlan(0, seqs, padding=tuple(padding), block_size=block_size)


def cmd_bench(args) -> int:
    from minicb.core.errors import check_float, check_int
    from minicb.measure.flags import (
        check_out_dir,
        check_plots_possible,
        check_rate,
        check_scale,
        check_workload_args,
    )

    check_workload_args(args)
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
        check_int(f"--{name.replace('_', '-')}", getattr(args, name), lo=1)
    # torch.set_num_threads(100000) crashes the interpreter: at most one thread per core
    check_int("--threads", args.threads, lo=0, hi=os.cpu_count() or 1)
    if args.rate is not None:
        check_rate("--rate", args.rate)
    check_scale("--time-scale", args.time_scale)
    if args.peak_gflops is not None:
        check_float("--peak-gflops", args.peak_gflops, lo=0.0, lo_open=True, hi=1e9, finite=True)
    check_out_dir("--out", args.out)
    check_plots_possible("--out", bool(args.out) and not args.no_plots)
    if args.clock == "cpu" and args.threads != 1:
        raise InvalidArgument("--clock cpu measures one thread's CPU time: use it with --threads 1")
    if args.replay and args.trace == "sharegpt":
        raise InvalidArgument("--replay needs timestamps: use --trace azure-conv or azure-code (or --rate)")
    if args.model not in ("tiny", "default"):
        from minicb.model.weights.paths import check_model_path

        check_model_path(args.model, "--model")       # before torch; "never downloads" for hub ids
    from minicb.measure.progress import Progress

    quiet = False if args.no_progress else None
    with Progress("loading torch", enabled=quiet):
        import torch

        from minicb.fastpaths.install import cpu_fast_paths, show_load_lines
    show_load_lines()

    if args.threads:
        torch.set_num_threads(args.threads)
    rate = None if args.replay else (1.0 if args.rate is None else args.rate)
    requests = make_requests(args.trace, args.num_requests, rate=rate, replay=args.replay,
                             time_scale=args.time_scale, seed=args.seed, max_prompt=args.max_prompt,
                             output_div=args.output_div, max_output=args.max_output, min_len=args.min_len,
                             max_total=args.max_total or None)
    policies = list(POLICY_ORDER) if args.policy == "all" else [args.policy]
    with Progress(f"loading the {args.model} model" if args.model in ("tiny", "default")
                  else f"loading {args.model}", enabled=quiet):
        blocks: dict = {}
        model, _ = build_model(args.model, args.dtype, args.seed, blocks)
        cpu_fast_paths(model, "cpu", gguf_blocks=blocks)   # what LLM() runs (one line on stderr)
    prompts = make_prompts(requests, model.config.vocab_size, args.seed)
    max_len = max(r.prompt_len + r.output_len for r in requests)
    sched_kwargs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        long_prefill_chunk=args.long_prefill_chunk, block_size=args.block_size,
                        num_blocks=args.num_blocks, max_model_len=max(max_len, 16))
    ceiling_clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    with Progress("measuring the matmul ceiling", enabled=quiet):
        peak = (args.peak_gflops if args.peak_gflops else matmul_ceiling_gflops(clock=ceiling_clock)) * 1e9
    machine = machine_description()
    print(f"machine: {machine}; float32 matmul ceiling {peak / 1e9:.1f} GFLOP/s; {args.clock} clock",
          flush=True)
    print(f"workload: {len(requests)} requests from {args.trace}, "
          f"{'replay x' + str(args.time_scale) if args.replay else f'Poisson {rate} req/s'}, "
          f"{sum(r.prompt_len for r in requests)} prompt + {sum(r.output_len for r in requests)} output "
          "tokens, "
          f"last arrival at {requests[-1].arrival:.1f} s", flush=True)
    results = {}
    for policy in policies:
        with Progress(f"bench {policy}", total=len(requests), unit="requests", enabled=quiet) as prog:

            def tick(n_done, step, prog=prog):
                info = "" if step is None else (f"step {step.step}: {step.num_seqs} seqs, "
                                                f"{step.num_tokens}+{step.num_padding_tokens} pad tokens")
                prog.update(done=n_done, info=info)

            clock = CpuClock() if args.clock == "cpu" else None
            timing = dict(clock=clock, sleep=clock.sleep) if clock is not None else {}
            reqs, steps, stats, shapes = run_policy(model, policy, requests, prompts, sched_kwargs, tick,
                                                    **timing)
        s = summarize(reqs, steps, label=policy, num_slots=args.max_num_seqs, num_blocks=args.num_blocks,
                      peak_flops=peak, num_preemptions=stats.num_preemptions)
        results[policy] = (s, reqs, steps, shapes)
    summaries = [results[p][0] for p in policies]
    print()
    print(format_table(summaries, width=None if args.wide else 100))
    note = padded_note(summaries)
    if note:
        print(note)
    if args.out:
        write_outputs(args, summaries, results, requests, machine, peak, sched_kwargs)
    return 0


def padded_note(summaries) -> str | None:
    """A line under the table when ``dynamic`` came out below ``static`` (few requests, a tiny model):
    what makes it so, so that it does not read as a defect; None otherwise."""
    by = {s.label: s for s in summaries}
    if "static" not in by or "dynamic" not in by:
        return None
    st, dy = by["static"], by["dynamic"]
    if dy.output_tokens_per_s >= st.output_tokens_per_s:
        return None
    import textwrap

    return textwrap.fill(
        "note: dynamic below static: dynamic starts a batch with the requests that have arrived and the "
        "later ones wait for that whole batch to end; static waits for a full batch (or the last arrival) "
        f"and runs one. Here dynamic took {dy.num_steps:,} steps, static {st.num_steps:,}: with few "
        "requests and a step that costs about the same at any batch size, fewer steps win. With many "
        "requests arriving over time, starting early pays.", 100)


def write_outputs(args, summaries, results, requests, machine, peak, sched_kwargs) -> None:
    os.makedirs(args.out, exist_ok=True)
    meta = {"command": " ".join(["minicb"] + sys.argv[1:]) if sys.argv[0].endswith("minicb") else None,
            "args": {k: v for k, v in vars(args).items() if k != "run"},
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine, "peak_gflops": peak / 1e9, "scheduler": sched_kwargs,
            "workload": [vars_of(r) for r in requests]}
    blob = {"meta": meta, "table": format_table(summaries, markdown=True),
            "runs": {label: records_to_json(s, reqs, steps, {"plans": shapes})
                     for label, (s, reqs, steps, shapes) in results.items()}}
    path = os.path.join(args.out, "bench.json")
    with open(path, "w") as f:
        json.dump(blob, f, indent=1)
    written = [path]
    if not args.no_plots:
        from minicb.measure import plots

        title = f"{args.trace}, {len(requests)} requests, model {args.model}"
        written.append(plots.throughput_bars(summaries, os.path.join(args.out, "throughput.png"), title))
        written.append(plots.latency_cdfs({k: v[1] for k, v in results.items()},
                                          os.path.join(args.out, "latency_cdf.png"), title))
        written.append(plots.occupancy_timeline({k: v[2] for k, v in results.items()}, args.max_num_seqs,
                                                os.path.join(args.out, "occupancy.png"), title))
    print("wrote " + ", ".join(written))


def vars_of(r: Request) -> dict:
    return {"id": r.request_id, "prompt_len": r.prompt_len, "output_len": r.output_len, "arrival": r.arrival}
