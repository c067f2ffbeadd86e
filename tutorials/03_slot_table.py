"""Chapter 03: the slot table.

Run: python tutorials/03_slot_table.py

A batch has a fixed number of rows, "slots" (``max_num_seqs``). A request takes a slot when it is
admitted and gives it back the moment it finishes, so the next step can hand it to a waiting request.
``minicb.slot_table.SlotTable`` is the seed's ``running_slots`` dict plus its ``_find_free_slot_id``:
it always hands out the lowest free slot, which makes the assignment deterministic (every tensor-
parallel rank computes the same one).
"""

from __future__ import annotations

from _common import chapter, explain, run_scheduler, section

from minicb.config import SchedulerConfig
from minicb.errors import InvalidArgument
from minicb.slot_table import SlotTable


def picture(table: SlotTable) -> str:
    cells = [table.owner(s) or "-" for s in range(table.num_slots)]
    free = [s for s in range(table.num_slots) if table.owner(s) is None]
    return "slots: " + " ".join(f"[{s}:{c:^3}]" for s, c in enumerate(cells)) + f"   free: {free}"


def main() -> None:
    chapter(3, "the slot table")
    explain("""
        The seed's scheduler keeps running_slots: Dict[int, SequenceContext] and a _find_free_slot_id()
        helper. minicb's SlotTable is that dict with its invariants checked: a slot holds at most one
        request, a request at most one slot, and free + held = num_slots.
    """)

    section("1. the table, operation by operation")
    table = SlotTable(4)
    print(f"start           {picture(table)}")
    for rid in ("A", "B", "C"):
        slot = table.assign(rid)
        print(f"assign({rid!r}) -> {slot}  {picture(table)}")
    released = table.release(1)
    print(f"release(1) -> {released!r} {picture(table)}   (B finished)")
    slot = table.assign("D")
    print(f"assign('D') -> {slot}  {picture(table)}   (the lowest free slot, not the last freed)")
    slot = table.assign("E")
    print(f"assign('E') -> {slot}  {picture(table)}")
    try:
        table.assign("F")
    except InvalidArgument as e:
        print(f"assign('F') raises InvalidArgument: {e}")
    table.check_integrity()
    print(f"held(): {table.held()}")

    section("2. the slot table inside the scheduler, step by step")
    explain("""
        Three slots, six requests that all arrive at step 0 (prompt length, tokens to generate). The
        scheduler is driven with a fake model (scheduling never depends on token values). After each
        step the finished requests have already released their slots, so the next step refills them.
    """)
    requests = [("A", 4, 2), ("B", 3, 6), ("C", 5, 3), ("D", 2, 4), ("E", 6, 1), ("F", 3, 3)]
    print("requests:", ", ".join(f"{r}(prompt {p}, output {o})" for r, p, o in requests))
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, block_size=4, num_blocks=32)

    def show(event) -> None:            # a PlanEvent: the plan and a snapshot of the scheduler's state
        plan, state = event.plan, event.state
        row = " ".join(f"[{s}:{r or '-':^3}]" for s, r in enumerate(state.slots))
        admitted = [s.request_id for s in plan.seqs if s.start_pos == 0]
        print(f"step {plan.step:2d}  {row}  waiting: {len(state.waiting)}  admitted: {admitted}")

    engine, _, finish = run_scheduler(cfg, requests, on_plan=show)
    print(f"\nfinish step of each request: {finish}")
    print(f"total steps: {engine.stats.num_steps}")
    free = cfg.max_num_seqs - engine.snapshot().num_held_slots
    print(f"after the run: free slots {free} of {cfg.max_num_seqs}")
    explain("""
        Admission follows the seed's loop: while a slot is free and the waiting queue is not empty, take
        the request at the front; if its KV blocks do not fit, it goes back to the front and admission
        stops for this step (no overtaking). Chapter 04 is about those blocks.
    """)


if __name__ == "__main__":
    main()
