"""The docs' pictures, drawn from the code: every picture is a real object of a real run, not a sketch.

Five pictures, each computed by minicb's own modules and then drawn with matplotlib:

* ``ragged-mask``: the attention mask of one *mixed* step of the continuous engine (three decodes and
  a 4-token prompt chunk that follows 4 cached tokens), built from the step's packed batch
  (``pack(plan).attn``: ``cu_seqlens_q``, ``cu_seqlens_k``, ``start_pos``). Each query row sees only
  its own sequence's keys, and within them the causal triangle is *bottom-right aligned*: query ``i``
  of a chunk sits at position ``start_pos + i``, so the chunk's last query sees every key::

      keys of D:   D0 D1 D2 D3 | D4 D5 D6 D7        (D0..D3 cached, D4..D7 computed this step)
      query D4     ■  ■  ■  ■    ■  .  .  .
      query D7     ■  ■  ■  ■    ■  ■  ■  ■         (top-left alignment would stop D4 at D0)

* ``block-tables``: the same step's logical -> physical block tables and ``slot_mapping``: where in
  the paged KV pool each packed token's K/V is written (``block_table[p // block_size] * block_size
  + p % block_size``).
* ``prefix-tree``: a ``BlockManager`` with prefix caching after three requests that share a system
  prompt: the cached full blocks form a tree (each block's parent is the block before it), with ref
  counts, the blocks a finished request left on the LRU list, and what a new request's lookup hits.
* ``policies``: one workload with arrivals over time run by the static, dynamic and continuous policies,
  stacked on one time axis (steps), each request in the same colour in all three, arrival ticks under
  each timeline; ``static-vs-continuous`` (the home page's): the ``minicb trace`` workload of the docs
  under static and continuous batching on one time axis, so the speed-up is a length you can see.

Every SVG keeps its text as text, at least 11 px at the size it declares (``trace.save_readable``), and
the docs show SVGs at that size (``docs/assets/pictures.css``); ``tests/docs/test_readable.py``
measures the text in headless Chromium.

``write_all(out_dir)`` writes ``NAME.json`` (the data, computed by running the code) and ``NAME.svg``
(drawn from that JSON only). The SVG's metadata holds the JSON's SHA-256, so a test can tell a stale
picture from a current one without comparing pixels; ``python -m minicb.measure.pictures --check DIR``
says whether the committed data still matches the code. ``make docs-pages`` regenerates them.
Running the code needs torch (a tiny random model; a second or two); drawing needs matplotlib.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
from collections.abc import Callable

from minicb.core.block_manager import BlockManager
from minicb.measure.trace import (
    _LABELS,
    DECODE,
    IDLE,
    PADDING,
    PREFILL,
    STALL,
    Cell,
    SlotTrace,
    _pyplot,
    draw_trace,
    legend_handles,
    request_colour,
    save_readable,
    text_colour,
)

NAMES = ("ragged-mask", "block-tables", "prefix-tree", "policies", "static-vs-continuous")
CACHED_ALPHA = 0.45          # keys already in the cache are drawn lighter than this step's new keys


# --- the mixed step ---------------------------------------------------------------------------------
def mixed_step():
    """Run a tiny random model through the continuous engine and return ``(plan, state)`` of the
    first step that mixes at least two decodes with a prompt chunk that follows cached tokens.

    Requests (prompts of token ids 10.., 40.., 70.., 100..): A (5 tokens) and B (3) arrive at step 0,
    C (2) at step 1, D (11) at step 3. The budget is 8 tokens a step and a prompt may take at most 4 of
    them, so D's prompt is fed in chunks of 4 beside the others' decodes."""
    import torch

    from minicb.core.config import TINY_MODEL, SchedulerConfig
    from minicb.core.sampling_params import SamplingParams
    from minicb.engine.arrivals import Arrival, drive
    from minicb.model.llama import LlamaForCausalLM
    from minicb.runtime.runner import engine_for

    model = LlamaForCausalLM.random(TINY_MODEL, seed=0, dtype=torch.float32, std=0.3)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, long_prefill_chunk=4,
                             block_size=4, num_blocks=16, enable_prefix_caching=False)
    engine = engine_for(model, config, seed=0, clock=lambda: 0.0)
    found = []

    def on_plan(event) -> None:
        seqs = event.plan.seqs
        decodes = sum(s.num_tokens == 1 for s in seqs)
        late_chunk = any(s.num_tokens > 1 and s.start_pos > 0 for s in seqs)
        if not found and decodes >= 2 and late_chunk:
            found.append((event.plan, event.state))

    engine.listen(on_plan=on_plan)

    def prompt(n: int, first: int) -> list[int]:
        return list(range(first, first + n))

    drive(engine, [Arrival(0, "A", prompt(5, 10), SamplingParams(max_tokens=6, ignore_eos=True)),
                   Arrival(0, "B", prompt(3, 40), SamplingParams(max_tokens=8, ignore_eos=True)),
                   Arrival(1, "C", prompt(2, 70), SamplingParams(max_tokens=8, ignore_eos=True)),
                   Arrival(3, "D", prompt(11, 100), SamplingParams(max_tokens=3, ignore_eos=True))])
    if not found:
        raise RuntimeError("the mixed-step scenario produced no step with decodes and a late chunk")
    return found[0]


def ragged_mask(cu_seqlens_q: list[int], cu_seqlens_k: list[int], start_pos: list[int]) -> list[list[bool]]:
    """The ``[num_tokens, num_keys]`` mask of a ragged step: row ``cu_q[b] + i`` (query ``i`` of
    sequence ``b``) may attend to column ``cu_k[b] + j`` (key ``j`` of the same sequence) iff
    ``j <= start_pos[b] + i``: only its own sequence, causal, bottom-right aligned."""
    n, k = cu_seqlens_q[-1], cu_seqlens_k[-1]
    mask = [[False] * k for _ in range(n)]
    for b in range(len(start_pos)):
        for i in range(cu_seqlens_q[b + 1] - cu_seqlens_q[b]):
            for j in range(start_pos[b] + i + 1):
                mask[cu_seqlens_q[b] + i][cu_seqlens_k[b] + j] = True
    return mask


def _plan_rows(plan) -> list[dict]:
    return [{"request_id": s.request_id, "slot_id": s.slot_id, "start_pos": s.start_pos,
             "num_tokens": s.num_tokens, "block_table": list(s.block_table), "sample": s.sample}
            for s in plan.seqs]


def mask_data(plan) -> dict:
    """The ragged-mask picture's data: the step's rows, the packed metadata and the mask."""
    from minicb.runtime.packer import pack

    attn = pack(plan).attn
    cu_q, cu_k = attn.cu_seqlens_q.tolist(), attn.cu_seqlens_k.tolist()
    start = attn.start_pos.tolist()
    mask = ragged_mask(cu_q, cu_k, start)
    return {"step": plan.step, "seqs": _plan_rows(plan), "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "start_pos": start, "mask": ["".join("1" if m else "0" for m in row) for row in mask]}


def block_table_data(plan, state) -> dict:
    """The block-tables picture's data: per row its block table, per packed token its ``slot_mapping``,
    and which request holds every block of the pool when the step was planned."""
    from minicb.runtime.packer import pack

    attn = pack(plan).attn
    owner = {b: rid for rid, table in state.block_tables for b in table}
    return {"step": plan.step, "block_size": plan.block_size, "num_blocks": state.num_blocks,
            "seqs": _plan_rows(plan), "slot_mapping": attn.slot_mapping.tolist(),
            "positions": [s.start_pos + i for s in plan.seqs for i in range(s.num_tokens)],
            "owners": [owner.get(b) for b in range(state.num_blocks)]}


# --- the prefix cache -------------------------------------------------------------------------------
def prefix_tree_data() -> dict:
    """Three requests share a 2-block system prompt S through a real ``BlockManager`` with caching:
    A = S + 5 tokens, B = S + 6 (hits both S blocks), C = S's first block + 6 (hits one); A finishes
    and frees its blocks (its cached ones stay, on the LRU list). Then D = A's prompt + 3 more tokens
    (a follow-up turn) looks up its prefix. Returns the tree of cached blocks and what D finds."""
    bs = 4
    bm = BlockManager(num_blocks=12, block_size=bs, enable_caching=True)
    system = list(range(1, 9))                                   # 8 tokens: two full blocks
    prompts = {"A": system + [20, 21, 22, 23, 24], "B": system + [30, 31, 32, 33, 34, 35],
               "C": system[:4] + [40, 41, 42, 43, 44, 45]}
    hits = {}
    for rid, tokens in prompts.items():                         # admit: look up, allocate, compute
        computed = bm.computed_blocks(tokens)
        hits[rid] = list(computed)
        bm.allocate(rid, len(tokens), computed)
        bm.cache_full_blocks(rid, tokens, len(tokens))           # the step computed the whole prompt
    tables = {rid: bm.block_table(rid) for rid in prompts}
    bm.free("A")                                                 # A finished
    d_tokens = prompts["A"] + [25, 26, 27]
    d_hits = bm.computed_blocks(d_tokens)
    bm.check_integrity()
    cache = bm.cache
    lru = bm.device.cached_free_blocks()
    holders = {b: sorted(r for r in prompts if r != "A" and b in tables[r]) for b in cache.blocks}
    nodes = [{"block": b, "parent": rec.parent, "tokens": list(rec.token_ids),
              "ref_count": bm.device.ref_counts[b], "holders": holders[b],
              "lru": lru.index(b) if b in lru else None}
             for b, rec in sorted(cache.blocks.items())]
    return {"block_size": bs, "prompts": prompts, "hits": hits, "tables": tables,
            "partial": {rid: t[-1] for rid, t in tables.items() if not bm.is_cached(t[-1])},
            "freed": "A", "lookup": {"request_id": "D", "tokens": d_tokens, "hits": d_hits},
            "nodes": nodes, "free_blocks": bm.device.free_blocks()}


# --- the three policies -----------------------------------------------------------------------------
POLICY_WORKLOAD = dict(num_requests=10, seed=3, prompt_len=(4, 20), output_len=(2, 16), arrival_gap=3)
POLICY_CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_blocks=256)


# The home page's picture: the workload of ``minicb trace`` with the docs' flags (docs/gen_pages.py
# TRACE_ARGS: ten requests two steps apart into 4 slots) under static and continuous batching.
HOME_WORKLOAD = dict(num_requests=10, seed=3, prompt_len=(4, 24), output_len=(2, 20), arrival_gap=2)
HOME_CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=256)


def policies_data(policies=("static", "dynamic", "continuous"), workload=None, config=None) -> dict:
    """One workload (default ``POLICY_WORKLOAD``: a request every 3 steps) under each policy, slot by
    slot."""
    from minicb.measure.trace import build_engine, make_workload, run_trace

    workload, config = workload or POLICY_WORKLOAD, config or POLICY_CONFIG
    out = {"workload": workload, "config": config, "traces": {}}
    for policy in policies:
        engine = build_engine("tiny", policy=policy, **config)
        w = workload
        wl = make_workload(w["num_requests"], w["seed"], engine.runner.vocab_size, w["prompt_len"],
                           w["output_len"], w["arrival_gap"])
        out["traces"][policy] = trace_to_json(run_trace(engine, wl))
    return out


_KIND = {PREFILL: "P", DECODE: "D", PADDING: ".", STALL: "-", IDLE: " "}
_KIND_BACK = {v: k for k, v in _KIND.items()}


def trace_to_json(trace: SlotTrace) -> dict:
    """A slot trace as plain values: per step, per slot ``[kind, request, tokens, padding]``."""
    return {"policy": trace.policy, "num_slots": trace.num_slots, "request_ids": trace.request_ids,
            "arrivals": trace.arrivals, "preempted": [list(p) for p in trace.preempted],
            "cells": [[[_KIND[c.kind], c.request_id, c.num_tokens, c.num_padding] for c in step]
                      for step in trace.cells], "summary": _summary(trace)}


def trace_from_json(d: dict) -> SlotTrace:
    t = SlotTrace(d["num_slots"], d["policy"], steps=list(range(len(d["cells"]))),
                  cells=[tuple(Cell(_KIND_BACK[k], r, n, p) for k, r, n, p in step) for step in d["cells"]],
                  preempted=[tuple(p) for p in d["preempted"]], request_ids=list(d["request_ids"]),
                  arrivals=dict(d["arrivals"]))
    return t


def _summary(trace: SlotTrace) -> dict:
    s = trace.summary()
    return {"steps": s.num_steps, "slot_utilisation": round(s.slot_utilisation, 4),
            "padding_waste": round(s.padding_waste, 4), "real_tokens": s.real_tokens,
            "padding_tokens": s.padding_tokens}


# --- drawing ----------------------------------------------------------------------------------------
def _colour_by_order(ids: list[str]) -> Callable[[str], str]:
    return lambda rid: request_colour(ids.index(rid))


def draw_mask(data: dict, ax) -> None:
    """The mask as a grid: rows are the packed queries, columns the keys of every sequence in
    ``cu_seqlens_k`` order; an allowed cell is coloured by its request (lighter: a key from the cache)."""
    from matplotlib.patches import Rectangle

    seqs, cu_q, cu_k = data["seqs"], data["cu_seqlens_q"], data["cu_seqlens_k"]
    colour = _colour_by_order([s["request_id"] for s in seqs])
    n, k = cu_q[-1], cu_k[-1]
    for b, s in enumerate(seqs):
        for i in range(s["num_tokens"]):
            row = cu_q[b] + i
            for j in range(cu_k[b + 1] - cu_k[b]):
                col = cu_k[b] + j
                if data["mask"][row][col] == "1":
                    new = j >= s["start_pos"]
                    ax.add_patch(Rectangle((col, row), 1, 1, facecolor=colour(s["request_id"]),
                                           alpha=1.0 if new else CACHED_ALPHA, edgecolor="white", lw=0.8))
    for b in range(len(seqs) + 1):                  # sequence boundaries: the cu_seqlens offsets
        ax.axhline(cu_q[b], color="#333333", lw=0.8)
        ax.axvline(cu_k[b], color="#333333", lw=0.8)
    qlabels = [f"{s['request_id']}{s['start_pos'] + i}" for s in seqs for i in range(s["num_tokens"])]
    klabels = [f"{s['request_id']}{j}" for s in seqs for j in range(s["start_pos"] + s["num_tokens"])]
    ax.set_xlim(0, k)
    ax.set_ylim(n, 0)
    ax.set_xticks([c + 0.5 for c in range(k)], klabels, fontsize=8.5, rotation=90)
    ax.set_yticks([r + 0.5 for r in range(n)], qlabels, fontsize=8.5)
    ax.tick_params(length=0)
    ax.set_xlabel(f"keys, sequence by sequence (cu_seqlens_k = {cu_k})", fontsize=9)
    ax.set_ylabel(f"packed queries\ncu_seqlens_q = {cu_q}", fontsize=9)
    ax.set_aspect("equal")
    for spine in ax.spines.values():
        spine.set_visible(False)


def draw_ragged_mask(data: dict):
    plt = _pyplot()
    from matplotlib.patches import Patch

    n, k = data["cu_seqlens_q"][-1], data["cu_seqlens_k"][-1]
    fig, ax = plt.subplots(figsize=(3.2 + 0.26 * k, 2.0 + 0.26 * n))
    draw_mask(data, ax)
    chunk = next(s for s in data["seqs"] if s["num_tokens"] > 1)
    decodes = [s["request_id"] for s in data["seqs"] if s["num_tokens"] == 1]
    ax.set_title(f"step {data['step']}: decodes of {', '.join(decodes)} + a {chunk['num_tokens']}-token "
                 f"chunk of {chunk['request_id']} after {chunk['start_pos']} cached tokens\n"
                 "each query sees only its own sequence; the triangle is bottom-right aligned", fontsize=9)
    ax.legend(handles=[Patch(facecolor="#555555", label="key computed this step"),
                       Patch(facecolor="#555555", alpha=CACHED_ALPHA, label="key read from the cache"),
                       Patch(facecolor="white", edgecolor="#999999", label="masked out")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    return fig


def draw_block_tables(data: dict):
    """Packed tokens on top, their ``slot_mapping`` below, the block tables on the left and the
    physical pool at the bottom, with an arrow from every token to the KV slot it writes."""
    plt = _pyplot()
    from matplotlib.patches import FancyArrowPatch, Rectangle

    seqs, bs, nb = data["seqs"], data["block_size"], data["num_blocks"]
    ids = [s["request_id"] for s in seqs]
    colour = _colour_by_order(ids)
    token_rid = [s["request_id"] for s in seqs for _ in range(s["num_tokens"])]
    per_row = 8                                              # pool blocks drawn per row
    cell = 1.0
    block_w = bs * cell + 0.6
    rows = -(-nb // per_row)
    width, height = 7.5 + per_row * block_w + 0.2, 10.4 - (5.2 - 2.2 * (rows - 1) - 0.3)
    fig, ax = plt.subplots(figsize=(0.26 * width, 0.26 * height + 0.9))
    # the packed step: one box per token, its position inside, its slot_mapping under it
    x0 = 7.5
    tok_x = [x0 + 1.7 * t for t in range(len(token_rid))]
    for t, (rid, pos, slot) in enumerate(zip(token_rid, data["positions"], data["slot_mapping"])):
        ax.add_patch(Rectangle((tok_x[t], 9), 1.4, 1, facecolor=colour(rid), edgecolor="white"))
        ax.text(tok_x[t] + 0.7, 9.5, f"{rid}{pos}", ha="center", va="center", fontsize=8,
                color=text_colour(colour(rid)), fontweight="bold")
        ax.text(tok_x[t] + 0.7, 8.5, str(slot), ha="center", va="center", fontsize=8)
    ax.text(x0 - 0.3, 9.5, "packed tokens\n(position)", ha="right", va="center", fontsize=8)
    ax.text(x0 - 0.3, 8.5, "slot_mapping", ha="right", va="center", fontsize=8, family="monospace")
    # the block tables: logical block i -> physical block
    y = 6.6
    ax.text(0, 7.5, "block tables (logical -> physical)", fontsize=8, fontweight="bold")
    for s in seqs:
        ax.text(0, y + 0.35, s["request_id"], fontsize=9, va="center", color="#111111",
                fontweight="bold")
        for i, b in enumerate(s["block_table"]):
            ax.add_patch(Rectangle((0.8 + 1.2 * i, y), 1.0, 0.7, facecolor="white",
                                   edgecolor=colour(s["request_id"]), lw=1.5))
            ax.text(1.3 + 1.2 * i, y + 0.35, str(b), ha="center", va="center", fontsize=8)
        y -= 1.0
    # the physical pool: block b at row b // per_row; cells are KV slots b * bs + offset
    written = dict(zip(data["slot_mapping"], token_rid))
    pool_x, pool_y = 7.5, 5.2

    def slot_xy(slot: int) -> tuple[float, float]:
        b, off = divmod(slot, bs)
        return pool_x + (b % per_row) * block_w + off * cell, pool_y - 2.2 * (b // per_row)

    for b in range(nb):
        owner = data["owners"][b]
        bx, by = slot_xy(b * bs)
        ax.text(bx + bs * cell / 2, by + 1.25, f"block {b}", ha="center", fontsize=7,
                color="#333333" if owner else "#666666")
        for off in range(bs):
            slot = b * bs + off
            x, yy = slot_xy(slot)
            face = colour(owner) if owner in ids else ("#bbbbbb" if owner else "white")
            alpha = 1.0 if slot in written else (0.35 if owner else 1.0)
            ax.add_patch(Rectangle((x, yy), cell, 1, facecolor=face, alpha=alpha, edgecolor="#666666",
                                   lw=1.6 if slot in written else 0.4))
            ax.text(x + 0.5, yy + 0.5, str(slot), ha="center", va="center", fontsize=6.5,
                    color=text_colour(face) if slot in written or face == "white" else "#333333")
    for t, slot in enumerate(data["slot_mapping"]):
        x, yy = slot_xy(slot)
        ax.add_patch(FancyArrowPatch((tok_x[t] + 0.7, 8.2), (x + 0.5, yy + 1.02), arrowstyle="->",
                                     mutation_scale=8, color=colour(token_rid[t]), lw=0.8))
    ax.text(pool_x - 0.3, pool_y + 0.5, "KV pool\n(block_size "
            f"{bs})", ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.2, pool_x + per_row * block_w)
    ax.set_ylim(pool_y - 2.2 * ((nb - 1) // per_row) - 0.3, 10.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"step {data['step']}: token at position p of a request writes its K/V to KV slot "
                 f"table[p // {bs}] * {bs} + p % {bs}\n(solid, outlined: written this step; light: "
                 "held from earlier steps; grey: held by a request not in this step; white: free)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def draw_prefix_tree(data: dict):
    """Cached blocks as a tree growing to the right from the root; each box: block id, tokens, ref
    count and holders; free cached blocks (the finished request's) dashed, with their LRU rank."""
    plt = _pyplot()
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    nodes = {n["block"]: n for n in data["nodes"]}
    children: dict = {}
    for n in data["nodes"]:
        children.setdefault(n["parent"], []).append(n["block"])
    pos: dict = {}
    next_y = [0.0]

    def place(block, depth: int) -> float:          # leaves one under another, parents centred
        kids = sorted(children.get(block, []))
        if not kids:
            y = next_y[0]
            next_y[0] -= 1.6
        else:
            ys = [place(k, depth + 1) for k in kids]
            y = sum(ys) / len(ys)
        pos[block] = (depth * 3.6, y)
        return y

    place(None, 0)
    reqs = list(data["prompts"]) + [data["lookup"]["request_id"]]
    colour = _colour_by_order(reqs)
    fig, ax = plt.subplots(figsize=(10, 4.6))
    hit_path = set(data["lookup"]["hits"])
    for block, (x, y) in pos.items():
        if block is None:
            ax.text(x + 1.2, y, "root\n(empty prefix)", ha="center", va="center", fontsize=8)
            continue
        n = nodes[block]
        free = n["ref_count"] == 0
        face = "white" if free else colour(n["holders"][0]) if len(n["holders"]) == 1 else "#dbe4f0"
        box = FancyBboxPatch((x, y - 0.6), 2.6, 1.2, boxstyle="round,pad=0.05", facecolor=face,
                             alpha=0.35 if not free else 1.0, edgecolor="#c00000" if block in hit_path
                             else "#333333", lw=2.0 if block in hit_path else 0.8,
                             linestyle="--" if free else "-")
        ax.add_patch(box)
        who = f"held by {', '.join(n['holders'])}" if n["holders"] else f"free, LRU #{n['lru'] + 1}"
        ax.text(x + 1.3, y, f"block {block}: {n['tokens']}\nref {n['ref_count']}, {who}", ha="center",
                va="center", fontsize=8)
        px, py = pos[n["parent"]]
        ax.add_patch(FancyArrowPatch((px + (2.4 if n["parent"] is not None else 2.2), py), (x, y),
                                     arrowstyle="->", mutation_scale=9, color="#555555", lw=0.8))
    # the partial (last, not full) blocks: private, never cached
    for rid, block in data["partial"].items():
        table = data["tables"][rid]
        if rid == data["freed"] or len(table) < 2:
            continue
        px, py = pos[table[-2]]
        x, y = px + 3.6, py - 0.2 if rid != "C" else py
        ax.text(x + 1.3, y, f"block {block} ({rid}'s last,\npartial: never cached)", ha="center",
                va="center", fontsize=8, color="#595959")
        ax.add_patch(FancyArrowPatch((px + 2.6, py), (x, y), arrowstyle="->", mutation_scale=8,
                                     color="#aaaaaa", lw=0.7, linestyle=":"))
    lines = [f"{rid}: {len(t)} prompt tokens, hit {len(data['hits'][rid])} cached block(s), table "
             f"{data['tables'][rid]}" for rid, t in data["prompts"].items()]
    lines.append(f"{data['freed']} finished: its blocks are free, its full ones stay cached (LRU)")
    lk = data["lookup"]
    lines.append(f"then {lk['request_id']} ({len(lk['tokens'])} tokens, {data['freed']}'s prompt + 3): "
                 f"computed_blocks -> {lk['hits']} (red path)")
    ax.text(0, next_y[0] - 0.3, "\n".join(lines), fontsize=8, va="top", family="monospace")
    ax.set_xlim(-0.2, max(x for x, _ in pos.values()) + 6.5)
    ax.set_ylim(next_y[0] - 0.5 - 0.32 * len(lines) - 0.6, 1.0)
    ax.axis("off")
    ax.set_title(f"prefix cache: full blocks of {data['block_size']} tokens, hash-chained to their parent",
                 fontsize=10)
    fig.tight_layout()
    return fig


def draw_policies(data: dict, width: float = 7.2):
    """The timelines stacked on one step axis, one colour and letter per request in all of them."""
    plt = _pyplot()
    traces = {p: trace_from_json(data["traces"][p]) for p in ("static", "dynamic", "continuous")
              if p in data["traces"]}                   # this order, whatever order the JSON keeps
    n = data["workload"]["num_requests"]
    ids = [f"r{i}" for i in range(n)]
    colour, label = _colour_by_order(ids), (lambda rid: _LABELS[ids.index(rid) % len(_LABELS)])
    steps = max(t.num_steps for t in traces.values())
    handles = legend_handles(plt, [(label(r), r, colour(r)) for r in ids])
    legend_h = 0.24 * -(-len(handles) // 4)
    height = 0.6 + 1.75 * len(traces) + legend_h
    fig, axes = plt.subplots(len(traces), 1, sharex=True, figsize=(width, height), squeeze=False)
    for ax, (policy, trace) in zip(axes[:, 0], traces.items()):
        draw_trace(ax, trace, colour, label, num_steps=steps)
        s = data["traces"][policy]["summary"]
        ax.set_title(f"{policy}: {s['steps']} steps, slot utilisation {100 * s['slot_utilisation']:.0f}%, "
                     f"padding waste {100 * s['padding_waste']:.0f}%", fontsize=9.5, loc="left")
    both = "both" if len(traces) == 2 else f"all {len(traces)}"
    axes[-1, 0].set_xlabel(f"step (the same requests arrive at the same steps in {both})")
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, (legend_h + 0.05) / height, 1, 1))
    return fig


