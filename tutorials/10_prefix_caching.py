"""Chapter 10: prefix caching, reusing the KV of a shared prefix.

Run: python tutorials/10_prefix_caching.py
Prerequisites: chapters 04 (block tables) and 05; chapter 07 helps.

Many requests start with the same tokens: a system prompt, a few-shot preamble,
the earlier turns of a conversation. The keys and values of those tokens are the
same in every request, so computing them once is enough. Prefix caching (vLLM's
"automatic prefix caching") keeps every *full* block of the paged KV cache
findable by a hash of its tokens and of everything before it; a new request
looks its blocks up at admission and computes only the rest.
``minicb.core.block_manager`` implements it; this chapter drives it by hand,
then through the scheduler and the real engine.
"""

# %% [markdown]
# Two prompts share a 6-token system prompt and differ after it. With blocks of
# 4 tokens, the first block is all system prompt; the second mixes the end of
# the system prompt with the user's first tokens.

# %%
import textwrap

from _common import (
    WIDTH,
    Exercise,
    flags,
    prompt_ids,
    run_engine,
    run_scheduler,
    tiny_model,
)

from minicb.core.block_manager import ROOT_HASH, BlockManager, hash_block
from minicb.core.config import SchedulerConfig

args = flags(__doc__, shared=(6, "tokens of the shared system prompt"))
BLOCK_SIZE, SHARED, NUM_BLOCKS = 4, args.shared, 16
SYSTEM = prompt_ids(SHARED, 9)
PROMPT_A = SYSTEM + prompt_ids(5, 1)
PROMPT_B = SYSTEM + prompt_ids(5, 2)


def blocks(tokens: list[int]) -> list[tuple[int, ...]]:
    """The full blocks of a token list (a partial last one is never hashed)."""
    bs = BLOCK_SIZE
    n = len(tokens) // bs
    return [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n)]


def short(h: int) -> str:
    return f"{h & 0xFFFFFFFF:08x}"     # 8 hex digits of a 64-bit hash


# %% [markdown]
# ## 1. The hash chain
#
# A block's hash is `hash_block(parent_hash, its_tokens)`: the parent is the
# hash of the block before it (`ROOT_HASH` for the first). So a block's hash
# stands for *all* the tokens up to its end, not just its own four: the same
# four tokens after a different beginning get a different hash. That matters
# because a token's K and V depend on every token before it.

# %%
for name, prompt in (("A", PROMPT_A), ("B", PROMPT_B)):
    print(textwrap.fill(f"prompt {name}: {prompt}", WIDTH,
                        subsequent_indent="  "))
    parent = ROOT_HASH
    for i, toks in enumerate(blocks(prompt)):
        h = hash_block(parent, toks)
        print(f"  block {i} {str(list(toks)):<18} hash(parent {short(parent)}, "
              f"tokens) = {short(h)}")
        parent = h
    print(f"  ({len(prompt) % BLOCK_SIZE} tokens in a partial last block: "
          "not hashed)")

# %% [markdown]
# Block 0 has the same hash in both prompts. Block 1 differs: its tokens differ
# (A's and B's user parts start there), and from there on every hash differs,
# even where the tokens might agree again.
#
# ## 2. Hits: B shares A's first block
#
# A block enters the cache once it is full *and* its K/V has been computed
# (`cache_full_blocks`, which the scheduler calls after each step). At B's
# admission, `computed_blocks` walks B's full blocks from the first and returns
# the longest chain found in the cache; `allocate(..., computed=hits)` starts
# B's table with those blocks, shared: their ref count goes up, and B computes
# only the positions after them.

# %% helper: draw the prefix tree of the cache
def tree(bm: BlockManager) -> None:
    """Each cached block under its parent, with its ref count and holders."""
    records = bm.cache.blocks
    holders = {b: [r for r, t in bm.block_tables.items() if b in t]
               for b in records}

    def show(parent, indent: str) -> None:
        children = sorted(b for b, rec in records.items()
                          if rec.parent == parent)
        for k, b in enumerate(children):
            last = k == len(children) - 1
            who = ",".join(holders[b]) or "free, still cached"
            print(f"{indent}{'└─' if last else '├─'} block {b} "
                  f"{list(records[b].token_ids)}  ref {bm.device.ref_counts[b]}"
                  f" ({who})")
            show(b, indent + ("   " if last else "│  "))

    print("ROOT")
    show(None, "")


# %%
bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
print(f"A: allocate -> blocks {bm.allocate('A', len(PROMPT_A))}")
# A's prefill step ran; the scheduler's update() then offers its full blocks:
added = bm.cache_full_blocks("A", PROMPT_A, len(PROMPT_A))
print(f"A: cache_full_blocks -> {added} blocks cached")
hits = bm.computed_blocks(PROMPT_B)
print(f"B: computed_blocks -> {hits}: {len(hits) * BLOCK_SIZE} of its "
      f"{len(PROMPT_B)} tokens need no compute")
print(f"B: allocate(computed={hits}) -> new blocks "
      f"{bm.allocate('B', len(PROMPT_B), computed=hits)}")
