"""Chapter 08: tensor-parallel consistency, the StepPlan fingerprint.

Run: python tutorials/08_tensor_parallel_consistency.py
Prerequisites: chapter 05; chapter 07 helps (a rank that runs out of blocks
preempts).

With tensor parallelism every rank holds a slice of every weight matrix and runs
the *same* step on the *same* flat batch; each layer does two all-reduces
(after attention's output projection and after the MLP's down projection) that
sum the ranks' partial results. So all ranks must agree, every step, on the
slot state and on the flat batch. If rank 0 packs 9 tokens and rank 1 packs 8,
their all-reduces do not match: depending on the library and the shapes, the
collective hangs, fails with an error, or (when the shapes happen to agree)
silently sums unrelated numbers. ``StepPlan.fingerprint()`` is a cheap summary
of a plan that ranks can compare before the forward pass.

Sections 1 and 2 use two scheduler replicas in one process, driven in lockstep
with a fake model: the condition any tensor-parallel runtime must check. Section
3 runs the real one, ``minicb.distributed`` (two CPU processes over
``torch.distributed``), where rank 0 schedules, sends each plan to the other
rank and the ranks compare plan digests before every forward pass.
"""

# %% [markdown]
# A fingerprint lists, in order, each scheduled request's id, slot, start
# position, token count, block table and whether it samples, plus the padding
# rows and the swap copies: everything that decides the shapes and the contents
# of the flat batch. Ranks exchange a short digest of it.

# %%
import hashlib
import textwrap

from _common import (
    WIDTH,
    Exercise,
    flags,
    prompt_ids,
    ranks_skip_this_script,
    tiny_model,
)

from minicb.core.config import SchedulerConfig
from minicb.core.errors import DistributedError
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import Sequence
from minicb.runtime.runner import engine_for

args = flags(__doc__,
             blocks_1=(8, "KV blocks of rank 1 in section 2 (rank 0: 9)"))
REQUESTS = [("A", 5, 6), ("B", 7, 9), ("C", 3, 4), ("D", 6, 5), ("E", 4, 7)]
BLOCKS_1 = args.blocks_1


def digest(plan) -> str:
    """What ranks all-gather each step: 8 bytes of a hash of the fingerprint."""
    return hashlib.sha256(repr(plan.fingerprint()).encode()).hexdigest()[:16]


