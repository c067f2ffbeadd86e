"""Right answers to the exercises, written apart from minicb's code: the
checkers must pass a learner's file that is right, not only minicb itself.
(The wrong_policy_* files import ContinuousPolicy from here and break one rule.)"""

from minicb.core.block_pool import BlockPool
from minicb.core.planner import TokenBudget
from minicb.core.policy import Policy, StepWork
from minicb.core.prefix_cache import PrefixCache
from minicb.core.sequence import Sequence


class SlotTable:
    def __init__(self, num_slots):
        self.owner = [None] * num_slots

    def assign(self, rid):
        if rid in self.owner or None not in self.owner:
            raise ValueError(f"cannot assign {rid!r}")
        slot = self.owner.index(None)
        self.owner[slot] = rid
        return slot

    def release(self, slot):
        if self.owner[slot] is None:
            raise ValueError(f"slot {slot} is free")
        rid, self.owner[slot] = self.owner[slot], None
        return rid


def can_allocate(num_tokens, block_size, num_held, num_free):
    needed = (num_tokens + block_size - 1) // block_size
    return max(0, needed - num_held) <= num_free


def chunk(num_uncomputed, tokens_left, chunk_cap, seqs_left=1):
    if seqs_left <= 0 or tokens_left <= 0:
        return 0
    return min(num_uncomputed, chunk_cap, tokens_left)


def choose_victim(running, policy="fcfs"):
    if policy == "priority":
        key = lambda r: (r["priority"], r["arrival"])  # noqa: E731
    else:
        key = lambda r: (r["admitted"], r["arrival"])  # noqa: E731
    return max(running, key=key)["id"]


