"""Chapter 09: running and reading the benchmark.

Run: python tutorials/09_benchmark.py
Prerequisites: chapters 01, 05 and 06 (and 07 for the vocabulary).

The benchmark table of the static-batching note compares static batching, naive
dynamic batching and continuous batching on five numbers: throughput, compute
utilisation, mean queueing delay, P99 inter-token latency and padding waste.
This chapter runs one workload through minicb's three policies (and continuous
batching with chunked prefill) with the real engine and a tiny random model, so
it takes seconds on a CPU, and computes each number from what the engine
records: the scheduler's counters and each request's timestamps. Then it checks
the numbers against ``minicb.measure.metrics`` (what ``minicb bench`` reports).
"""

# %% [markdown]
# **Time.** The engine's clock here is a simple cost model instead of the wall
# clock, so the numbers do not depend on this machine or its load. A step lasts
# `1 + tokens / 64` units, tokens counting padding: a small batch's step is
# bound by reading the weights once (the 1), a large one by compute (the
# tokens). One unit is roughly one small decode step. A step with nothing to do,
# while the engine waits for requests, lasts 1 unit too: time passes.
#
# **Workload.** 24 requests with random prompt and output lengths; request `i`
# arrives at step `i` (`--arrival-gap` changes the spacing); 6 slots.

# %%
import textwrap

from _common import WIDTH, Exercise, flags, run_engine, tiny_model

from minicb.core.config import SchedulerConfig
from minicb.measure import metrics
from minicb.measure.trace import make_workload, render_ascii

args = flags(__doc__, arrival_gap=(1, "steps between two arrivals"))
NUM_REQUESTS, SEED, SLOTS = 24, 7, 6
PROMPT_LEN, OUTPUT_LEN, ARRIVAL_GAP = (4, 32), (2, 40), args.arrival_gap
TOKENS_PER_UNIT = 64
CHUNKED_BUDGET = 16   # the last run: continuous with max_num_batched_tokens=16


def step_cost(plan) -> float:
    """Time units of one step: the weight read plus the tokens computed (padding
    costs the same as real tokens)."""
    tokens = plan.num_batched_tokens + plan.num_padding_tokens
    return 1.0 + tokens / TOKENS_PER_UNIT


model = tiny_model()
workload = make_workload(NUM_REQUESTS, SEED, model.config.vocab_size,
                         PROMPT_LEN, OUTPUT_LEN, ARRIVAL_GAP)
for name, values in (("prompt lengths", [len(p) for p in workload.prompts]),
                     ("output lengths", list(workload.max_tokens))):
    print(textwrap.fill(f"{name}: {values}", WIDTH, subsequent_indent="  "))

