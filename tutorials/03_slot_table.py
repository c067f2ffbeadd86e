"""Chapter 03: the slot table.

Run: python tutorials/03_slot_table.py
Prerequisites: chapter 01.

A batch has a fixed number of rows, "slots" (``max_num_seqs``). A request takes
a slot when it is admitted and gives it back the moment it finishes, so the next
step can hand it to a waiting request. ``minicb.core.slot_table.SlotTable`` is
the static-batching note's ``running_slots`` dict plus its
``_find_free_slot_id``: it always hands out the lowest free slot, which makes
the assignment deterministic (every tensor-parallel rank computes the same one).
"""

# %% [markdown]
# The note's scheduler keeps `running_slots: Dict[int, SequenceContext]` and a
# `_find_free_slot_id()` helper. minicb's `SlotTable` is that dict with its
# invariants checked: a slot holds at most one request, a request at most one
# slot, and free + held = `num_slots`.

# %%
from _common import Exercise, flags, run_scheduler

from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.slot_table import SlotTable

args = flags(__doc__, slots=(3, "slots of the scheduler in section 2"))
SLOTS = args.slots


def picture(table: SlotTable) -> str:
    """One cell per slot with its holder, then the free list."""
    cells = [table.owner(s) or "-" for s in range(table.num_slots)]
    free = [s for s in range(table.num_slots) if table.owner(s) is None]
    row = " ".join(f"[{s}:{c:^3}]" for s, c in enumerate(cells))
    return f"{row}  free {free}"


# %% [markdown]
# ## 1. The table, operation by operation
#
# Four slots. A, B and C arrive; B finishes; D and E arrive; F finds no slot.

# %%
table = SlotTable(4)
print(f"start          {picture(table)}")
for rid in ("A", "B", "C"):
    slot = table.assign(rid)
    print(f"assign({rid!r}) -> {slot}  {picture(table)}")
released = table.release(1)
print(f"release(1) -> {released!r} {picture(table)}")
slot = table.assign("D")
print(f"assign('D') -> {slot}  {picture(table)}")
slot = table.assign("E")
print(f"assign('E') -> {slot}  {picture(table)}")
try:
    table.assign("F")
except InvalidArgument as e:
    print(f"assign('F') raises InvalidArgument: {e}")
table.check_integrity()
print(f"held(): {table.held()}")

# %% [markdown]
# D got slot 1, the lowest free slot, not the slot freed last: the rule every
# tensor-parallel rank can compute on its own and agree on (chapter 08).
#
# ## 2. The slot table inside the scheduler, step by step
#
# Three slots, six requests that all arrive at step 0. The scheduler is driven
# with a fake model (scheduling never depends on token values). Each line is one
# step's plan: the slots as the step runs, the waiting queue, and who was
# admitted. After each step the finished requests have already released their
# slots, so the next step refills them.

# %%
REQUESTS = [("A", 4, 2), ("B", 3, 6), ("C", 5, 3), ("D", 2, 4), ("E", 6, 1),
            ("F", 3, 3)]     # (request, prompt length, tokens to generate)
for r, p, o in REQUESTS:
    print(f"{r}: prompt {p}, output {o}")
cfg = SchedulerConfig(max_num_seqs=SLOTS, max_num_batched_tokens=64,
                      block_size=4, num_blocks=32)


def show(event) -> None:
    """A PlanEvent: the plan and a snapshot of the scheduler's state."""
    plan, state = event.plan, event.state
    row = " ".join(f"[{s}:{r or '-':^3}]" for s, r in enumerate(state.slots))
    admitted = [s.request_id for s in plan.seqs if s.start_pos == 0]
    print(f"step {plan.step:2d}  {row}  waiting {len(state.waiting)}"
          f"  admitted {admitted}")


engine, _, finish = run_scheduler(cfg, REQUESTS, on_plan=show)
print(f"\nfinish step of each request: {finish}")
print(f"total steps: {engine.stats.num_steps}")
free = cfg.max_num_seqs - engine.snapshot().num_held_slots
print(f"after the run: free slots {free} of {cfg.max_num_seqs}")

# %% [markdown]
# Admission follows the note's loop: while a slot is free and the waiting queue
# is not empty, take the request at the front; if its KV blocks do not fit, it
# goes back to the front and admission stops for this step (no overtaking).
# Chapter 04 is about those blocks.

# %%
EXERCISES = [
    Exercise(
        "--slots 2",
        "With two slots, how many steps does the run take, and at which step "
        "does F finish?",
        r"^(finish step|total steps)",
        "Fewer slots means more waiting: each request still needs as many "
        "steps as it has tokens to generate, but at most two run at a time."),
    Exercise(
        "--slots 6",
        "With six slots every request is admitted at step 0. How many steps "
        "does the run take, and which request decides it?",
        r"^total steps",
        "The longest request: B generates 6 tokens, one per step, and nobody "
        "waits for a slot."),
]
