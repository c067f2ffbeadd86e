"""Chapter 07: preemption, recompute versus swap.

Run: python tutorials/07_preemption.py
Prerequisites: chapters 04 (block tables) and 05.

Paged KV admits requests without reserving their whole future (chapter 04), so
memory is oversubscribed: every decode may need a new block, and one day the
pool is empty. Then the scheduler *preempts* a victim, the most recently
admitted running request (``minicb.core.preemption``), in one of two ways:

* recompute: drop its blocks; it goes back to the front of the waiting queue and
  later re-prefills its prompt plus the tokens it already generated (compute
  traded for memory);
* swap: copy its blocks to a host (CPU) pool and bring them back before
  admitting anything new (copies over the host link traded for compute).

This chapter shows both on the block tables, then what each costs.
"""

# %% [markdown]
# Three requests, each with a 4-token prompt and 8 tokens to generate, share a
# pool of only 7 blocks of 4 tokens. All three are admitted (one block each is
# enough to start); as they decode they need 3 blocks each, 9 in all, so the
# pool runs out at the step where all three reach position 8.
#
# The scheduler runs with a fake model (chapter 03). A step listener prints the
# block tables around every preemption and swap-in: *before* is the state the
# previous step left (`StepEvent.after`), *after* is the state once this step is
# planned (`PlanEvent.state`).

# %%
import math

from _common import (
    Exercise,
    flags,
    prompt_ids,
    run_engine,
    run_scheduler,
    tiny_model,
)

from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.runtime.baseline import generate_padded
from minicb.simulate.simulator import preset

args = flags(__doc__, num_blocks=(7, "KV blocks of 4 tokens in the pool"),
             scale=(32, "section 4: prompts and outputs this much longer"))
REQUESTS = [("A", 4, 8), ("B", 4, 8), ("C", 4, 8)]   # each ends with 12 tokens
NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS = args.num_blocks, 4, 8


def config(mode: str, caching: bool = False, **changes) -> SchedulerConfig:
    fields = dict(max_num_seqs=3, max_num_batched_tokens=64,
                  block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                  preemption_mode=mode,
                  num_host_blocks=HOST_BLOCKS if mode == "swap" else 0,
                  enable_prefix_caching=caching)
    return SchedulerConfig(**{**fields, **changes})


# %% helper: print the tables around each preemption and re-admission
def show(title: str, state) -> None:
    """The parts of a SchedulerSnapshot this chapter prints."""
    device = {r: list(t) for r, t in state.block_tables}
    host = {r: list(t) for r, t in state.host_tables}
    slots = {i: r for i, r in enumerate(state.slots) if r is not None}
    print(f"  {title}")
    print(f"    device tables {device}  free {list(state.free_blocks)}")
    print(f"    host tables   {host}")
    print(f"    slots {slots}  waiting {list(state.waiting)}"
          f"  swapped {list(state.swapped)}")


def trace(name: str, cfg: SchedulerConfig):
    """Run REQUESTS; print the tables around each preemption and swap-in."""
    last, victims = [None], set()

    def on_plan(event) -> None:
        plan = event.plan
        for s in plan.seqs:          # a recompute victim's first step back
            if s.request_id in victims and cfg.preemption_mode == "recompute":
                print(f"step {plan.step}: {s.request_id} is admitted again: "
                      f"{s.start_pos} tokens found cached, {s.num_tokens} "
                      f"re-prefilled\n   into blocks {list(s.block_table)}")
        victims.difference_update(s.request_id for s in plan.seqs)
        victims.update(plan.preempted)
        if plan.preempted or plan.swap_in:
            print(f"step {plan.step}: preempted {list(plan.preempted)}, copies "
                  f"out {list(plan.swap_out)}, in {list(plan.swap_in)}")
            show("before (the previous step recorded):", last[0])
            show("after (this step planned):", event.state)
            rows = ", ".join(f"{s.request_id}:{s.num_tokens}@{s.start_pos}"
                             for s in plan.seqs)
            print(f"    this step computes (request:tokens@position): {rows}")

    def on_step(event) -> None:            # the state the next step starts from
        last[0] = event.after

    engine, plans, _ = run_scheduler(cfg, REQUESTS, on_plan=on_plan,
                                     on_step=on_step)
    st = engine.stats
    print(f"{name}: {st.num_steps} steps; preemptions {st.num_preemptions} "
          f"(recompute {st.num_recomputes}, swap {st.num_swaps}); swap-ins "
          f"{st.num_swap_ins}")
    print(f"{name}: tokens computed in all {st.num_batched_tokens}, computed "
          f"tokens thrown away {st.num_recomputed_tokens}")
    if cfg.enable_prefix_caching:
        print(f"{name}: tokens a victim found cached again "
              f"{st.num_cached_reprefill_tokens}")
    return engine, plans


