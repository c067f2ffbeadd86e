"""The continuous policy (iteration-level scheduling): the batch is rebuilt every step, in this order::

    1. running    decodes first, then ongoing prefill chunks, most important first; blocks are
                  allocated lazily to cover start_pos + num_tokens. A sequence that cannot get its
                  blocks preempts the least important running one (maybe itself) until it fits.
    2. swapped    if nothing was preempted this step: swap sequences back in (before any new
                  request) while a slot, the budget and device blocks allow.
    3. waiting    if nothing was preempted and nothing is left swapped: admit from the front of the
                  waiting queue (recompute-preempted ones sit there) while a slot is free, the budget
                  remains and blocks for the first chunk exist; the first that does not fit stays at
                  the front and admission stops (the static-batching note's rule: no overtaking).

Each step is given a token budget (``max_num_batched_tokens``, ``planner.TokenBudget``): a sequence
gets ``budget.chunk(its uncomputed tokens)`` tokens, so a long prompt is prefilled in chunks over
several steps while the decodes keep running.

Running before swapped (as in vLLM v0) means a step never both swaps a sequence in and out, and a
host block freed by a swap-in is never the target of a swap-out in the same step. Finished sequences
release their slot and blocks when ``update`` records them (``finished``), so the next step can
refill them.

Prefix caching (``SchedulerConfig.enable_prefix_caching``, on by default for this policy): at
admission the block manager's longest chain of cached full blocks becomes the head of the new block
table, and ``num_computed_tokens`` (and ``Sequence.num_cached_tokens``) start at its length, so only
the rest is fed to the model. After a step every block that it filled is offered to the cache
(``computed``). A recompute-preempted request is looked up again when re-admitted (its own blocks, or
a shared prefix, are often still there); a request holding shared blocks is never swapped out
(recomputed instead, see ``block_manager``)::

    step 0: A = [s s s s|s s a a|a]    computes 9 tokens; update caches A's 2 full blocks
    step 1: B = [s s s s|s s b b|b]    hit: block 0 (shared, ref 2); start_pos 4, computes 5

**Sharing within one step.** Blocks enter the cache only after the step that computed them, so two
requests admitted in the *same* step would each compute a common prefix. Admission therefore also
looks at the rows granted earlier in this step: the full blocks a row will have computed by the end
of this step (its start plus its grant), holding the same tokens as the newcomer's, are shared too
(``_same_step_hits``); the newcomer starts after them::

    step 0: A = [s s s s|s s a a|a]    admitted first: computes 9 tokens into blocks 0, 1, 2
            B = [s s s s|s s b b|b]    admitted next: shares block 0 (ref 2), computes 5 from position 4

This is sound because a row's K/V is written before anybody reads it, layer by layer, within the
forward: every attention backend first writes the step's new K/V of layer ``l`` for *all* rows
through ``slot_mapping``, and only then attends, for all rows, over the cache through the block
tables. B's queries at layer ``l`` read keys 0..3 of block 0, which A's tokens wrote at the start of
layer ``l`` of this very forward, from A's hidden states of layer ``l - 1`` (which never depend on
B). So B reads exactly the K/V it would have read had A computed the block a step earlier; the
blocks shared are full and A never writes them again, and B writes only its own blocks. (The fake
model of the tests writes every row before any row reads, which is the same order at whole-forward
granularity.) If the step fails, both rows fail and nothing was cached; a source row aborted after
planning is still computed by the forward, so what B shares is written either way.

**Forks** (``SamplingParams.n > 1``, see ``scheduler``): a child writes its next token into the
prompt's last block, which it may share with its siblings; ``_make_room`` counts and makes the
copy-on-write (``BlockManager.copy_on_write``) with the row's other blocks, and a preempted victim's
copy is taken back with its grant.

This module imports no torch.
"""

from __future__ import annotations

from minicb.core.planner import TokenBudget
from minicb.core.policy import Policy, StepWork
from minicb.core.preemption import Preemption, choose_victim, importance_key, preempt, running_order
from minicb.core.sequence import Sequence, SequenceStatus