# %% helper: run one policy and compute the table's five numbers by hand
def percentile(values, q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def measure(policy: str, budget: int = 128) -> dict:
    cfg = SchedulerConfig(max_num_seqs=SLOTS, max_num_batched_tokens=budget,
                          block_size=8, num_blocks=256, policy=policy)
    plans = []

    def cost(plan) -> float:           # the engine's clock; keeps every plan
        plans.append(plan)
        return step_cost(plan)

    prompts = [list(p) for p in workload.prompts]
    outs, trace, eng = run_engine(model, cfg, prompts, workload.max_tokens,
                                  workload.arrivals, cost)
    st, done = eng.stats, outs.values()
    generated = sum(len(o.token_ids) for o in done)
    duration = (max(o.finish_time for o in done)
                - min(o.arrival_time for o in done))
    queue = [o.first_scheduled_time - o.arrival_time for o in done]
    itl = [b - a for o in done
           for a, b in zip(o.token_times, o.token_times[1:])]
    return {
        "plans": plans, "trace": trace, "steps": st.num_steps,
        "throughput": generated / duration,
        "slot_util": trace.summary().slot_utilisation,
        "queue": sum(queue) / len(queue), "p99_itl": percentile(itl, 99),
        "padding": st.num_padding_tokens, "real": st.num_batched_tokens,
        "waste": st.num_padding_tokens / (st.num_padding_tokens
                                          + st.num_batched_tokens),
        "tokens": {rid: o.token_ids for rid, o in outs.items()},
        "summary": library_summary(plans, done),
    }


def library_summary(plans, outputs) -> metrics.Summary:
    """The same run through minicb.measure.metrics (what minicb bench reports):
    step records from the plans and the cost clock, request records from the
    outputs."""
    steps, t = [], 0.0
    for plan in plans:
        end = t + step_cost(plan)
        if plan.seqs or plan.padding:
            steps.append(metrics.step_record(plan, t, end))
        t = end
    records = [metrics.RequestRecord.from_output(o) for o in outputs]
    return metrics.summarize(records, steps, num_slots=SLOTS)


# %% [markdown]
# ## The table

# %%
results = {p: measure(p) for p in ("static", "dynamic", "continuous")}
results["chunked"] = measure("continuous", budget=CHUNKED_BUDGET)
print(f"{'policy':<11}{'steps':>6}{'through-':>10}{'slot':>8}{'mean':>8}"
      f"{'P99':>7}{'padding':>9}")
print(f"{'':<11}{'':>6}{'put':>10}{'util.':>8}{'queue':>8}"
      f"{'ITL':>7}{'waste':>9}")
for policy, r in results.items():
    print(f"{policy:<11}{r['steps']:>6}{r['throughput']:>10.2f}"
          f"{100 * r['slot_util']:>7.1f}%{r['queue']:>8.2f}{r['p99_itl']:>7.2f}"
          f"{100 * r['waste']:>8.2f}%")
print("(throughput in tokens a unit; queue and ITL in units; chunked =")
print(f" continuous with max_num_batched_tokens={CHUNKED_BUDGET})")
s, c = results["static"], results["chunked"]
ratio = c["throughput"] / s["throughput"]
print(f"\nchunked continuous / static: {ratio:.2f}x throughput, mean queueing")
print(f"delay {s['queue']:.1f} -> {c['queue']:.1f} units, P99 ITL "
      f"{s['p99_itl']:.2f} -> {c['p99_itl']:.2f} units")

# %% [markdown]
# Padding waste, spelled out from the scheduler's counters, and a check that the
# library's metrics agree with the hand computation above:

# %%
for policy, r in results.items():
    print(f"{policy}: padding waste = {r['padding']} / ({r['padding']} + "
          f"{r['real']} real tokens) = {100 * r['waste']:.2f}%")
agree = all(
    abs(r["summary"].padding_waste - r["waste"]) < 1e-12
    and abs(r["summary"].queueing_delay_mean - r["queue"]) < 1e-9
    and abs(r["summary"].itl_p99 - r["p99_itl"]) < 1e-9
    and abs(r["summary"].output_tokens_per_s - r["throughput"]) < 1e-9
    for r in results.values())
print("minicb.measure.metrics.summarize gives the same padding waste, queueing")
print(f"delay, P99 ITL and throughput: {agree}")
same = all(r["tokens"] == results["static"]["tokens"] for r in results.values())
print(f"all four runs produced identical tokens: {same}")

# %% [markdown]
# ## How to read it
#
# **Throughput**: generated tokens over the time from the first arrival to the
# last finish, in the cost model's units. **Slot utilisation** is the share of
# (slot, step) cells that computed real tokens: the trace's picture of the
# benchmark table's "compute utilisation".
#
# **Mean queueing delay**: from arrival to the first scheduled step. Static
# batching waits for a full batch and then for the whole batch to finish;
# continuous batching admits a request as soon as any slot frees up.
#
# **P99 inter-token latency**: time between two tokens of one request. A step
# that also prefills a new prompt is longer for every request decoding in it:
# plain continuous batching mixes whole prompts into running batches and pays
# for it here; chunked prefill (chapter 06) bounds every step by the token
# budget. Padded batches never take in a prompt while their members decode:
# their inter-token latency is low here because they pay in queueing delay
# instead (and, on real hardware, in the larger padded steps).
#
# **Padding waste**: padding tokens over all tokens computed. Static and dynamic
# batches pad short prompts to the longest and keep finished rows computing;
# continuous batching never pads (the benchmark table: under 0.1%).
#
# ## Why dynamic batching comes out worse than static here
#
# The benchmark table puts naive dynamic batching between static and continuous.
# Here it is last. Both padded policies run a batch until its longest member
# ends; they differ only in *when* a batch starts. Dynamic starts as soon as
# anything waits; static waits until a batch is full (or no more requests will
# come). The batches each one formed, from the plans:

# %%
for policy in ("static", "dynamic"):
    starts = [p for p in results[policy]["plans"]
              if p.seqs and all(s.start_pos == 0 for s in p.seqs)]
    sizes = [len(p.seqs) for p in starts]
    idle = sum(1 for p in results[policy]["plans"] if p.is_empty)
    print(f"{policy}: batches at steps {[p.step for p in starts]}")
    print(f"   of sizes {sizes}; steps with nothing to run: {idle}")

# %% [markdown]
# With one arrival per step, dynamic's first batch is the single request that
# had arrived at step 0. It runs until that request ends while the other slots
# stay empty and the queue grows; from then on, every batch is full. Static
# spends a few idle steps waiting for a full first batch and gets a head start
# that dynamic never recovers. Dynamic's eagerness pays off when requests
# trickle in so slowly that waiting for a full batch keeps the first ones
# waiting long (the second exercise); and it is the same as static when every
# request is already waiting (the first exercise).
#
# ## The four timelines
#
# `minicb trace --policy static ...` draws the same pictures. Every engine step
# is a column, idle ones included (a blank column: nothing to run yet), so each
# picture's width is the table's step count.

# %%
for policy, r in results.items():
    print(f"{policy}: {r['steps']} steps in the table")
    print(render_ascii(r["trace"], width=WIDTH, colour=False, legend=False,
                       summary=False))
    print()

# %%
EXERCISES = [
    Exercise(
        "--arrival-gap 0",
        "All 24 requests arrive at step 0. How do static and dynamic compare "
        "now?",
        r"^(policy +steps|static |dynamic )",
        "Identical: with everybody already waiting, dynamic's first batch is "
        "as full as static's, and so is every later one."),
    Exercise(
        "--arrival-gap 8",
        "Requests arrive every 8 steps. Which padded policy makes requests "
        "wait less (mean queue) now, and does it also win on throughput?",
        r"^(policy +steps|static |dynamic )",
        "Dynamic has the shorter queueing delay: static's first batch starts "
        "only once six requests have arrived, 40 steps in. Throughput hardly "
        "differs: at this load it is set by how fast requests arrive, not by "
        "how they are batched."),
]