# %% [markdown]
# ## 1. Recompute
#
# Prefix caching off: the victim's blocks are simply free again.

# %%
_ = trace("recompute", config("recompute"))

# %% [markdown]
# The victim lost its cache: when a slot and blocks are free again it is
# admitted like a new request whose "prompt" is its prompt plus the tokens it
# had generated, all computed in one prefill.
#
# ## 2. Swap
#
# With `num_host_blocks` = 8 the victim's blocks are copied to the host pool
# instead, and copied back into fresh device blocks before any new request is
# admitted. The `(device, host)` pairs are the copies the engine makes
# (`minicb.model.kv_cache`).

# %%
_ = trace("swap", config("swap"))

# %% [markdown]
# No token was computed twice, but every block made two trips over the host
# link. vLLM V1 uses recompute only; V0 offered both.
#
# ## 3. Recompute with prefix caching: the victim finds its own blocks
#
# With prefix caching on (chapter 10), the victim's *full* blocks keep their
# hashes when they are freed; they sit on the free list until somebody needs a
# block and evicts them, the table's tail first. Here A takes the one free block
# and B evicts the tail of C's table; C's first block survives, so C re-prefills
# only the tokens after it.

# %%
_ = trace("recompute + cache", config("recompute", caching=True))

# %% [markdown]
# ## 4. What each costs
#
# Token counts say what is computed, not what it costs. minicb's cost model
# (`minicb.simulate.simulator`) prices a `StepPlan` from its FLOPs and bytes;
# its `smollm2-135m` preset is fitted to measurements of SmolLM2 on this CPU
# (`bench/calibrate_cpu.py`), `llama-3-8b` to a profile of LLaMA-3-8B on an
# A100. The same three requests, `--scale` times longer (prompts of 128 tokens
# and 256 to generate, by default), in blocks of 16, with 7/9 of the memory they
# need:

# %%
S = args.scale
BIG = [(r, 4 * S, 8 * S) for r, _, _ in REQUESTS]
need = 3 * math.ceil(12 * S / 16)      # blocks to run with no preemption
COSTS = {"CPU": preset("smollm2-135m"), "A100": preset("llama-3-8b")}
for name, cost in COSTS.items():
    kib = cost.kv_bytes_per_token() / 1024
    print(f"{name:>4}: preset {cost.name!r}, K and V {kib:.0f} KiB a token, "
          f"host link {cost.host_bw / 1e9:.0f} GB/s")