DRAW = {"ragged-mask": draw_ragged_mask, "block-tables": draw_block_tables,
        "prefix-tree": draw_prefix_tree, "policies": draw_policies, "static-vs-continuous": draw_policies}


# --- writing and checking ---------------------------------------------------------------------------
def compute_all() -> dict[str, dict]:
    """Run the code behind every picture; returns name -> JSON-able data."""
    plan, state = mixed_step()
    return {"ragged-mask": mask_data(plan), "block-tables": block_table_data(plan, state),
            "prefix-tree": prefix_tree_data(), "policies": policies_data(),
            "static-vs-continuous": policies_data(("static", "continuous"), HOME_WORKLOAD, HOME_CONFIG)}


def to_json(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def data_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def svg_data_hash(svg: str) -> str | None:
    """The data hash a picture was drawn from (from its metadata), or None."""
    marker = "data sha256 "
    i = svg.find(marker)
    return svg[i + len(marker): i + len(marker) + 64] if i >= 0 else None


def draw(name: str, data: dict, path: str) -> str:
    """Draw picture ``name`` from ``data`` into ``path`` (.svg), tagged with the data's hash."""
    import matplotlib.pyplot as plt

    fig = DRAW[name](data)
    desc = f"minicb picture {name}; data sha256 {data_hash(to_json(data))}"
    save_readable(fig, path, metadata={"Date": None, "Description": desc}, dpi=110, bbox_inches="tight",
                  pad_inches=0.1)
    plt.close(fig)
    return str(path)


def write_all(out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Compute every picture's data and write ``NAME.json`` and ``NAME.svg`` into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in compute_all().items():
        (out / f"{name}.json").write_text(to_json(data))
        written += [out / f"{name}.json", pathlib.Path(draw(name, data, str(out / f"{name}.svg")))]
    return written


def check(out_dir: str | pathlib.Path) -> list[str]:
    """What is stale in ``out_dir``: data the code no longer produces, pictures not drawn from it."""
    out, problems = pathlib.Path(out_dir), []
    for name, data in compute_all().items():
        j, s = out / f"{name}.json", out / f"{name}.svg"
        if not j.exists() or j.read_text() != to_json(data):
            problems.append(f"{j}: differs from what the code computes now")
        if not s.exists() or svg_data_hash(s.read_text()) != data_hash(to_json(data)):
            problems.append(f"{s}: not drawn from the current data")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minicb.measure.pictures", description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", default="docs/images")
    p.add_argument("--check", action="store_true", help="only say whether the pictures are current")
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.out_dir)
        print("\n".join(problems) or "pictures are current")
        return 1 if problems else 0
    for path in write_all(args.out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
