"""The ragged packer: a ``StepPlan`` (plain Python) becomes the flat tensors of one forward step.

For a plan with a 3-token prompt chunk ``a``, a decode ``b`` (9 tokens already cached) and a 2-token
chunk ``c`` (4 cached), with block size 4::

    input_ids     a0 a1 a2 | b9 | c4 c5
    positions      0  1  2 |  9 |  4  5
    cu_seqlens_q   0         3    4       6
    context_lens   3         10   6            (= start_pos + new tokens)
    cu_seqlens_k   0         3    13      19
    slot_mapping   block_of(pos) * 4 + pos % 4, through each sequence's block table
    block_tables   [[a's blocks], [b's], [c's]]   padded with 0 to the longest table
    logits_indices the rows to sample: the last row of every sequence whose plan says ``sample``
                   (named once more per child a fork samples from it: ``ScheduledSeq.forks``)

A row asking for prompt logprobs (``ScheduledSeq.prompt_targets``) adds the chunk's leading rows to
``logits_indices``, before its sampled row; ``sample_rows`` then says which logits rows are sampled and
``prompt_spans`` which score prompt tokens. Without any, ``logits_indices`` is the sampled rows alone,
exactly as before, and ``sample_rows`` is None: the default step pays nothing for the feature.

A prompt admitted with a prefix-cache hit is just a chunk that starts late: its ``start_pos`` is the
cached length, only the rest is packed, and attention reads the shared blocks through its block table
like any earlier chunk. ``slot_mapping`` only ever names positions ``>= start_pos``, so a shared
(cached) block is never written.

Padding rows of the padded policies are appended after the real sequences as extra "sequences" with no
cache (start_pos 0), token id ``pad_token_id`` and slot -1: they cost every layer's matmuls, write
nothing and are never sampled. That is the bulk of what a padded static batch wastes, but not all of
it: a ``[B, T]`` implementation (transformers' ``generate``) also runs a finished row's padding token
through attention over the row's whole context and through the LM head. Those two costs are left out
here (and real rows attend over their own context, not a padded one), so the padded policies compute
a lower bound of what a naive static batch computes.

Tensors are contiguous; ``cu_seqlens_*`` and ``block_tables`` are int32 as FlashAttention requires,
``slot_mapping`` and ``positions`` int64.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from minicb.core.plan import StepPlan
from minicb.model.attention import AttentionMetadata


@dataclass(slots=True)
class RaggedBatch:
    """One step as flat tensors: every scheduled token end to end, no padding between requests."""

    input_ids: torch.Tensor        # int64 [N]
    positions: torch.Tensor        # int64 [N]
    attn: AttentionMetadata
    logits_indices: torch.Tensor   # int64 [M]
    sample_request_ids: tuple[str, ...]   # row i of the logits belongs to this request
    # With prompt logprobs only: which logits rows are sampled (else all of them, in order), and per
    # request (request id, first logits row, position of the first prompt token scored, the tokens).
    sample_rows: torch.Tensor | None = None
    prompt_spans: tuple[tuple[str, int, int, tuple[int, ...]], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def pack(plan: StepPlan, device: torch.device | str = "cpu", pad_token_id: int = 0) -> RaggedBatch:
    # One Python list per tensor of the batch, filled sequence by sequence in the plan's order (decodes
    # first, then prompt chunks) and turned into tensors once at the end.
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    q_lens: list[int] = []
    starts: list[int] = []
    tables: list[tuple[int, ...]] = []
    ctx: list[int] = []
    logits_rows: list[int] = []
    sample_ids: list[str] = []
    sample_pos: list[int] = []          # where each sampled row sits among logits_rows
    spans: list[tuple[str, int, int, tuple[int, ...]]] = []
    bs = plan.block_size
    # A sequence's new tokens sit at positions start_pos .. start_pos + n - 1 of its own sequence. Each
    # one's K/V goes to a slot of the paged cache: the block its position falls in (found through the
    # block table) times the block size, plus the offset inside that block. The last row of a sequence
    # that samples is where its next token's logits come from.
    for s in plan.seqs:
        n, p0 = len(s.token_ids), s.start_pos
        ids.extend(s.token_ids)
        pos.extend(range(p0, p0 + n))
        for p in range(p0, p0 + n):
            slots.append(s.block_table[p // bs] * bs + p % bs)
        q_lens.append(n)
        starts.append(p0)
        ctx.append(p0 + n)
        tables.append(s.block_table)
        if s.prompt_targets:            # prompt logprobs: the chunk's leading rows return logits too
            first = len(ids) - n
            spans.append((s.request_id, len(logits_rows), p0 + 1, s.prompt_targets))
            logits_rows.extend(range(first, first + len(s.prompt_targets)))
        if s.sample:                      # a fork's children draw from the same row, one each
            for rid in (s.request_id, *s.forks):
                sample_pos.append(len(logits_rows))
                logits_rows.append(len(ids) - 1)
                sample_ids.append(rid)
    # Padding rows (static and dynamic policies only) come last: pad tokens at positions 0.., slot -1
    # (nothing is written to the cache), no block table, never sampled. They cost compute, nothing else.
    for n in plan.padding:
        ids.extend([pad_token_id] * n)
        pos.extend(range(n))
        slots.extend([-1] * n)
        q_lens.append(n)
        starts.append(0)
        ctx.append(n)
        tables.append(())
    batch = _to_tensors(ids, pos, slots, q_lens, starts, ctx, tables, logits_rows, sample_ids, bs, device,
                        num_padding_rows=len(plan.padding))
    if spans:
        batch.sample_rows = torch.tensor(sample_pos, dtype=torch.long, device=device)
        batch.prompt_spans = tuple(spans)
    return batch


def _to_tensors(ids, pos, slots, q_lens, starts, ctx, tables, logits_rows, sample_ids, bs, device,
                num_padding_rows: int = 0):
    # ``ctx[i]``: the keys row i attends over after the step (its start plus its new tokens)
    # each tensor made in one call from Python lists, not a torch call per row: after a step's kernels
    # every torch call starts cold (``python bench/decode_floor.py --cold-calls``)
    width = max(map(len, tables), default=0)
    padded = [[*t, *[0] * (width - len(t))] for t in tables]
    bt = torch.tensor(padded, dtype=torch.int32).reshape(len(tables), width)
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(ctx)], dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
        max_seqlen_q=max(q_lens, default=0), max_seqlen_k=max(ctx, default=0),
        start_pos=torch.tensor(starts, dtype=torch.long, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=bt.to(device), block_size=bs,
        q_lens=tuple(q_lens), start_positions=tuple(starts), num_padding_rows=num_padding_rows,
    )
    return RaggedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        attn=meta,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=device),
        sample_request_ids=tuple(sample_ids),
    )


def pack_prompts(prompts: list[list[int]], device: torch.device | str = "cpu") -> RaggedBatch:
    """Whole prompts with no KV cache at all (slot -1): the flat forward in its simplest form.

    Logits are requested for every token (``logits_indices`` covers all rows), which is what the
    equivalence tests compare.
    """
    ids = [t for p in prompts for t in p]
    pos = [i for p in prompts for i in range(len(p))]
    q_lens = [len(p) for p in prompts]
    batch = _to_tensors(ids, pos, [-1] * len(ids), q_lens, [0] * len(prompts), q_lens, [()] * len(prompts),
                        list(range(len(ids))), [], 1, device)
    return batch