big = dict(block_size=16, max_num_batched_tokens=1024, num_host_blocks=need)
runs = {"enough memory": config("recompute", num_blocks=need, **big),
        "recompute": config("recompute", num_blocks=need * 7 // 9, **big),
        "swap": config("swap", num_blocks=need * 7 // 9, **big),
        "recompute + cache": config("recompute", True, num_blocks=need * 7 // 9,
                                    **big)}
print(f"\n{'':<18}{'steps':>6}{'tokens':>7}{'CPU s':>9}{'extra':>8}"
      f"{'A100 ms':>10}{'extra':>8}")
plans_of, base = {}, None
for name, cfg in runs.items():
    eng, plans, _ = run_scheduler(cfg, BIG)
    plans_of[name] = plans
    cpu = sum(COSTS["CPU"].step_time(p) for p in plans)
    gpu = 1e3 * sum(COSTS["A100"].step_time(p) for p in plans)
    base = base or (cpu, gpu)
    st = eng.stats
    print(f"{name:<18}{st.num_steps:>6}{st.num_batched_tokens:>7}"
          f"{cpu:>9.2f}{cpu - base[0]:>+8.2f}"
          f"{gpu:>10.1f}{gpu - base[1]:>+8.1f}")

# %% [markdown]
# Where the extra time goes: the victim C waits until A and B have finished, and
# then runs alone. That is the same in every mode, and it is most of the bill.
# What differs is the step that brings C back:

# %%
print("C's way back: the copies out, plus the step that brings C back,")
print("beyond a plain decode step of C alone:")
print(f"{'':<18}{'C out, back':>12}  {'what':<24}{'CPU ms':>10}{'A100 ms':>10}")
for name in ("recompute", "swap", "recompute + cache"):
    plans = plans_of[name]
    out = next(p for p in plans if p.preempted)
    back = next(p for p in plans if p.step > out.step
                and any(s.request_id == "C" for s in p.seqs))
    after = plans[back.step + 1]            # C decoding alone
    c = next(s for s in back.seqs if s.request_id == "C")
    copies = len(out.swap_out) + len(back.swap_in)
    what = (f"{copies} block copies" if copies else
            f"{c.num_tokens} tokens, {c.start_pos} cached")
    extra = {k: 1e3 * (m.breakdown(out)["swap"] + m.step_time(back)
                       - m.step_time(after)) for k, m in COSTS.items()}
    print(f"{name:<18}{f'{out.step}, {back.step}':>12}  {what:<24}"
          f"{extra['CPU']:>+10.1f}{extra['A100']:>+10.2f}")

# %% [markdown]
# Per token, a swap is cheap: K and V of one token over a 25 GB/s link take
# microseconds, where recomputing it costs a share of a forward pass. On this
# CPU, where compute is scarce, that decides it: the copies cost about a
# millisecond, the re-prefill most of a second. On the A100 a re-prefill is
# *one parallel step* over all the victim's tokens, which is what the GPU is
# good at: it costs milliseconds, the same order as the copies. With prefix
# caching the victim re-hits whatever of its own blocks nobody has evicted yet
# (here its prompt), and recompute becomes cheaper than the copies. Swapping
# also needs host memory, copies the step waits for, and a second pool to
# manage: vLLM V1 preempts by recompute only.
#
# ## 5. Either way the tokens are exactly the same
#
# The real engine with the tiny random model in float64, against the padded
# baseline.

# %%
model = tiny_model()
prompts = [prompt_ids(p, i) for i, (_, p, _) in enumerate(REQUESTS)]
outs = [o for _, _, o in REQUESTS]
params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
base_run = generate_padded(model, prompts, params)
same = True
for mode in ("recompute", "swap"):
    out, _, eng = run_engine(model, config(mode), prompts, outs)
    got = [out[f"r{i}"].token_ids for i in range(len(prompts))]
    same &= got == base_run.token_ids
    print(f"{mode:<16}C's tokens {got[2]}")
print(f"{'padded baseline':<16}C's tokens {base_run.token_ids[2]}")
print(f"recompute, swap and the padded baseline agree token for token: {same}")

# %%
EXERCISES = [
    Exercise(
        "--num-blocks 9",
        "With 9 blocks (exactly what the three requests need in the end), is "
        "anybody preempted?",
        r"^(recompute|swap)( \+ cache)?: \d+ steps",
        "No: every request can grow to its full length. Preemption happens "
        "only when the pool is oversubscribed."),
    Exercise(
        "--num-blocks 6",
        "With 6 blocks, does prefix caching still save the victim any work "
        "(section 3)?",
        r"found cached again",
        "No: A and B each need a block at the same step, and the only blocks "
        "left are C's two, so both are evicted before C comes back."),
]
