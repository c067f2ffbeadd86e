"""Chapter 09: running and reading the benchmark.

Run: python tutorials/09_benchmark.py

The seed's table compares static batching, naive dynamic batching and continuous batching on five
numbers: throughput, compute utilisation, mean queueing delay, P99 inter-token latency and padding
waste. This chapter runs one workload through minicb's three policies with the real engine (a tiny
random model, so it takes seconds on a CPU) and computes each number from what the engine records:
the scheduler's counters and each request's timestamps, then checks the numbers against
``minicb.measure.metrics`` (what ``minicb bench`` reports).

Time: the engine's clock here is a simple cost model instead of the wall clock, so the numbers do not
depend on this machine or its load. A step lasts ``1 + tokens / 64`` units, tokens counting padding:
a small batch's step is bound by reading the weights once (the 1), a large one by compute (the
tokens). One unit is roughly one small decode step.
"""

from __future__ import annotations

import time

from _common import chapter, explain, run_engine, section, tiny_model

from minicb.config import SchedulerConfig
from minicb.measure import metrics
from minicb.measure.trace import make_workload, render_ascii

NUM_REQUESTS, SEED, SLOTS = 24, 7, 6
PROMPT_LEN, OUTPUT_LEN, ARRIVAL_GAP = (4, 32), (2, 40), 1
TOKENS_PER_UNIT = 64
CHUNKED_BUDGET = 16      # the last row: continuous with max_num_batched_tokens=16 (chunked prefill)


def step_cost(plan) -> float:
    """Time units of one step: the weight read plus the tokens computed (padding costs the same)."""
    return 1.0 + (plan.num_batched_tokens + plan.num_padding_tokens) / TOKENS_PER_UNIT


