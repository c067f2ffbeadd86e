"""Chapter 02: ragged packing and cu_seqlens.

Run: python tutorials/02_ragged_packing.py
Prerequisites: chapter 01.

Continuous batching mixes, in one forward step, a decode token of one request, a
whole prompt of another and a prompt chunk of a third. Instead of a padded
[batch, max_len] tensor, minicb (like vLLM and SGLang) lays every scheduled
token end to end in one flat tensor and records where each request's tokens
start: ``cu_seqlens``. ``minicb.runtime.packer.pack`` turns a ``StepPlan`` into
these tensors.
"""

# %% [markdown]
# The static-batching note's example: the flat sequence `[TokenA_0, TokenB_37,
# TokenC_0, TokenC_1, TokenC_2]` with `cu_seqlens` = `[0, 1, 2, 5]`. We make it
# happen with the real engine: request B has a 37-token prompt and is decoding
# position 37; A (a 1-token prompt) and C (a 3-token prompt) arrive. minicb's
# planner puts decodes first, so B's token leads; the offsets are the note's.
#
# Prefix caching (chapter 10) is off here: every request gets plain, private
# block tables.

# %%
import torch
from _common import Exercise, flags, prompt_ids, tiny_model

from minicb.core.config import SchedulerConfig
from minicb.core.plan import DECODE, row_kind
from minicb.core.sampling_params import SamplingParams
from minicb.model.attention import ReferenceAttention
from minicb.runtime.packer import pack, pack_prompts
from minicb.runtime.runner import engine_for

args = flags(__doc__, b_prompt=(37, "B's prompt length"),
             block_size=(4, "token positions per KV block"))
B_PROMPT, BLOCK_SIZE = args.b_prompt, args.block_size

model = tiny_model()
cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128,
                      block_size=BLOCK_SIZE, num_blocks=64,
                      enable_prefix_caching=False)
eng = engine_for(model, cfg)
plans = []
eng.listen(on_plan=lambda event: plans.append(event.plan))
params = SamplingParams(max_tokens=4, ignore_eos=True)
prompt_len = {"B": B_PROMPT, "A": 1, "C": 3}
eng.add_request("B", prompt_ids(B_PROMPT, 1), params)
eng.step()          # B's prefill; it samples the token at position B_PROMPT
eng.add_request("A", prompt_ids(1, 0), params)
eng.add_request("C", prompt_ids(3, 2), params)
eng.step()          # B decodes that position; A and C prefill
plan = plans[-1]

# %% [markdown]
# ## 1. The StepPlan the scheduler made
#
# Plain Python, no tensors: for every request, its slot, the positions it
# computes this step, its block table and whether a token is sampled from it.

# %%
for s in plan.seqs:
    n_prompt = prompt_len[s.request_id]
    # a row is a decode when it starts past the prompt (core.plan.row_kind)
    kind = row_kind(s.start_pos, s.num_tokens, n_prompt)
    kind = "decode" if kind == DECODE else "prompt"
    last = s.start_pos + s.num_tokens - 1
    print(f"{s.request_id}: slot {s.slot_id}, {kind}, positions "
          f"{s.start_pos}..{last}, sample={s.sample}")
    print(f"   block_table {list(s.block_table)}")

# %% [markdown]
# ## 2. `pack(plan)`: one flat tensor, no padding

# %% helper: print the flat batch with one label per token
def show_flat(plan, batch) -> None:
    labels = [f"{s.request_id}_{s.start_pos + j}"
              for s in plan.seqs for j in range(s.num_tokens)]

    def row(name, values):
        print(f"{name:<12}: [ " + ", ".join(f"{v:>4}" for v in values) + " ]")

    row("flat tokens", labels)
    row("input_ids", batch.input_ids.tolist())
    row("positions", batch.positions.tolist())
    marks = [" "] * (len(labels) * 6 + 1)
    for c in batch.attn.cu_seqlens_q.tolist():
        marks[c * 6] = "^"
    print(f"{'boundaries':<12}:  " + "".join(marks))


# %%
batch = pack(plan)
show_flat(plan, batch)
meta = batch.attn
print(f"cu_seqlens_q = {meta.cu_seqlens_q.tolist()}")
print(f"cu_seqlens_k = {meta.cu_seqlens_k.tolist()}   (cached keys + new ones)")
print(f"context_lens = {meta.context_lens.tolist()}")
print(f"slot_mapping = {meta.slot_mapping.tolist()}")
bs = BLOCK_SIZE
print(f"   (block_table[pos // {bs}] * {bs} + pos % {bs})")
print("block_tables = (one row per sequence, 0-padded)")
for s, table in zip(plan.seqs, meta.block_tables.tolist(), strict=True):
    print(f"   {s.request_id}: {table}")