class ContinuousPolicy(Policy):
    """Rebuilds the batch every step: running (preempting to fit), then swapped, then waiting."""

    def schedule(self) -> StepWork:
        """One step's batch, in the three steps of the module docstring."""
        c = self.config
        work = StepWork()
        budget = TokenBudget(c.max_num_batched_tokens, c.max_num_seqs, c.chunk_cap)
        self._schedule_running(work, budget)          # 1. decodes, then prefill chunks; preempt to fit
        if not work.preempted:
            self._schedule_swapped(work, budget)      # 2. swapped ones back, before any new request
        if not work.preempted and not self.swapped:
            self._schedule_waiting(work, budget)      # 3. admit from the front, no overtaking
        budget.check_integrity()
        # the budget spent is exactly what was granted: a preempted victim's grant was given back
        assert budget.num_batched_tokens == sum(work.scheduled.values()), "budget out of step with grants"
        assert budget.num_seqs == len(work.scheduled), "budget's sequence count out of step with grants"
        return work

    # --- 1. running ---------------------------------------------------------------------------------
    def _schedule_running(self, work: StepWork, budget: TokenBudget) -> None:
        # Every running sequence asks for its next tokens: one for a decode, a chunk of the prompt for a
        # sequence still in prefill. Decodes go first, so a long prompt can never starve them of the
        # budget (the chunked-prefill rule); within each kind, the most important first, so when blocks
        # run short the least important is the one preempted. A sequence that gets no tokens this step
        # (budget spent) simply keeps its slot and waits for the next step.
        order = running_order(self.running.values(), *self._ranking)
        for seq in [s for s in order if not s.in_prefill] + [s for s in order if s.in_prefill]:
            if seq.status is not SequenceStatus.RUNNING:
                continue                                 # preempted earlier in this step
            n = budget.chunk(seq.num_uncomputed_tokens)
            if n and self._make_room(seq, n, work, budget):
                _grant(seq, n, work, budget)

    def _make_room(self, seq: Sequence, n: int, work: StepWork, budget: TokenBudget) -> bool:
        """Allocate blocks for ``seq``'s next ``n`` tokens, preempting victims; False if seq itself was."""
        start = seq.num_computed_tokens
        while not self.blocks.can_allocate(seq.request_id, start + n, start=start):
            victim = choose_victim(self.running.values(), *self._ranking)
            self._preempt(victim, work, budget)
            if victim is seq:
                return False
        copy = self.blocks.copy_on_write(seq.request_id, start)   # a fork's shared last block
        if copy is not None:
            work.copy_blocks[seq.request_id] = copy
        self.blocks.allocate(seq.request_id, start + n)
        return True

    def _preempt(self, victim: Sequence, work: StepWork, budget: TokenBudget) -> None:
        # Undo whatever this step already granted the victim, take it out of the running set, and let
        # ``preemption.preempt`` free its slot and blocks: recompute drops its KV (it re-prefills later),
        # swap copies it to the host pool. Either way it goes to the *front* of its queue, so it comes
        # back before anything that arrived after it.
        granted = work.scheduled.pop(victim.request_id, 0)
        if granted:
            budget.give_back(granted)
        work.copy_blocks.pop(victim.request_id, None)   # its copy's destination is freed with it
        del self.running[victim.request_id]
        p = preempt(victim, self.config.preemption_mode, self.blocks, self.slots)
        queue = self.swapped if p.mode == "swap" else self.waiting
        queue.appendleft(victim)              # victims go newest first, so the oldest ends up in front
        work.preempted.append(victim.request_id)
        work.swap_out.extend(p.swap_out)
        self._count_preemption(p)

    def _count_preemption(self, p: Preemption) -> None:
        st = self.stats
        st.num_preemptions += 1
        st.num_swaps += p.mode == "swap"
        st.num_recomputes += p.mode == "recompute"
        st.num_recomputed_tokens += p.num_lost_tokens

    # --- 2. swapped ---------------------------------------------------------------------------------
    def _schedule_swapped(self, work: StepWork, budget: TokenBudget) -> None:
        # Swapped-out sequences come back in order while a slot is free and their blocks (the copied
        # ones plus this step's chunk) fit on the device. The copies are only recorded here
        # (``work.swap_in``); the runner makes them before the forward pass reads the cache.
        bm = self.blocks
        while self.swapped and self.slots.num_free:
            seq = self.swapped[0]
            n = budget.chunk(seq.num_uncomputed_tokens)
            if not n or not bm.can_swap_in(seq.request_id, seq.num_computed_tokens + n):
                return
            self.swapped.popleft()
            work.swap_in.extend(bm.swap_in(seq.request_id))
            bm.allocate(seq.request_id, seq.num_computed_tokens + n)
            self.stats.num_swap_ins += 1
            self.start_running(seq)
            _grant(seq, n, work, budget)

    # --- 3. waiting ---------------------------------------------------------------------------------
    def _schedule_waiting(self, work: StepWork, budget: TokenBudget) -> None:
        # Admission: while a slot is free, the next waiting request gets a first chunk if the budget and
        # the blocks allow. With prefix caching its longest run of cached full blocks is shared, not
        # recomputed: it starts at ``cached`` tokens computed, and only the rest is chunked. The first
        # request that does not fit stops admission for this step.
        bm = self.blocks
        while self.waiting and self.slots.num_free:
            seq = self._next_waiting()
            # A request that still needs prompt logprobs takes no cached blocks: a hit would skip
            # the rows whose logits it asked for (its own blocks are still offered to the cache).
            hits = []
            if self.config.prefix_caching and not seq.wants_prompt_rows:
                tokens = seq.all_token_ids
                hits = bm.computed_blocks(tokens, seq.params.cache_salt)
                hits += self._same_step_hits(tokens, hits, work, seq.params.cache_salt)
            cached = len(hits) * bm.block_size
            n = budget.chunk(seq.num_tokens - cached)
            if not n or not bm.can_allocate(seq.request_id, cached + n, hits):
                return                            # stays at the front: admission stops (no overtaking)
            self.waiting.remove(seq)              # the front (fcfs): O(1)
            bm.allocate(seq.request_id, cached + n, hits)
            self.count_admission(seq, cached)
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            self.start_running(seq)
            _grant(seq, n, work, budget)

    def _same_step_hits(self, tokens: list[int], hits: list[int], work: StepWork,
                        salt: str | None = None) -> list[int]:
        """The blocks that continue ``hits`` (the cached head of ``tokens``) with the same tokens, filled
        by a row granted earlier in this step: the longest such run of one row's full blocks, at most
        up to ``tokens``' last full block before its last token (see the module docstring)."""
        bm, bs = self.blocks, self.blocks.block_size
        limit, k0, best = (len(tokens) - 1) // bs, len(hits), []
        for rid, n in work.scheduled.items():
            other = self.running[rid]
            if other.params.cache_salt != salt:   # another tenant's blocks: never shared
                continue
            table = bm.block_tables[rid]
            full = min((other.num_computed_tokens + n) // bs, limit, len(table))
            if full <= k0 + len(best) or table[:k0] != hits:
                continue
            theirs, k = other.all_token_ids, k0
            while k < full and tokens[k * bs:(k + 1) * bs] == theirs[k * bs:(k + 1) * bs]:
                k += 1
            if k - k0 > len(best):
                best = table[k0:k]
        return best

    def _next_waiting(self) -> Sequence:
        """The request admission looks at: the front of the queue (fcfs), or the most important
        waiting one (priority; ties by arrival)."""
        if self.config.scheduling_policy == "fcfs":
            return self.waiting[0]
        return min(self.waiting, key=lambda s: importance_key(s, *self._ranking))

    @property
    def _ranking(self) -> tuple:
        """The arguments of ``preemption.importance_key`` after the sequence: policy, arrivals, aging."""
        return self.config.scheduling_policy, self.num_arrivals, self.config.priority_aging

    # --- after a step ---------------------------------------------------------------------------------
    def computed(self, seq: Sequence) -> None:
        """Offer the blocks that the recorded step filled to the prefix cache."""
        bm = self.blocks
        if self.config.prefix_caching and \
                seq.num_computed_tokens // bm.block_size > bm.num_hashed_blocks(seq.request_id):
            bm.cache_full_blocks(seq.request_id, seq.all_token_ids, seq.num_computed_tokens,
                                 seq.params.cache_salt)

    def finished(self, seq: Sequence) -> None:
        """A finished request frees its slot and blocks at once: the next step can refill them."""
        self.free(seq.request_id)

    def check_integrity(self) -> None:
        assert not self.batch, "continuous policy keeps no padded batch"


def _grant(seq: Sequence, n: int, work: StepWork, budget: TokenBudget) -> None:
    # The sequence computes ``n`` tokens this step: charge them to the step's budget and record them in
    # the step's work, from which ``Scheduler`` builds the plan's rows.
    budget.take(n)
    work.scheduled[seq.request_id] = n
