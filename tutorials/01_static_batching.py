"""Chapter 01: static batching and its padding bubbles.

Run: python tutorials/01_static_batching.py
Prerequisites: none (the home page's "What continuous batching is, and why" is
the setting).

A static batch runs a fixed group of requests together until the longest one
ends. Requests that end early keep their row and compute padding; requests that
arrive meanwhile wait outside. We measure that waste with minicb's padded
baseline (``minicb.runtime.baseline.generate_padded``), then draw the
space-time picture of the static-batching note (the text this project grew
from) for static versus continuous batching with ``minicb.measure.trace``.
"""

# %% [markdown]
# Classic inference servers batch requests the way CNN or BERT servers do: take
# a fixed group, pack it into one `[batch, max_len]` tensor, run until every
# member is done. LLM decoding makes that wasteful, because output lengths
# differ wildly: a request that ends after 3 tokens keeps its row and computes
# padding until the longest member ends.
#
# Four requests, each a (prompt length, tokens to generate) pair. A is short and
# B is long: the note's A and B. The model is a 2-layer random LLaMA in float64,
# so everything runs in seconds and tokens can be compared exactly.

# %%
from _common import WIDTH, Exercise, flags, prompt_ids, run_engine, tiny_model

from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.measure.trace import render_ascii
from minicb.runtime.baseline import generate_padded

args = flags(__doc__, slots=(2, "batch slots (max_num_seqs) in section 2"))
REQUESTS = {"A": (5, 3), "B": (3, 14), "C": (6, 5), "D": (4, 4)}
SLOTS = args.slots

model = tiny_model()
names = list(REQUESTS)
prompts = [prompt_ids(p, i) for i, (p, _) in enumerate(REQUESTS.values())]
outs = [o for _, o in REQUESTS.values()]
params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]

# %% helper: draw the padded batch row by row
def padded_rows(prompt_lens, out_lens) -> list[str]:
    """'.' left padding, P prompt, t generated, x computed for nothing."""
    width_p, steps = max(prompt_lens), max(out_lens)
    rows = []
    for name, p, o in zip(names, prompt_lens, out_lens, strict=True):
        prompt = "." * (width_p - p) + "P" * p
        rows.append(f"  row {name}  {prompt} | " + "t" * o + "x" * (steps - o))
    return rows


# %% [markdown]
# ## 1. One padded static batch of all four requests
#
# `generate_padded` is minicb's oracle: the plain, padded way to generate. Every
# prompt is left-padded to the longest one, and the batch decodes until its
# longest member has all its tokens.

# %%
result = generate_padded(model, prompts, params, eos_token_id=None)
print("\n".join(padded_rows([len(p) for p in prompts], outs)))
print("         prompt   generated -> ('.' padding, 'x' a finished row's step)")
print(f"\nforward steps: {result.steps}")
print(f"token slots computed: {result.total_token_slots}, "
      f"of which padding: {result.padded_token_slots}")
print(f"padding waste of the static batch: {100 * result.padding_waste:.2f}%")

# %% [markdown]
# The note quotes 68.5% padding waste for static batching on ShareGPT, where
# lengths range from 100 to 2,000 tokens; four tiny requests already waste a
# large share.
#
# ## 2. The note's space-time picture: static versus continuous
#
# Now the same four requests compete for a few slots (`max_num_seqs`, 2 by
# default). Each character is one slot in one step: a letter is real work (UPPER
# = the prefill step, lower = a decode), `.` is padding, a blank is an idle
# slot. The static policy runs A and B as one batch until B is done, then C and
# D. The continuous policy refills A's slot with C at the very next step.

# %%
results = {}
for policy in ("static", "continuous"):
    cfg = SchedulerConfig(max_num_seqs=SLOTS, max_num_batched_tokens=64,
                          block_size=4, num_blocks=64, policy=policy)
    out, trace, eng = run_engine(model, cfg, prompts, outs)
    results[policy] = (out, trace, eng)
    print(render_ascii(trace, width=WIDTH, colour=False, legend=False,
                       summary=False))
    print("(" + ", ".join(f"{trace.label(f'r{i}')}=request {n}"
                          for i, n in enumerate(names)) + ")")
    first = {n: int(out[f"r{i}"].first_scheduled_time)
             for i, n in enumerate(names)}
    print(f"{policy}: {trace.num_steps} steps; first step of each request:")
    print(f"  {first}")
    print(f"{policy}: scheduler counted {eng.stats.num_padding_tokens} "
          "padding tokens\n")

# %% [markdown]
# Why does the scheduler count 16 padding tokens when section 1 counted 36?
# Section 1 padded *one* batch of all four: every prompt to C's 6 tokens
# (1 + 3 + 0 + 2 = 6 padding tokens) and every row to B's 14 tokens (A, C and D
# idle 11 + 9 + 10 = 30 steps): 36. With 2 slots the static policy forms two
# batches of two, each padded only to its own members: A with B (B's prompt
# padded to A's 5: 2 tokens; A idles 11 steps), then C with D (D's prompt to
# C's 6: 2; D idles 1 step): 2 + 11 + 2 + 1 = 16. A `.` in the picture is
# one of those idle steps. Smaller batches pad less, but C and D wait for B.
#
# Count the steps and the share of (slot, step) cells that did real work:

# %%
static, cont = results["static"][1], results["continuous"][1]
print(f"steps: static {static.num_steps}, continuous {cont.num_steps}")
util = {name: 100 * t.summary().slot_utilisation
        for name, t in (("static", static), ("continuous", cont))}
print(f"slot utilisation: static {util['static']:.1f}%, "
      f"continuous {util['continuous']:.1f}%")
same = all(results["static"][0][f"r{i}"].token_ids
           == results["continuous"][0][f"r{i}"].token_ids
           == result.token_ids[i] for i in range(len(names)))
print("every request got the same tokens under static, continuous and the")
print(f"padded baseline: {same}")

# %% [markdown]
# Continuous batching changes *when* each request runs, never *what* it
# computes: the tokens are identical (minicb's tests assert this for every
# policy, chunk size and preemption mode). Next chapter: how a batch with no
# padding at all is laid out (ragged packing).

# %%
EXERCISES = [
    Exercise(
        "--slots 4",
        "With four slots all four requests fit in one batch. How many steps do "
        "static and continuous take now?",
        r"^steps: static",
        "The same number: nobody waits for a slot, so continuous batching has "
        "nothing to refill. Static still computes its padding rows; continuous "
        "leaves those slots idle instead. Its gain comes from handing a freed "
        "slot to a waiting request, and here none waits."),
    Exercise(
        "--slots 1",
        "With a single slot, is there any padding left under static batching?",
        r"^static: scheduler counted",
        "None: a batch of one has no shorter member to pad and no finished "
        "member to carry. One slot serves the requests one after another under "
        "both policies."),
]