def slot_mapping(rows, block_size):
    return [table[p // block_size] * block_size + p % block_size
            for start, n, table in rows for p in range(start, start + n)]


def causal_mask(num_queries, num_keys):
    start = num_keys - num_queries
    return [[j <= start + i for j in range(num_keys)]
            for i in range(num_queries)]


class ContinuousPolicy(Policy):
    """Exercise 7, written as a learner would: one method per rule."""

    def schedule(self):
        c = self.config
        work = StepWork()
        budget = TokenBudget(c.max_num_batched_tokens, c.max_num_seqs,
                             c.long_prefill_chunk or c.max_num_batched_tokens)
        self.run_running(work, budget)
        if not work.preempted:
            self.run_swapped(work, budget)
            if not self.swapped:
                self.run_waiting(work, budget)
        return work

    def run_running(self, work, budget):
        seqs = list(self.running.values())
        order = [s for s in seqs if s.num_uncomputed_tokens == 1] + \
                [s for s in seqs if s.num_uncomputed_tokens > 1]
        for seq in order:
            if seq.request_id not in self.running:
                continue                              # a victim already
            n = budget.chunk(seq.num_uncomputed_tokens)
            if n == 0:
                continue
            while True:
                copies = self.blocks.append_slots(seq.request_id,
                                                  seq.num_computed_tokens, n)
                if copies is not None:
                    break
                victim = self.victim()
                self.drop(victim, work, budget)
                if victim is seq:
                    break
            if copies is None:
                continue
            if copies:
                work.copy_blocks[seq.request_id] = copies[0]
            budget.take(n)
            work.scheduled[seq.request_id] = n

    def victim(self):
        return list(self.running.values())[-1]        # the newest admission

    def drop(self, victim, work, budget):
        n = work.scheduled.pop(victim.request_id, None)
        if n is not None:
            budget.give_back(n)
        work.copy_blocks.pop(victim.request_id, None)
        work.swap_out += self.sched.preempt(victim).swap_out
        work.preempted.append(victim.request_id)

    def run_swapped(self, work, budget):
        while self.swapped and self.slots.num_free > 0:
            seq = self.swapped[0]
            n = budget.chunk(seq.num_uncomputed_tokens)
            end = seq.num_computed_tokens + n
            if n == 0 or not self.blocks.can_swap_in(seq.request_id, end):
                break
            work.swap_in += self.sched.resume(seq, end)
            budget.take(n)
            work.scheduled[seq.request_id] = n

    def run_waiting(self, work, budget):
        bs = self.blocks.block_size
        while self.waiting and self.slots.num_free > 0:
            seq = self.waiting[0]
            if not self.admit_one(seq, work, budget, bs):
                break

    def admit_one(self, seq, work, budget, bs):
        hits = []
        if self.config.prefix_caching and not seq.wants_prompt_rows:
            hits = self.blocks.computed_blocks(seq.all_token_ids,
                                               seq.params.cache_salt)
        cached = len(hits) * bs
        n = budget.chunk(seq.num_tokens - cached)
        if n == 0 or not self.blocks.can_allocate(seq.request_id, cached + n,
                                                  hits):
            return False
        self.sched.admit(seq, cached + n, hits, cached)
        budget.take(n)
        work.scheduled[seq.request_id] = n
        return True

    def finished(self, seq):
        self.sched.free(seq.request_id)


class BlockTables:
    """Exercise 8, written as a learner would."""

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.cache = PrefixCache()
        self.pool = BlockPool(num_blocks, self.cache)
        self.tables = {}

    def block(self, tokens, i):
        return tuple(tokens[i * self.block_size:(i + 1) * self.block_size])

    def hits(self, token_ids):
        found, parent = [], None
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = self.cache.lookup(parent, self.block(token_ids, i))
            if parent is None:
                break
            found.append(parent)
        return found

    def lacking(self, request_id, num_tokens, hits=()):
        held = len(self.tables.get(request_id, [])) + len(hits)
        return max(0, -(-num_tokens // self.block_size) - held)

    def can_allocate(self, request_id, num_tokens, hits=()):
        idle_hits = [b for b in hits if self.pool.ref_counts[b] == 0]
        need = self.lacking(request_id, num_tokens, hits) + len(idle_hits)
        return need <= self.pool.num_free

    def allocate(self, request_id, num_tokens, hits=()):
        if not self.can_allocate(request_id, num_tokens, hits):
            raise ValueError(f"no room for {request_id}")
        need = self.lacking(request_id, num_tokens, hits)
        table = self.tables.setdefault(request_id, [])
        for b in hits:
            self.pool.share(b)
            table.append(b)
        new = [self.pool.take() for _ in range(need)]
        table += new
        return new

    def free(self, request_id):
        table = self.tables.pop(request_id, [])
        for b in table[::-1]:
            self.pool.drop(b)
        return len(table)

    def cache_full(self, request_id, token_ids, num_computed):
        table, added = self.tables[request_id], 0
        for i in range(min(num_computed // self.block_size, len(table))):
            parent = table[i - 1] if i else None
            added += self.cache.insert(table[i], parent,
                                       self.block(token_ids, i))
        return added


def pack(plan):
    """Exercise 9, written as a learner would: row by row, then the sums."""
    bs, out = plan.block_size, {k: [] for k in (
        "input_ids", "positions", "slot_mapping", "logits_indices",
        "sample_request_ids")}
    q, ctx, tables = [], [], []
    for s in plan.seqs:
        base = len(out["input_ids"])
        out["input_ids"] += list(s.token_ids)
        ps = [s.start_pos + i for i in range(len(s.token_ids))]
        out["positions"] += ps
        out["slot_mapping"] += [s.block_table[p // bs] * bs + p % bs
                                for p in ps]
        q.append(len(ps))
        ctx.append(s.start_pos + len(ps))
        tables.append(list(s.block_table))
        if s.sample:
            for rid in (s.request_id,) + tuple(s.forks):
                out["logits_indices"].append(base + len(ps) - 1)
                out["sample_request_ids"].append(rid)
    for n in plan.padding:
        out["input_ids"] += [0] * n
        out["positions"] += list(range(n))
        out["slot_mapping"] += [-1] * n
        q.append(n)
        ctx.append(n)
        tables.append([])
    width = max((len(t) for t in tables), default=0)
    out["block_tables"] = [t + [0] * (width - len(t)) for t in tables]
    out["context_lens"] = ctx
    out["cu_seqlens_q"] = [sum(q[:i]) for i in range(len(q) + 1)]
    out["cu_seqlens_k"] = [sum(ctx[:i]) for i in range(len(ctx) + 1)]
    return out


def generate(scheduler, runner, requests, until=None):
    """Exercise 10, written as a learner would. (``until``: the loop's
    condition, which a wrong answer replaces.)"""
    by_step = {}
    for rid, prompt, params, arrival in requests:
        by_step.setdefault(arrival, []).append((rid, prompt, params))
    params = {r[0]: r[2] for r in requests}
    results, step, last = {}, 0, max(by_step)
    busy = until or (lambda: step <= last or scheduler.has_unfinished())
    while busy():
        for rid, prompt, p in by_step.get(step, []):
            scheduler.add(Sequence(rid, prompt, p))
        if step >= last:
            scheduler.close_arrivals()
        plan = scheduler.schedule(step)
        sampled = runner.run(plan, {s.request_id: params[s.request_id]
                                    for s in plan.seqs if s.sample})
        for seq in scheduler.update(plan, sampled, step):
            results[seq.request_id] = seq.output_token_ids
        step += 1
    return results