n_seqs = len(plan.seqs)
longest = max(s.num_tokens for s in plan.seqs)
print(f"\nflat tokens computed: {batch.num_tokens}")
print(f"a padded [batch={n_seqs}, max_len={longest}] tensor would compute "
      f"{n_seqs * longest} token rows,")
print(f"{n_seqs * longest - batch.num_tokens} of them padding")
# attention also reads keys: a padded batch gives every query row the
# longest context's keys; the ragged one gives a row its own request's keys
q_len = meta.cu_seqlens_q.diff().tolist()
k_len = meta.cu_seqlens_k.diff().tolist()
padded_pairs = n_seqs * longest * max(k_len)
ragged_pairs = sum(q * k for q, k in zip(q_len, k_len, strict=True))
print(f"query-key scores: padded [{n_seqs}, {longest}] x {max(k_len)} keys = "
      f"{padded_pairs},")
terms = " + ".join(f"{q}x{k}" for q, k in zip(q_len, k_len, strict=True))
print(f"ragged {terms} = {ragged_pairs}")

# %% [markdown]
# Token rows are only half of padding's cost. The weights' matmuls cost per
# row, but attention costs per query-key pair: padded, every one of the 9 rows
# would score the longest context's keys (B's cached ones), so the short
# prompts pay for B's history too. Ragged, each row scores its own keys.
#
# Every layer except attention works token by token, so it does not care which
# request a row belongs to. Attention uses `cu_seqlens` to keep requests apart:
# the query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]` attend only to request i's
# own keys (its cached blocks, found through its block table, plus its new
# tokens). FlashAttention's varlen kernel takes exactly these arrays; minicb's
# reference backend does the same in plain PyTorch.
#
# ## 3. The attention mask those offsets describe
#
# One row per flat query token, one column per key of the step, the keys of each
# request side by side (`cu_seqlens_k` cuts them). `#`: the query attends to
# that key; `.`: a key of its own request in its future; blank: another
# request's key, never looked at. No row ever reaches into another request's
# columns, and a query at position p sees keys 0..p of its own request.

# %%
q_cu, k_cu = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
positions = batch.positions.tolist()
print(("keys: " + "|".join(s.request_id.ljust(k_cu[i + 1] - k_cu[i])
                           for i, s in enumerate(plan.seqs))).rstrip())
for i, s in enumerate(plan.seqs):
    for row in range(q_cu[i], q_cu[i + 1]):
        cells = []
        for j in range(n_seqs):
            n_keys = k_cu[j + 1] - k_cu[j]
            cells.append("".join("#" if k <= positions[row] else "."
                                 for k in range(n_keys)) if j == i
                         else " " * n_keys)
        label = f"{s.request_id}_{positions[row]}"
        print((f"{label:<6}" + "|".join(cells)).rstrip())

# %% [markdown]
# ## 4. Proof that packing keeps requests apart
#
# Three whole prompts packed into one forward pass give the same logits as three
# separate forward passes, up to float64 rounding.

# %%
prompts = [prompt_ids(1, 0), prompt_ids(B_PROMPT, 1), prompt_ids(3, 2)]
packed = pack_prompts(prompts)
backend = ReferenceAttention(None)
together = model(packed.input_ids, packed.positions, backend, packed.attn,
                 packed.logits_indices)
diffs = []
for i, p in enumerate(prompts):
    alone = pack_prompts([p])
    logits = model(alone.input_ids, alone.positions, backend, alone.attn,
                   alone.logits_indices)
    lo = packed.attn.cu_seqlens_q[i].item()
    hi = packed.attn.cu_seqlens_q[i + 1].item()
    diffs.append((together[lo:hi] - logits).abs().max().item())
assert torch.isfinite(together).all()
print(f"three whole prompts packed: cu_seqlens_q = "
      f"{packed.attn.cu_seqlens_q.tolist()}")
print("max |logits packed - logits alone| per request: "
      + ", ".join(f"{d:.1e}" for d in diffs))
print("same logits as running each request alone (up to float64 rounding): "
      f"{max(diffs) < 1e-12}")

# %%
EXERCISES = [
    Exercise(
        "--b-prompt 40",
        "B's prompt is now 40 tokens long. What are cu_seqlens_q and "
        "cu_seqlens_k?",
        r"^cu_seqlens_[qk] =",
        "The query offsets do not change: B still computes one token, A one "
        "and C three. The key offsets grow with B's context: its cached "
        "prompt plus the token it decodes."),
    Exercise(
        "--block-size 8",
        "With blocks of 8 positions, which KV slots do A's and C's tokens get "
        "(slot_mapping)?",
        r"^slot_mapping =",
        "B's 38 positions fill blocks 0..4 (the last one partly), so A's token "
        "goes to the start of block 5 and C's three tokens to the start of "
        "block 6: block * 8 + offset."),
]
