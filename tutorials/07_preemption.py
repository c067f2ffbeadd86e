"""Chapter 07: preemption, recompute versus swap.

Run: python tutorials/07_preemption.py

Paged KV admits requests without reserving their whole future (chapter 04), so memory is
oversubscribed: every decode may need a new block, and one day the pool is empty. Then the scheduler
*preempts* a victim, the most recently admitted running request (``minicb.preemption``), in one of two
ways:

* recompute: drop its blocks; it goes back to the front of the waiting queue and later re-prefills its
  prompt plus the tokens it already generated (compute traded for memory);
* swap: copy its blocks to a host (CPU) pool and bring them back before admitting anything new
  (PCIe traffic traded for compute).
"""

from __future__ import annotations

from _common import chapter, explain, prompt_ids, run_engine, run_scheduler, section, tiny_model

from minicb.baseline import generate_padded
from minicb.config import SchedulerConfig
from minicb.sampling_params import SamplingParams

REQUESTS = [("A", 4, 8), ("B", 4, 8), ("C", 4, 8)]      # each ends with 12 tokens = 3 blocks of 4
NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS = 6, 4, 8


def config(mode: str) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, block_size=BLOCK_SIZE,
                           num_blocks=NUM_BLOCKS, num_host_blocks=HOST_BLOCKS if mode == "swap" else 0,
                           preemption_mode=mode, enable_prefix_caching=False)   # plain private tables


def tables(state) -> dict:
    """The parts of a ``SchedulerSnapshot`` this chapter prints."""
    return {"device": {r: list(t) for r, t in state.block_tables},
            "host": {r: list(t) for r, t in state.host_tables},
            "free": list(state.free_blocks),
            "slots": {i: r for i, r in enumerate(state.slots) if r is not None},
            "waiting": list(state.waiting), "swapped": list(state.swapped)}


def show(title: str, snap: dict) -> None:
    print(f"  {title}")
    print(f"    device block tables: {snap['device']}   free blocks: {snap['free']}")
    print(f"    host block tables:   {snap['host']}")
    print(f"    slots: {snap['slots']}   waiting: {snap['waiting']}   swapped: {snap['swapped']}")


def trace_mode(mode: str):
    """Run the scheduler (fake model) and print the block tables around each preemption and swap-in."""
    last, victims = {}, set()

    def on_plan(event) -> None:
        plan, now = event.plan, tables(event.state)
        victims.update(plan.preempted)
        back = [s for s in plan.seqs if s.request_id in victims and s.start_pos == 0]
        for s in back:
            print(f"step {plan.step}: {s.request_id} is admitted again and re-prefills {s.num_tokens} tokens "
                  f"(prompt + the tokens it had generated) into blocks {list(s.block_table)}\n")
        if plan.preempted or plan.swap_in:
            print(f"step {plan.step}: preempted {list(plan.preempted)}, swap_out copies (device, host) "
                  f"{list(plan.swap_out)}, swap_in copies (host, device) {list(plan.swap_in)}")
            show("before this step's plan (the previous step recorded):", last)
            show("after:", now)
            rows = ", ".join(f"{s.request_id}:{s.num_tokens}@{s.start_pos}" for s in plan.seqs)
            print(f"    this step computes (request:tokens@position): {rows}\n")

    def on_step(event) -> None:           # the state once the step is recorded: the next "before"
        last.clear()
        last.update(tables(event.after))

    engine, plans, _ = run_scheduler(config(mode), REQUESTS, on_plan=on_plan, on_step=on_step)
    return engine, plans


def main() -> None:
    chapter(7, "preemption: recompute versus swap")
    explain(f"""
        Three requests, each with a 4-token prompt and 8 tokens to generate, share a pool of only
        {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens. All three are admitted (one block each is enough to
        start); as they decode they need 3 blocks each, 9 in all, so the pool runs out.
    """)
    stats = {}
    for mode in ("recompute", "swap"):
        section(f"preemption_mode={mode!r}" + (f", num_host_blocks={HOST_BLOCKS}" if mode == "swap" else ""))
        sched, plans = trace_mode(mode)
        st = sched.stats
        stats[mode] = st
        print(f"{mode}: {st.num_steps} steps, {st.num_preemptions} preemption(s), {st.num_recomputes} "
              f"recompute, {st.num_swaps} swap-out, {st.num_swap_ins} swap-in, "
              f"{st.num_recomputed_tokens} computed tokens thrown away")
        print(f"{mode}: tokens computed in all: {st.num_batched_tokens}")
    explain("""
        Recompute threw away the victim's cache and fed its prompt and generated tokens again as one
        prefill: more tokens computed, no copies. Swap kept the cache in the host pool and copied it
        back: no extra tokens, but block copies. vLLM V1 uses recompute only; V0 offered both.
    """)

    section("either way the tokens are exactly the same (real engine, tiny random model, float64)")
    model = tiny_model()
    prompts = [prompt_ids(p, i) for i, (_, p, _) in enumerate(REQUESTS)]
    outs = [o for _, _, o in REQUESTS]
    base = generate_padded(model, prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs])
    same = True
    for mode in ("recompute", "swap"):
        out, _, eng = run_engine(model, config(mode), prompts, outs)
        got = [out[f"r{i}"].token_ids for i in range(len(prompts))]
        same &= got == base.token_ids
        print(f"{mode}: {eng.stats.num_preemptions} preemption(s); tokens of the victim "
              f"{got[2]}; preemptions per request {[out[f'r{i}'].num_preemptions for i in range(3)]}")
    print(f"padded baseline: {base.token_ids[2]}")
    print(f"recompute, swap and the padded baseline agree token for token: {same}")


if __name__ == "__main__":
    main()
