"""Tensor parallelism on this CPU: step time at TP 1 and TP 2, and the all-reduce share of a step.

    python bench/tp.py                 # prints a markdown section
    python bench/tp.py --write         # and puts it under "## Tensor parallelism" in bench/RESULTS.md

The engine serves 16 prompts of 128 tokens (32 new tokens each, greedy, SmolLM2-135M float32) with a
512-token budget: 4 prefill steps of 512 tokens, then 31 decode steps of 16 sequences. Each step is
timed on rank 0 (the driver), and at TP 2 so is each all-reduce inside it (``CommStats``: the time
spent in ``dist.all_reduce``, which includes waiting for the slower rank). Configurations on the same
2 cores: TP 1 with 1 and with 2 torch threads, TP 2 (two processes of 1 thread each). A two-process
gloo loop of the same message sizes gives the bare all-reduce latency.

The same share for LLaMA-3-70B on 8 x A100 comes from the cost-model simulator's ``llama-3-70b``
preset (``minicb.simulate.simulator``: tp 8, NCCL all-reduce times from vidur's A100 DGX profile),
priced on plans
of the same shapes plus a larger decode batch. Not a test: the numbers depend on the machine and on
how busy it is (the load average is printed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cpu_model as cpu_name  # noqa: E402

from minicb.core.config import SchedulerConfig  # noqa: E402
from minicb.core.plan import ScheduledSeq, StepPlan  # noqa: E402
from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.distributed.launch import launch  # noqa: E402
from minicb.model.llama import LlamaForCausalLM  # noqa: E402
from minicb.model.weights.loader import load_model  # noqa: E402
from minicb.runtime.runner import engine_for  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Tensor parallelism"


def prompts_for(tokenizer, n: int, length: int) -> list[list[int]]:
    text = ("The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made, sold and read across Europe and beyond. ") * 40
    ids = tokenizer.encode(text)
    return [ids[i * 7: i * 7 + length] for i in range(n)]


def run(eng, prompts, max_tokens: int) -> list[dict]:
    """Serve every prompt; one record per step with its shape, wall time and all-reduce time."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    eng.close_arrivals()
    stats = getattr(eng.runner, "comm_stats", None)
    steps = []
    while eng.has_unfinished_requests():
        ar0, n0 = (stats.all_reduce_s, stats.all_reduce_calls) if stats else (0.0, 0)
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        plan = eng.last_plan
        if plan is None or not plan.seqs:
            continue
        decode = all(s.num_tokens == 1 for s in plan.seqs)
        steps.append({"kind": "decode" if decode else "prefill", "tokens": plan.num_batched_tokens,
                      "s": dt, "allreduce_s": (stats.all_reduce_s - ar0) if stats else 0.0,
                      "allreduces": (stats.all_reduce_calls - n0) if stats else 0})
    eng.open_arrivals()
    return steps


def summarize(steps: list[dict], kind: str) -> dict:
    sel = [s for s in steps if s["kind"] == kind]
    return {"n": len(sel), "tokens": statistics.median(s["tokens"] for s in sel),
            "ms": statistics.median(s["s"] for s in sel) * 1e3,
            "allreduce_ms": statistics.median(s["allreduce_s"] for s in sel) * 1e3,
            "share": statistics.median(s["allreduce_s"] / s["s"] for s in sel),
            "allreduces": statistics.median(s["allreduces"] for s in sel)}


# --- bare gloo all-reduce latency ---------------------------------------------------------------------
def _allreduce_loop(rank: int, port: int, sizes: list[int], reps: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    res = {}
    for n in sizes:
        t = torch.ones(n)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dist.all_reduce(t, group=pg)
            times.append(time.perf_counter() - t0)
        res[n] = statistics.median(times)
    if out is not None:
        out.put(res)


def gloo_latency(sizes: list[int], reps: int = 200) -> dict[int, float]:
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_allreduce_loop, args=(1, store.port, sizes, reps, None))
    p.start()
    _allreduce_loop(0, store.port, sizes, reps, q)
    p.join()
    return q.get()