bm.cache_full_blocks("B", PROMPT_B, len(PROMPT_B))
print(f"block tables: {bm.block_tables}")
bm_a, bm_b = bm.block_table("A"), bm.block_table("B")
tree(bm)
bm.check_integrity()

# %% [markdown]
# A hit never covers a whole request: at least its last token is computed,
# because the model must produce logits to sample the next token from. A prompt
# of exactly k full blocks, all cached, reuses k - 1 of them:

# %%
again = PROMPT_A[:len(blocks(PROMPT_A)) * BLOCK_SIZE]
print(f"a prompt of {len(again)} tokens = {len(blocks(again))} full cached "
      f"blocks: computed_blocks -> {bm.computed_blocks(again)}")

# %% [markdown]
# ## 3. LRU eviction: freed blocks stay cached until somebody needs them
#
# When A and B finish, their blocks return to the pool, but the full ones keep
# their hashes: a later request with the same prefix can still hit them. They
# wait on an LRU list, a table's *tail first*, so that when a block must be
# reused the least recently used leaf of the tree goes first and the shared root
# stays longest. `take` hands out blocks that hold nothing cached first, and
# evicts only when there are none left.

# %%
bm.free("A")
bm.free("B")
print(f"after A and B finish: free {bm.num_free_blocks} of {bm.num_blocks}, "
      f"cached {bm.num_cached_blocks}")
print("LRU order (evicted first on the left): "
      f"{bm.device.cached_free_blocks()}")
owner = {b: "/".join(r for r, t in (("A", bm_a), ("B", bm_b)) if b in t)
         for b in set(bm_a + bm_b)}
before = set(bm.cache.blocks)
need = bm.num_free_blocks - len(bm.device.cached_free_blocks()) + 1
other = prompt_ids(need * BLOCK_SIZE, 5)
print(f"C ({len(other)} unrelated tokens) takes {need} blocks:")
print(f"   {bm.allocate('C', len(other))}")
gone = sorted(before - set(bm.cache.blocks))
print(f"evicted: {[f'block {b} (of {owner[b]})' for b in gone]}")
print(f"still cached: {sorted(bm.cache.blocks)}; LRU order now "
      f"{bm.device.cached_free_blocks()}")
print(f"B's prompt again: computed_blocks -> {bm.computed_blocks(PROMPT_B)}")
tree(bm)
bm.check_integrity()

# %% [markdown]
# C took every block that held nothing cached, then evicted the least recently
# used cached block: a leaf of the tree, from the table freed first. The shared
# root goes last, because every table that holds a block also holds its parent,
# so a parent always returns to the LRU list after its children.
#
# ## 4. With and without, on the scheduler
#
# Eight requests with the same system prompt and their own 6-token questions,
# one arriving every second step, two slots. The scheduler (fake model, chapter
# 03) with prefix caching off and on:

# %%
N = 8
prompts = [SYSTEM + prompt_ids(6, 20 + k) for k in range(N)]
requests = [(f"r{k}", len(p), 4) for k, p in enumerate(prompts)]
arrivals = [2 * k for k in range(N)]
for caching in (False, True):
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                          block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                          enable_prefix_caching=caching)
    eng, plans, _ = run_scheduler(cfg, requests, arrivals, prompts=prompts)
    st = eng.stats
    label = f"caching {'on ' if caching else 'off'}"
    print(f"{label}: {st.num_steps} steps, {st.num_batched_tokens} tokens "
          "computed")
    print(f"{label}: prompt tokens from the cache "
          f"{st.num_cached_prompt_tokens} of {st.num_prompt_tokens} "
          f"({100 * st.prefix_cache_hit_rate:.0f}%)")

# %% [markdown]
# Every request after the first finds the full blocks of the system prompt; the
# end of the system prompt that shares a block with the question is computed
# again each time (only full blocks are cached). On a real model the saving is
# the prefill compute of the cached tokens, and the time to first token with it.
#
# ## 5. The tokens do not change (real engine, tiny random model)
#
# Reusing K/V computed for another request must give exactly what computing them
# again would: the same tokens, request by request. `RequestOutput` reports how
# many prompt tokens each request found cached.

# %%
model = tiny_model()
got = {}
for caching in (False, True):
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                          block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                          enable_prefix_caching=caching)
    outs, _, _ = run_engine(model, cfg, prompts, [4] * N, arrivals)
    got[caching] = [outs[f"r{k}"].token_ids for k in range(N)]
    cached = [outs[f"r{k}"].num_cached_tokens for k in range(N)]
    print(f"caching {'on ' if caching else 'off'}: cached prompt tokens per "
          f"request {cached}")
print("identical tokens with and without prefix caching: "
      f"{got[False] == got[True]}")

# %%
EXERCISES = [
    Exercise(
        "--shared 3",
        "With a 3-token system prompt (less than a block), how many prompt "
        "tokens come from the cache in section 4?",
        r"^caching on : prompt tokens from the cache",
        "None: only full blocks are cached, and the first block of every "
        "prompt already holds the request's own question."),
    Exercise(
        "--shared 16",
        "With a 16-token system prompt (four full blocks), what share of the "
        "prompt tokens comes from the cache?",
        r"^caching (on |off): prompt tokens from the cache",
        "Much more: the whole system prompt is four full blocks, and every "
        "request after the first finds all four."),
]
