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
several steps while the decodes keep running. **Stall-free**: once the decodes have their tokens,
if there are any, everything after them (ongoing prefills, swapped-in and new prompts) shares at most
``max_prefill_tokens_while_decoding + N * prefill_tokens_per_seq`` tokens, ``N`` the sequences the
scheduler holds (running, swapped and waiting; at most ``max_num_seqs``), so that the step, which the
decodes wait for, stays short; with no decode running, prompts get the whole budget (``planner``'s
docstring explains the numbers)::

    4 + 4 a sequence, budget 2048:    A decode (1)   B prompt[0:12]      N = 2: 4 + 8, A's next token soon
                          A ends:     B prompt[12:2000]                   no decode: the whole budget

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
prompt's last block, which it may share with its siblings; ``_make_room`` makes the copy-on-write
with the row's other blocks (``BlockManager.append_slots``), and a preempted victim's copy is taken
back with its grant.

The policy reads the scheduler's queues and asks the scheduler for every move (``admit``,
``resume``, ``preempt``): the queues have one writer.

This module imports no torch.
"""

from __future__ import annotations

from minicb.core.planner import TokenBudget
from minicb.core.policy import Policy, StepWork
from minicb.core.preemption import choose_victim, importance_key
from minicb.core.sequence import Sequence, SequenceStatus


class ContinuousPolicy(Policy):
    """Rebuilds the batch every step: running (preempting to fit), then swapped, then waiting."""

    fcfs = True        # the scheduling policy of the step being planned (fcfs, or priority)

    def schedule(self) -> StepWork:
        """One step's batch, in the three steps of the module docstring."""
        c = self.sched.config
        self.fcfs = c.scheduling_policy == "fcfs"
        work = StepWork()
        cap = c.long_prefill_chunk or c.max_num_batched_tokens       # the longest chunk of one prompt
        budget = TokenBudget(c.max_num_batched_tokens, c.max_num_seqs, cap)
        self._schedule_running(work, budget)          # 1. decodes, then prefill chunks; preempt to fit
        if self.swapped and not work.preempted:
            self._schedule_swapped(work, budget)      # 2. swapped ones back, before any new request
        if self.waiting and not work.preempted and not self.swapped:
            self._schedule_waiting(work, budget)      # 3. admit from the front, no overtaking
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
        # (budget spent) simply keeps its slot and waits for the next step. Under fcfs the running
        # dict is already in admission order (``Scheduler.start_running`` appends), so nothing is sorted.
        # Once the decodes have their tokens, the stall-free cap (module docstring) bounds the rest.
        order = self.running.values() if self.fcfs else sorted(self.running.values(), key=self._importance)
        decodes, prefills = [], []
        for seq in order:
            (decodes if seq.num_uncomputed_tokens == 1 else prefills).append(seq)
        for seq in decodes:
            self._grant(seq, work, budget)
        c = self.sched.config
        if decodes and c.max_prefill_tokens_while_decoding:   # stall-free: a cap on all prompts that follow
            held = len(self.running) + len(self.swapped) + len(self.waiting)   # (here, and in 2. and 3.)
            held = min(held, c.max_num_seqs)                  # no more than the slots decode together
            budget.prefill_left = c.max_prefill_tokens_while_decoding + c.prefill_tokens_per_seq * held
        for seq in prefills:
            self._grant(seq, work, budget)

    def _grant(self, seq: Sequence, work: StepWork, budget: TokenBudget) -> None:
        """A running sequence's next tokens (a chunk of its prompt, or one), with blocks for them."""
        if seq.status is not SequenceStatus.RUNNING:
            return                                       # preempted earlier in this step
        n = budget.chunk(seq.num_uncomputed_tokens)
        if n and self._make_room(seq, n, work, budget):
            budget.take(n)                               # granted: charged to the step's budget
            work.scheduled[seq.request_id] = n

    def _make_room(self, seq: Sequence, n: int, work: StepWork, budget: TokenBudget) -> bool:
        """Blocks for ``seq``'s next ``n`` tokens, preempting victims; False if seq itself was."""
        copies = self.blocks.append_slots(seq.request_id, seq.num_computed_tokens, n)
        while copies is None:                            # the pool is short: the least important goes
            victim = next(reversed(self.running.values())) if self.fcfs else \
                choose_victim(self.running.values(), *self._ranking)
            self._preempt(victim, work, budget)
            if victim is seq:
                return False
            copies = self.blocks.append_slots(seq.request_id, seq.num_computed_tokens, n)
        if copies:
            work.copy_blocks[seq.request_id] = copies[0]   # a fork's shared last block, copied on write
        return True

    def _preempt(self, victim: Sequence, work: StepWork, budget: TokenBudget) -> None:
        # Undo whatever this step already granted the victim, and let the scheduler preempt it
        # (``Scheduler.preempt``: recompute drops its KV, swap copies it to the host pool; either way it
        # goes to the *front* of its queue, so it comes back before anything that arrived after it).
        granted = work.scheduled.pop(victim.request_id, 0)
        if granted:
            budget.give_back(granted)
        work.copy_blocks.pop(victim.request_id, None)   # its copy's destination is freed with it
        p = self.sched.preempt(victim)
        work.preempted.append(victim.request_id)
        work.swap_out.extend(p.swap_out)

    # --- 2. swapped ---------------------------------------------------------------------------------
    def _schedule_swapped(self, work: StepWork, budget: TokenBudget) -> None:
        # Swapped-out sequences come back in order while a slot is free and their blocks (the copied
        # ones plus this step's chunk) fit on the device. The copies are only recorded here
        # (``work.swap_in``); the runner makes them before the forward pass reads the cache.
        while self.swapped and self.slots.num_free:
            seq = self.swapped[0]
            n = budget.chunk(seq.num_uncomputed_tokens)
            if not n or not self.blocks.can_swap_in(seq.request_id, seq.num_computed_tokens + n):
                return
            work.swap_in.extend(self.sched.resume(seq, seq.num_computed_tokens + n))
            budget.take(n)
            work.scheduled[seq.request_id] = n

    # --- 3. waiting ---------------------------------------------------------------------------------
    def _schedule_waiting(self, work: StepWork, budget: TokenBudget) -> None:
        # Admission: while a slot is free, the next waiting request gets a first chunk if the budget and
        # the blocks allow. With prefix caching its longest run of cached full blocks is shared, not
        # recomputed: it starts at ``cached`` tokens computed, and only the rest is chunked. The first
        # request that does not fit stops admission for this step.
        bm = self.blocks
        while self.waiting and self.slots.num_free:
            seq = self.waiting[0] if self.fcfs else min(self.waiting, key=self._importance)
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
            self.sched.admit(seq, cached + n, hits, cached)
            budget.take(n)
            work.scheduled[seq.request_id] = n

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

    # --- importance (priority scheduling) -------------------------------------------------------------
    @property
    def _ranking(self) -> tuple:
        """The arguments of ``preemption.importance_key`` after the sequence: policy, arrivals, aging."""
        return self.config.scheduling_policy, self.sched.num_arrivals, self.config.priority_aging

    def _importance(self, seq: Sequence) -> tuple[int, ...]:
        return importance_key(seq, *self._ranking)

    # --- after a step ---------------------------------------------------------------------------------
    def finished(self, seq: Sequence) -> None:
        """A finished request frees its slot and blocks at once: the next step can refill them."""
        self.sched.free(seq.request_id)

    def check_integrity(self) -> None:
        assert not self.batch, "continuous policy keeps no padded batch"
        admitted = [s.admitted_index for s in self.running.values()]
        assert admitted == sorted(admitted), "the running dict is in admission order (fcfs reads it so)"