# --- the simulator's 8 x A100 preset ------------------------------------------------------------------
def simulated_shares() -> tuple[list[dict], str]:
    from minicb.simulate.simulator import preset

    cm = preset("llama-3-70b")
    bs = 16

    def decode(n, ctx):
        per = (ctx + bs) // bs + 1
        seqs = tuple(ScheduledSeq(str(i), i, (1,), ctx, tuple(range(i * per, (i + 1) * per)), True)
                     for i in range(n))
        return StepPlan(0, seqs, block_size=bs)

    def prefill(n):
        return StepPlan(0, (ScheduledSeq("p", 0, tuple(range(n)), 0, tuple(range(-(-n // bs))), True),),
                        block_size=bs)

    rows = []
    for label, plan in [("prefill, 512 tokens", prefill(512)), ("decode, 16 seqs x 144 ctx", decode(16, 144)),
                        ("prefill, 4096 tokens", prefill(4096)),
                        ("decode, 128 seqs x 1024 ctx", decode(128, 1024))]:
        b = cm.breakdown(plan)
        total = sum(b.values())
        rows.append({"label": label, "ms": total * 1e3, "allreduce_ms": b["allreduce"] * 1e3,
                     "share": b["allreduce"] / total})
    return rows, cm.description


# --- report -------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--write", action="store_true", help=f"update the '{SECTION}' section of {RESULTS.name}")
    args = ap.parse_args()

    load_before = os.getloadavg()
    loaded = load_model(None, dtype=torch.float32)
    model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.float32)
    prompts = prompts_for(loaded.tokenizer, args.prompts, args.prompt_len)
    cfg = SchedulerConfig(max_num_seqs=args.prompts, max_num_batched_tokens=args.budget, block_size=16,
                          num_blocks=args.prompts * (-(-(args.prompt_len + args.max_tokens) // 16) + 1),
                          enable_prefix_caching=False)     # the same steps after the warm-up run
    results = {}
    for label, threads in (("TP 1, 1 thread", 1), ("TP 1, 2 threads", 2)):
        torch.set_num_threads(threads)
        eng = engine_for(model, cfg, loaded.tokenizer)
        run(eng, prompts[:2], 2)                                  # warm-up
        eng = engine_for(model, cfg, loaded.tokenizer)
        steps = run(eng, prompts, args.max_tokens)
        results[label] = steps
        print(label, "done", flush=True)
    eng = launch(model, cfg, 2, tokenizer=loaded.tokenizer)
    try:
        run(eng, prompts[:2], 2)
        results["TP 2 (2 x 1 thread)"] = run(eng, prompts, args.max_tokens)
    finally:
        eng.shutdown()
    print("TP 2 done", flush=True)
    h = model.config.hidden_size
    lat = gloo_latency([args.prompts * h, args.budget * h])
    sim, sim_desc = simulated_shares()
    load_after = os.getloadavg()

    cmd = " ".join(["python", "bench/tp.py", *sys.argv[1:]])
    busy = max(load_before[0], load_after[0]) > 0.5 * (os.cpu_count() or 1)
    lines = [SECTION, "",
             f"`{cmd}` on {datetime.date.today().isoformat()}; machine: {cpu_name()}, {os.cpu_count()} "
             f"cores, torch {torch.__version__}, Python {platform.python_version()}; load average "
             f"{load_before[0]:.1f} before and {load_after[0]:.1f} after"
             + (": **the machine was busy with other jobs, so these figures are noisy** (each all-reduce "
                "waits for both processes to be scheduled)." if busy else "."),
             "",
             f"SmolLM2-135M float32, {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} "
             f"new tokens each, budget {args.budget} tokens: prefill steps of about {args.budget} tokens, "
             f"then decode steps of {args.prompts} sequences. Median per step on rank 0 (all-reduce time "
             "includes waiting for the other rank; TP 2 splits SmolLM2's 3 KV heads 2 + 1, so rank 0 has "
             "twice rank 1's attention work):", "",
             "| configuration | step | n | ms / step | all-reduces | all-reduce ms | all-reduce share |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for label, steps in results.items():
        for kind in ("prefill", "decode"):
            s = summarize(steps, kind)
            ar = "" if not s["allreduces"] else f"{s['allreduces']:.0f}"
            lines.append(f"| {label} | {kind} ({s['tokens']:.0f} tokens) | {s['n']} | {s['ms']:.1f} | {ar} | "
                         f"{s['allreduce_ms']:.1f} | {s['share']:.1%} |")
    t1 = {k: summarize(results["TP 1, 1 thread"], k)["ms"] for k in ("prefill", "decode")}
    t2 = {k: summarize(results["TP 2 (2 x 1 thread)"], k)["ms"] for k in ("prefill", "decode")}
    lines += ["", f"Speed-up of TP 2 over TP 1 (1 thread): prefill {t1['prefill'] / t2['prefill']:.2f}x, "
                  f"decode {t1['decode'] / t2['decode']:.2f}x.", "",
              f"Bare gloo all-reduce between two processes on this machine (median of 200): "
              f"{args.prompts} x {h} floats {lat[args.prompts * h] * 1e3:.2f} ms, "
              f"{args.budget} x {h} floats {lat[args.budget * h] * 1e3:.2f} ms "
              f"(a step makes {2 * model.config.num_hidden_layers} of them).", "",
              reading(results, lat, args, h, 2 * model.config.num_hidden_layers), "",
              f"Simulator, `preset(\"llama-3-70b\")` ({sim_desc}; all-reduce from vidur's measured NCCL "
              "table, the rest from the cost model), same step shapes and two larger ones:", "",
              "| step | simulated ms | all-reduce ms | all-reduce share |", "|---|---:|---:|---:|"]
    for r in sim:
        lines.append(f"| {r['label']} | {r['ms']:.2f} | {r['allreduce_ms']:.2f} | {r['share']:.1%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(text)


def reading(results: dict, lat: dict, args, h: int, per_step: int) -> str:
    """How much of the measured all-reduce time the wire explains; the rest is waiting for the peer."""
    tp2 = results["TP 2 (2 x 1 thread)"]
    parts = []
    for kind, size in (("prefill", args.budget * h), ("decode", args.prompts * h)):
        s = summarize(tp2, kind)
        wire = per_step * lat[size] * 1e3
        share = wire / s["allreduce_ms"]
        parts.append(f"{kind}: {wire:.0f} ms of the {s['allreduce_ms']:.0f} ms ({share:.0%})")
    return ("Reading: the bare latency times the all-reduces of a step explains only part of the measured "
            "all-reduce time (" + "; ".join(parts) + "); the rest is rank 0 waiting for rank 1 to reach the "
            "same all-reduce: load imbalance (rank 0 holds 6 of the 9 query heads) and, on shared cores, "
            "waiting to be scheduled. With other jobs on the cores two processes do not get two cores' "
            "worth of time, so the compute per step shrinks little either. On 8 A100s with NVLink the "
            "simulator puts the share at 20-30%.")


def write_section(text: str) -> None:
    """Replace (or append) this benchmark's section of RESULTS.md, leaving the others alone."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = old.find(SECTION + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + text + ("" if end < 0 else old[end:])
    RESULTS.write_text(new)


if __name__ == "__main__":
    main()
