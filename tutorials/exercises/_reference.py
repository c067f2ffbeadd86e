"""minicb's own code behind each exercise's signature: the reference answers.

Each function here calls the real piece (the slot table, the block manager,
the token budget, the preemption policy, the packer, the reference attention)
and converts plain values in and out, so that a checker can hold a learner's
function and minicb's to the same tests.
"""

from __future__ import annotations

from minicb.core.block_manager import BlockManager
from minicb.core.planner import TokenBudget
from minicb.core.preemption import choose_victim as _choose_victim
from minicb.core.sampling_params import SamplingParams
from minicb.core.sequence import Sequence
from minicb.core.slot_table import SlotTable  # noqa: F401  (exercise 1)


def can_allocate(num_tokens: int, block_size: int, num_held: int,
                 num_free: int) -> bool:
    """Exercise 2 through ``BlockManager.can_allocate``: a pool with
    ``num_free`` free blocks and a request holding ``num_held`` of them."""
    bm = BlockManager(num_blocks=num_held + num_free + 1,
                      block_size=block_size)
    bm.allocate("other", block_size)              # one block someone else holds
    if num_held:
        bm.allocate("r", num_held * block_size)
    assert bm.num_free_blocks == num_free
    return bm.can_allocate("r", num_tokens)


def chunk(num_uncomputed: int, tokens_left: int, chunk_cap: int,
          seqs_left: int = 1) -> int:
    """Exercise 3 through ``TokenBudget.chunk``."""
    total, seqs = tokens_left + 1, seqs_left + 1
    budget = TokenBudget(total, seqs, chunk_cap, num_batched_tokens=1,
                         num_seqs=1)
    return budget.chunk(num_uncomputed)


def choose_victim(running: list[dict], policy: str = "fcfs") -> str:
    """Exercise 4 through ``preemption.choose_victim``."""
    seqs = []
    for r in running:
        s = Sequence(r["id"], [1], SamplingParams(max_tokens=1),
                     priority=r.get("priority", 0))
        s.arrival_index, s.admitted_index = r["arrival"], r["admitted"]
        seqs.append(s)
    return _choose_victim(seqs, policy).request_id


def slot_mapping(rows: list[tuple[int, int, list[int]]],
                 block_size: int) -> list[int]:
    """Exercise 5 through the packer: ``pack(plan).attn.slot_mapping``."""
    from minicb.core.plan import ScheduledSeq, StepPlan
    from minicb.runtime.packer import pack

    seqs = tuple(ScheduledSeq(f"r{i}", i, tuple([5] * n), start,
                              tuple(table), True)
                 for i, (start, n, table) in enumerate(rows))
    plan = StepPlan(0, seqs, block_size=block_size)
    return pack(plan).attn.slot_mapping.tolist()


def causal_mask(num_queries: int, num_keys: int) -> list[list[bool]]:
    """Exercise 6, measured on ``ReferenceAttention``: the new tokens' queries
    are zero (so attention is uniform over what the mask allows) and key j's
    value is the one-hot vector e_j, so output row i is non-zero exactly at
    the keys query i may see."""
    import torch

    from minicb.core.plan import ScheduledSeq, StepPlan
    from minicb.model.attention import ReferenceAttention
    from minicb.model.kv_cache import KVCache
    from minicb.runtime.packer import pack

    bs, start = 4, num_keys - num_queries
    nb = -(-num_keys // bs)
    cache = KVCache(1, nb, bs, kv_heads=1, head_dim=num_keys)
    eye = torch.eye(num_keys).unsqueeze(1)            # [keys, 1 head, dim]
    if start:                                         # the cached keys
        cache.write(0, torch.zeros(start, 1, num_keys), eye[:start],
                    torch.arange(start))
    seq = ScheduledSeq("r", 0, tuple([5] * num_queries), start,
                       tuple(range(nb)), True)
    meta = pack(StepPlan(0, (seq,), block_size=bs)).attn
    attn = ReferenceAttention(cache)
    q = torch.zeros(num_queries, 1, num_keys)
    out = attn.attend(0, q, torch.zeros(num_queries, 1, num_keys),
                      eye[start:], attn.prepare(meta))
    return (out[:, 0, :] > 0).tolist()


# exercise 7: the continuous policy itself
from minicb.core.continuous import ContinuousPolicy  # noqa: E402, F401


class BlockTables:
    """Exercise 8 through ``BlockManager``: its device pool, its prefix cache
    and its device tables are the exercise's ``pool``, ``cache``, ``tables``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_caching=True)
        self.block_size = block_size
        self.pool, self.cache = self.bm.device, self.bm.cache
        self.tables = self.bm.block_tables

    def hits(self, token_ids):
        return self.bm.computed_blocks(token_ids)

    def can_allocate(self, request_id, num_tokens, hits=()):
        return self.bm.can_allocate(request_id, num_tokens, list(hits))

    def allocate(self, request_id, num_tokens, hits=()):
        return self.bm.allocate(request_id, num_tokens, list(hits))

    def free(self, request_id):
        return self.bm.free(request_id)

    def cache_full(self, request_id, token_ids, num_computed):
        return self.bm.cache_full_blocks(request_id, token_ids, num_computed)


FIELDS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q",
          "context_lens", "cu_seqlens_k", "block_tables", "logits_indices",
          "sample_request_ids")


def pack(plan) -> dict[str, list]:
    """Exercise 9 through ``runtime.packer.pack``: its tensors as lists."""
    from minicb.runtime.packer import pack as _pack

    b = _pack(plan)
    values = {"input_ids": b.input_ids, "positions": b.positions,
              "logits_indices": b.logits_indices,
              "sample_request_ids": list(b.sample_request_ids)}
    for name in ("slot_mapping", "cu_seqlens_q", "context_lens",
                 "cu_seqlens_k", "block_tables"):
        values[name] = getattr(b.attn, name)
    return {k: v if isinstance(v, list) else v.tolist()
            for k, v in values.items()}


def generate(scheduler, runner, requests):
    """Exercise 10: the three lines of ``minicb.engine.loop.StepLoop._step``
    (schedule, run, update) in a loop that adds each request at its step."""
    pending = sorted(requests, key=lambda r: r[3])
    params = {rid: p for rid, _, p, _ in requests}
    out, step = {}, 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][3] <= step:
            rid, prompt, p, _ = pending.pop(0)
            scheduler.add(Sequence(rid, list(prompt), p))
        if not pending:
            scheduler.close_arrivals()
        plan = scheduler.schedule(step)
        rows = {s.request_id: params[s.request_id] for s in plan.seqs
                if s.sample}
        sampled = runner.run(plan, rows)
        for seq in scheduler.update(plan, sampled, step):
            out[seq.request_id] = list(seq.output_token_ids)
        step += 1
    return out