def replica(num_blocks: int) -> Scheduler:
    """One rank's scheduler, fed REQUESTS in order."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16,
                                      block_size=4, num_blocks=num_blocks,
                                      enable_prefix_caching=False))
    for i, (rid, p, o) in enumerate(REQUESTS):
        sched.add(Sequence(rid, prompt_ids(p, i),
                           SamplingParams(max_tokens=o, ignore_eos=True)))
    sched.close_arrivals()
    return sched


sched = replica(32)
plan = sched.schedule()
fingerprint = plan.fingerprint()
print(f"fingerprint of step 0: (step {fingerprint[0]},")
for row in fingerprint[1]:
    print(f"   {row},")
print(f"   padding {fingerprint[2]}, swap out {fingerprint[3]}, "
      f"swap in {fingerprint[4]})")
print(f"its digest (what ranks exchange): {digest(plan)}")

# %% helper: step replicas together and compare their digests
def rows(plan) -> str:
    """request:tokens@position/slot for every row of a plan."""
    return " ".join(f"{s.request_id}:{s.num_tokens}@{s.start_pos}/{s.slot_id}"
                    for s in plan.seqs)


def lockstep(ranks: list[Scheduler]) -> int:
    """Step every replica together; raise DistributedError at the first step
    whose plans disagree. Returns the number of steps."""
    step = 0
    while any(r.has_unfinished() for r in ranks):
        plans = [r.schedule() for r in ranks]
        d = [digest(p) for p in plans]
        same = len(set(d)) == 1
        print(f"  step {step:2d}  {d[0]} {'=' if same else '!='} "
              f"{'same' if same else d[1]:<16}  {rows(plans[0])}")
        if not same:
            detail = "; ".join(
                f"rank {i}: {rows(p)} (free blocks "
                f"{r.snapshot().num_free_blocks} of {r.config.num_blocks})"
                for i, (r, p) in enumerate(zip(ranks, plans, strict=True)))
            raise DistributedError(f"step {step}: ranks disagree on the plan: "
                                   f"{detail}")
        for r, p in zip(ranks, plans, strict=True):
            sampled = {s.request_id: 5 for s in p.seqs if s.sample}
            r.update(p, sampled, float(step))
        step += 1
    return step


# %% [markdown]
# ## 1. Two ranks with identical inputs agree at every step
#
# The scheduler is deterministic: the lowest free slot, the lowest free block,
# FIFO queues, no clocks or randomness in its decisions. Two replicas fed the
# same requests in the same order produce the same plan, step after step. Each
# line: rank 0's digest, rank 1's, and rank 0's plan
# (`request:tokens@position/slot`).

# %%
steps = lockstep([replica(32), replica(32)])
print(f"two identical ranks: {steps} steps, all fingerprints equal")

# %% [markdown]
# ## 2. One rank with less KV memory diverges
#
# A classic way to break it: each rank sizes its KV pool from its own free
# memory, and one GPU has a little less. Rank 1 below has fewer blocks than rank
# 0's 9. Everything agrees until the step where rank 1 runs out of blocks and
# plans differently (it preempts, or admits less).

# %%
try:
    steps = lockstep([replica(9), replica(BLOCKS_1)])
    print(f"ranks with 9 and {BLOCKS_1} KV blocks: no disagreement in "
          f"{steps} steps")
except DistributedError as e:
    print(textwrap.fill(f"DistributedError: {e}", WIDTH,
                        subsequent_indent="  "))
    diverged = int(str(e).split(":")[0].split()[1])
    print(f"ranks with 9 and {BLOCKS_1} KV blocks first disagree at step "
          f"{diverged}")

# %% [markdown]
# Without the check, rank 0 would enter the first all-reduce of that step with
# one tensor shape and rank 1 with another: a hang, an error far from the cause,
# or, if the shapes happened to match, wrong numbers and no error at all. With
# the check (one tiny all-gather of the digest per step) every rank raises the
# same clear error instead. That is why vLLM gives all ranks the same KV
# capacity (the minimum over the workers) and why minicb's scheduler never
# consults anything rank-local.
#
# ## 3. The real thing: `minicb.distributed`, two processes on this CPU
#
# minicb's tensor parallelism avoids the replica problem altogether: only rank 0
# runs the scheduler; it sends each plan to the other ranks, and all ranks
# all-gather an 8-byte digest of (plan number, fingerprint) and compare before
# the forward pass. The tiny model's 4 query / 2 KV heads are split over 2
# ranks; the two all-reduces per layer sum their partial results (2 layers:
# 4 all-reduces a step, one plan a step).

# %%
def generate(engine) -> dict[str, list[int]]:
    """Run REQUESTS through an engine; tokens by request id."""
    for i, (rid, p, o) in enumerate(REQUESTS):
        engine.add_request(rid, prompt_ids(p, i),
                           SamplingParams(max_tokens=o, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    return outs


try:
    from minicb.distributed import Fault, launch
except ImportError as e:         # a torch built without torch.distributed
    print(f"(minicb.distributed is not available here: {e})")
    launch = None
if launch is not None:
    model = tiny_model()
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16,
                          block_size=4, num_blocks=32,
                          enable_prefix_caching=False)
    single = generate(engine_for(model, cfg))
    with ranks_skip_this_script():     # rank 1 is a new process (see _common)
        engine = launch(model, cfg, tensor_parallel_size=2)
    try:
        both = generate(engine)
        stats = engine.runner.comm_stats
    finally:
        engine.shutdown()
    print(f"2 ranks: {stats.plans} plans sent and checked, "
          f"{stats.all_reduce_calls} all-reduces")
    print(f"tensor-parallel tokens equal to a single process: {both == single}")

# %% [markdown]
# Now the failure on purpose: a test hook (`Fault`) makes rank 1 run an altered
# plan at its 4th step (plan 3), as a bug in a rank's bookkeeping would. The
# digests differ, and every rank raises `DistributedError` before the forward
# pass instead of entering mismatched all-reduces.

# %%
if launch is not None:
    with ranks_skip_this_script():
        engine = launch(model, cfg, tensor_parallel_size=2,
                        fault=Fault(rank=1, at=3, kind="diverge"))
    try:
        generate(engine)
        print("no error (unexpected)")
    except DistributedError as e:
        print(textwrap.fill(f"DistributedError on rank 0: "
                            f"{str(e).split('; rank 1:')[0]}", WIDTH,
                            subsequent_indent="  "))
    finally:
        engine.shutdown()

# %%
EXERCISES = [
    Exercise(
        "--blocks-1 9",
        "Give rank 1 the same 9 blocks as rank 0. Do the ranks ever disagree?",
        r"^ranks with 9 and",
        "No: the same inputs and the same capacity give the same plans, "
        "step after step, however tight memory is."),
    Exercise(
        "--blocks-1 6",
        "With only 6 blocks on rank 1, do the ranks disagree earlier or later "
        "than with 8?",
        r"^ranks with 9 and",
        "Earlier: the smaller pool runs out sooner, so rank 1 has to plan "
        "differently (admit less, or preempt) at an earlier step."),
]