def percentile(values, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def measure(model, policy: str, workload, budget: int = 128) -> dict:
    cfg = SchedulerConfig(max_num_seqs=SLOTS, max_num_batched_tokens=budget, block_size=8, num_blocks=256,
                          policy=policy)
    prompts = [list(p) for p in workload.prompts]
    plans = []

    def cost(plan) -> float:                   # the engine's clock, keeping every plan for metrics
        plans.append(plan)
        return step_cost(plan)

    t0 = time.perf_counter()
    outs, trace, eng = run_engine(model, cfg, prompts, workload.max_tokens, workload.arrivals, cost)
    wall = time.perf_counter() - t0
    st = eng.stats
    generated = sum(len(o.token_ids) for o in outs.values())
    duration = max(o.finish_time for o in outs.values()) - min(o.arrival_time for o in outs.values())
    queue = [o.first_scheduled_time - o.arrival_time for o in outs.values()]
    itl = [b - a for o in outs.values() for a, b in zip(o.token_times, o.token_times[1:])]
    return {
        "trace": trace, "steps": st.num_steps, "generated": generated, "wall": wall,
        "duration": duration, "throughput": generated / duration, "tokens_per_s": generated / wall,
        "slot_util": trace.summary().slot_utilisation,
        "queue": sum(queue) / len(queue), "p99_itl": percentile(itl, 99),
        "padding": st.num_padding_tokens, "real": st.num_batched_tokens,
        "waste": st.num_padding_tokens / (st.num_padding_tokens + st.num_batched_tokens),
        "tokens": {rid: o.token_ids for rid, o in outs.items()},
        "summary": library_summary(plans, outs.values()),
    }


def library_summary(plans, outputs) -> metrics.Summary:
    """The same run through ``minicb.measure.metrics`` (what ``minicb bench`` reports): step records from the
    plans and the cost clock, request records from the outputs."""
    steps, t = [], 0.0
    for plan in plans:
        end = t + step_cost(plan)
        if plan.seqs or plan.padding:
            steps.append(metrics.step_record(plan, t, end))
        t = end
    return metrics.summarize([metrics.RequestRecord.from_output(o) for o in outputs], steps,
                             num_slots=SLOTS)


def main() -> None:
    chapter(9, "running and reading the benchmark")
    model = tiny_model()
    workload = make_workload(NUM_REQUESTS, SEED, model.config.vocab_size, PROMPT_LEN, OUTPUT_LEN,
                             ARRIVAL_GAP)
    print(f"workload: {NUM_REQUESTS} requests, prompts {PROMPT_LEN[0]}-{PROMPT_LEN[1]} tokens, outputs "
          f"{OUTPUT_LEN[0]}-{OUTPUT_LEN[1]} tokens, one arrival per step; {SLOTS} slots")
    print(f"output lengths: {list(workload.max_tokens)}")
    measure(model, "continuous", make_workload(4, 0, 64))        # warm-up: first forwards are slow
    results = {p: measure(model, p, workload) for p in ("static", "dynamic", "continuous")}
    results["chunked"] = measure(model, "continuous", workload, budget=CHUNKED_BUDGET)

    section("the table")
    head = (f"{'policy':<11} {'steps':>5} {'throughput':>10} {'slot util.':>10} {'mean queue':>10} "
            f"{'P99 ITL':>7} {'padding waste':>13} {'wall tokens/s':>13}")
    print(head)
    print(f"{'':<11} {'':>5} {'(tok/unit)':>10} {'':>10} {'(units)':>10} {'(units)':>7}")
    for policy, r in results.items():
        print(f"{policy:<11} {r['steps']:>5} {r['throughput']:>10.2f} {100 * r['slot_util']:>9.1f}% "
              f"{r['queue']:>10.2f} {r['p99_itl']:>7.2f} {100 * r['waste']:>12.2f}% "
              f"{r['tokens_per_s']:>13.0f}")
    print(f"(chunked = continuous with max_num_batched_tokens={CHUNKED_BUDGET}: prompts are fed in chunks)")
    s, c = results["static"], results["chunked"]
    print(f"\nchunked continuous / static: {c['throughput'] / s['throughput']:.2f}x throughput, mean "
          f"queueing delay {s['queue']:.1f} -> {c['queue']:.1f} units, P99 ITL {s['p99_itl']:.2f} -> "
          f"{c['p99_itl']:.2f} units")
    for policy, r in results.items():
        print(f"{policy}: padding waste = {r['padding']} padding / ({r['padding']} + {r['real']} real tokens)"
              f" = {100 * r['waste']:.2f}%")
    agree = all(
        abs(r["summary"].padding_waste - r["waste"]) < 1e-12
        and abs(r["summary"].queueing_delay_mean - r["queue"]) < 1e-9
        and abs(r["summary"].itl_p99 - r["p99_itl"]) < 1e-9
        and abs(r["summary"].output_tokens_per_s - r["throughput"]) < 1e-9 for r in results.values())
    print("minicb.measure.metrics.summarize gives the same padding waste, queueing delay, P99 ITL and "
          f"throughput: "
          f"{agree}")
    same = all(r["tokens"] == results["static"]["tokens"] for r in results.values())
    print(f"all four runs produced identical tokens: {same}")

    section("how to read it")
    explain("""
        Throughput: generated tokens over the time from the first arrival to the last finish, in the
        cost model's units. The wall-clock tokens/s column is this CPU running a tiny model, where
        Python overhead dominates: read it as a sanity check, not as the result. Slot utilisation is
        the share of (slot, step) cells that computed real tokens: the trace's picture of the seed's
        "compute utilisation".

        Mean queueing delay: from arrival to the first scheduled step. Static batching waits for a
        full batch and then for the whole batch to finish; continuous batching admits a request as
        soon as any slot frees up. P99 inter-token latency: time between two tokens of one request. A
        step that also prefills a new prompt is longer for every request decoding in it: plain
        continuous batching mixes whole prompts into running batches and pays for it here; chunked
        prefill (chapter 06) bounds every step by the token budget. Padded batches never take in a
        prompt while their members decode: their inter-token latency is low here because they pay in
        queueing delay instead (and, on real hardware, in the larger padded steps).

        Padding waste: padding tokens over all tokens computed. Static and dynamic batches pad short
        prompts to the longest and keep finished rows computing; continuous batching never pads (the
        seed: under 0.1%).
    """)
    section("the three timelines (minicb trace draws these: minicb trace --policy static ...)")
    for r in results.values():
        print(render_ascii(r["trace"], width=100, colour=False, legend=False, summary=False))
        print()


if __name__ == "__main__":
    main()
