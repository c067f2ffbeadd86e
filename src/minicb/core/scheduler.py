"""The scheduler: every step, decide which sequences compute which tokens; afterwards, record results.

It composes the slot table, the block manager, the chunked-prefill planner and the preemption policy
into the two calls the engine's loop makes::

    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)                 # StepPlan: who computes which tokens, where
        sampled = run_the_model(plan)                  # {request_id: token} for rows with sample=True
        done = scheduler.update(plan, sampled, now)    # advance, append tokens, retire finished ones

Three policies (``SchedulerConfig.policy``), the three columns of the seed's benchmark:

``continuous`` (iteration-level scheduling). The batch is rebuilt every step, in this order::

    1. running    decodes first, then ongoing prefill chunks, most important first; blocks are
                  allocated lazily to cover start_pos + num_tokens. A sequence that cannot get its
                  blocks preempts the least important running one (maybe itself) until it fits.
    2. swapped    if nothing was preempted this step: swap sequences back in (before any new
                  request) while a slot, the budget and device blocks allow.
    3. waiting    if nothing was preempted and nothing is left swapped: admit from the front of the
                  waiting queue (recompute-preempted ones sit there) while a slot is free, the budget
                  remains and blocks for the first chunk exist; the first that does not fit stays at
                  the front and admission stops (the seed's rule: no overtaking).

  Running before swapped (as in vLLM v0) means a step never both swaps a sequence in and out, and a
  host block freed by a swap-in is never the target of a swap-out in the same step. Finished sequences
  release their slot and blocks in ``update``, so the next step can refill them.

  Prefix caching (``SchedulerConfig.enable_prefix_caching``, on by default for this policy): at
  admission the block manager's longest chain of cached full blocks becomes the head of the new
  block table, and ``num_computed_tokens`` (and ``Sequence.num_cached_tokens``) start at its length,
  so only the rest is fed to the model. ``update`` offers every block that the step filled to the
  cache. A recompute-preempted request is looked up again when re-admitted (its own blocks, or a
  shared prefix, are often still there); a request holding shared blocks is never swapped out
  (recomputed instead, see ``block_manager``)::

      step 0: A = [s s s s|s s a a|a]    computes 9 tokens; update caches A's 2 full blocks
      step 1: B = [s s s s|s s b b|b]    hit: block 0 (shared, ref 2); start_pos 4, computes 5

``dynamic`` (naive dynamic batching). When no batch runs, take whatever waits (FIFO, up to
``max_num_seqs``, as long as blocks for prompt + max_tokens can be reserved up front), prefill all
prompts in one step padded to the longest, then decode one token per member per step. A finished
member keeps its slot and yields a padding row every step until *every* member has finished; then the
whole batch is released and the next one formed. No preemption ever happens::

    step 0   A A A A A        B B . . .    C C C . .     (prefill; '.' = padding, plan.padding=[3, 2])
    step 1   A                B            C             (decode)
    step 2   A                .            C             (B finished: a padding row of length 1)

``static``: like dynamic, but a batch is only formed once ``max_num_seqs`` requests wait or
``close_arrivals()`` said no more will come.

The token budget ``max_num_batched_tokens`` applies to ``continuous`` only: the padded policies compute
whole prompts in one step, as a padded static-batch engine does.

Invariants (``check_integrity``, on top of the slot table's and block manager's): every unfinished
request is in exactly one of waiting / running / swapped; running ones hold one slot and a device
table, swapped ones a host table and no slot, waiting ones nothing (and ``num_computed_tokens == 0``);
``0 <= num_computed_tokens < num_tokens`` while unfinished. A step schedules at most ``max_num_seqs``
sequences and (continuous) at most ``max_num_batched_tokens`` tokens. This module imports no torch.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, RequestRejected
from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.core.planner import TokenBudget
from minicb.core.preemption import (
    Preemption,
    choose_victim,
    drop_swapped,
    importance_key,
    preempt,
    running_order,
)
from minicb.core.sequence import FinishReason, Sequence, SequenceStatus
from minicb.core.slot_table import SlotTable


@dataclass(slots=True)
class SchedulerStats:
    """Running totals for the metrics (tokens are counted when ``update`` records the step)."""

    num_steps: int = 0                 # schedule() calls
    num_preemptions: int = 0           # recompute + swap
    num_recomputes: int = 0
    num_swaps: int = 0                 # swap-outs
    num_swap_ins: int = 0
    num_batched_tokens: int = 0        # real tokens computed
    num_padding_tokens: int = 0        # padding tokens computed (padded policies)
    num_recomputed_tokens: int = 0     # computed tokens thrown away by recompute preemption
    num_finished: int = 0              # requests that ended (any reason)
    num_prompt_tokens: int = 0         # prompt tokens of requests admitted for the first time
    num_cached_prompt_tokens: int = 0  # of those, tokens served from the prefix cache at that admission
    num_cached_reprefill_tokens: int = 0   # tokens a recompute-preempted request found cached again

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens (first admissions; 0.0 if none)."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


@dataclass(slots=True, frozen=True)
class SchedulerSnapshot:
    """The scheduler's state at one moment as plain, immutable values: what step listeners see."""

    step: int                                              # steps planned so far
    slots: tuple[str | None, ...]                          # slot i -> the request holding it, or None
    block_tables: tuple[tuple[str, tuple[int, ...]], ...]  # (request, device blocks) of slot holders
    host_tables: tuple[tuple[str, tuple[int, ...]], ...]   # (request, host blocks) of swapped requests
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int                                 # blocks in the prefix cache (held or free)
    num_host_blocks: int
    num_free_host_blocks: int
    waiting: tuple[str, ...]                               # queue order: the front first
    running: tuple[str, ...]
    swapped: tuple[str, ...]
    arrivals_open: bool

    @property
    def num_held_slots(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def free_blocks(self) -> tuple[int, ...]:
        """The free device blocks (cached or not), lowest first: every block no table names. Derived
        on demand, so a snapshot costs O(held blocks), not O(pool) (simulated pools are large)."""
        held = {b for _, table in self.block_tables for b in table}
        return tuple(b for b in range(self.num_blocks) if b not in held)


@dataclass(slots=True)
class _StepWork:
    """What one schedule() call decided, before it becomes a frozen StepPlan."""

    scheduled: dict[str, int] = field(default_factory=dict)      # request_id -> num_tokens, in order
    padding: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Scheduler:
    """Plans every step (``schedule``) and records its results (``update``); see the module docstring."""

    config: SchedulerConfig
    slot_table: SlotTable = field(init=False)
    block_manager: BlockManager = field(init=False)
    stats: SchedulerStats = field(init=False)
    _seqs: dict[str, Sequence] = field(init=False, repr=False)        # every unfinished request
    _waiting: deque[Sequence] = field(init=False, repr=False)
    _running: dict[str, Sequence] = field(init=False, repr=False)
    _swapped: deque[Sequence] = field(init=False, repr=False)
    _batch: list[Sequence] = field(init=False, repr=False)            # padded policies: the batch
    _arrivals_open: bool = field(init=False, default=True)
    _next_arrival: int = field(init=False, default=0)
    _next_admission: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.config, SchedulerConfig):
            raise InvalidArgument(f"config must be a SchedulerConfig, got {type(self.config).__name__}")
        c = self.config
        self.slot_table = SlotTable(c.max_num_seqs)
        self.block_manager = BlockManager(c.num_blocks, c.block_size, c.num_host_blocks,
                                          enable_caching=c.prefix_caching)
        self.stats = SchedulerStats()
        self._seqs, self._running, self._batch = {}, {}, []
        self._waiting, self._swapped = deque(), deque()

    # --- queries ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def arrivals_open(self) -> bool:
        return self._arrivals_open

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while a request holds blocks (``block_manager``)."""
        return self.block_manager.reset_prefix_cache()

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished request ``request_id``, or None."""
        return self._seqs.get(request_id)

    def snapshot(self) -> SchedulerSnapshot:
        """The state right now, copied into immutable values (listeners may keep it)."""
        bm, table = self.block_manager, self.slot_table
        held = table.held()
        return SchedulerSnapshot(
            step=self.stats.num_steps,
            slots=tuple(held.get(i) for i in range(self.config.max_num_seqs)),
            block_tables=tuple((rid, tuple(bm.block_tables[rid])) for rid in held.values()
                               if rid in bm.block_tables),
            host_tables=tuple((rid, tuple(t)) for rid, t in bm.host_tables.items()),
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks, num_host_blocks=self.config.num_host_blocks,
            num_free_host_blocks=bm.num_free_host_blocks,
            waiting=tuple(s.request_id for s in self._waiting),
            running=tuple(self._running), swapped=tuple(s.request_id for s in self._swapped),
            arrivals_open=self._arrivals_open)

    # --- requests in -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Validate ``seq`` and queue it (WAITING). Raises before changing any state."""
        self.validate(seq)
        seq.arrival_index, self._next_arrival = self._next_arrival, self._next_arrival + 1
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.request_id] = seq
        self._waiting.append(seq)

    def validate(self, seq: Sequence) -> None:
        """Raise (``InvalidArgument``, or ``RequestRejected`` for a request that can never be served) if
        ``add(seq)`` would; change nothing. ``LLM.generate`` calls it on every prompt before any work."""
        if not isinstance(seq, Sequence):
            raise InvalidArgument(f"seq must be a Sequence, got {type(seq).__name__}")
        rid = seq.request_id
        if not isinstance(rid, str):
            raise InvalidArgument(f"request_id must be a str, got {type(rid).__name__}")
        if rid in self._seqs or any(s.request_id == rid for s in self._batch):
            raise InvalidArgument(f"request_id {rid!r} is already in use by an unfinished request")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.output_token_ids:
            raise InvalidArgument(f"request {rid!r} must be a fresh sequence (WAITING, nothing computed)")
        self._check_fits(seq)

    def _check_fits(self, seq: Sequence) -> None:
        c, rid = self.config, seq.request_id
        total = seq.max_total_tokens
        if not seq.prompt_token_ids:
            raise RequestRejected(f"request {rid!r} has an empty prompt (need at least 1 token)")
        if total > c.max_model_len:
            raise RequestRejected(
                f"request {rid!r}: prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.params.max_tokens})"
                f" = {total} tokens exceeds max_model_len={c.max_model_len}")
        need = self.block_manager.blocks_needed(total)
        if need > c.num_blocks:
            raise RequestRejected(
                f"request {rid!r} needs {need} KV blocks of {c.block_size} tokens for {total} tokens "
                f"(prompt + max_tokens), but the whole pool has num_blocks={c.num_blocks}")

    def close_arrivals(self) -> None:
        """No more requests will come: the static policy may now run a batch smaller than max_num_seqs."""
        self._arrivals_open = False

    def open_arrivals(self) -> None:
        self._arrivals_open = True

    # --- one step ----------------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> StepPlan:
        """Plan one step (see the module docstring); a plan without seqs means nothing to do now."""
        step = self.stats.num_steps
        self.stats.num_steps += 1
        if self.config.policy == "continuous":
            work = self._schedule_continuous()
        else:
            work = self._schedule_padded()
        return self._make_plan(step, work, now)

    def update(self, plan: StepPlan, sampled: Mapping[str, int], now: float) -> list[Sequence]:
        """Record a finished step: advance progress, append sampled tokens, retire finished requests.

        Rows whose request was aborted (or failed) since ``schedule`` are skipped.
        """
        live = [(s, self._running[s.request_id]) for s in plan.seqs if self._is_live(s)]
        tokens = {s.request_id: self._sampled_token(sampled, s.request_id) for s, _ in live if s.sample}
        finished = []
        for s, seq in live:
            seq.num_computed_tokens += s.num_tokens
            self.stats.num_batched_tokens += s.num_tokens
            self._cache_blocks(seq)
            if s.sample and seq.append_token(tokens[s.request_id], now):
                self._retire(seq)
                finished.append(seq)
        self.stats.num_padding_tokens += plan.num_padding_tokens
        self._release_batch_if_done()
        return finished

    def abort(self, request_id: str, now: float = 0.0) -> Sequence | None:
        """Finish ``request_id`` with ABORT from any state and free all it holds (None if unknown)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._end(seq, FinishReason.ABORT, now)
        return seq

    def fail_step(self, plan: StepPlan, error: str, now: float = 0.0) -> list[Sequence]:
        """The forward of ``plan`` raised: finish its requests with ERROR and free what they hold.

        Sequences swapped out by that plan lose their (possibly uncopied) host copy and will recompute.
        Everybody else keeps being served.
        """
        failed = [self._running[s.request_id] for s in plan.seqs if self._is_live(s)]
        for seq in failed:
            self._end(seq, FinishReason.ERROR, now, str(error))
        for rid in plan.preempted:
            self._swapped_to_recompute(self._seqs.get(rid))
        return failed

    # --- continuous policy -------------------------------------------------------------------------
    def _schedule_continuous(self) -> _StepWork:
        c = self.config
        work = _StepWork()
        budget = TokenBudget(c.max_num_batched_tokens, c.max_num_seqs, c.chunk_cap)
        self._schedule_running(work, budget)
        if not work.preempted:
            self._schedule_swapped(work, budget)
        if not work.preempted and not self._swapped:
            self._schedule_waiting(work, budget)
        budget.check_integrity()
        return work

    def _schedule_running(self, work: _StepWork, budget: TokenBudget) -> None:
        order = running_order(self._running.values(), *self._ranking)
        for seq in [s for s in order if not s.in_prefill] + [s for s in order if s.in_prefill]:
            if seq.status is not SequenceStatus.RUNNING:
                continue                                 # preempted earlier in this step
            n = budget.chunk(seq.num_uncomputed_tokens)
            if n and self._make_room(seq, n, work, budget):
                self._grant(seq, n, work, budget)

    def _make_room(self, seq: Sequence, n: int, work: _StepWork, budget: TokenBudget) -> bool:
        """Allocate blocks for ``seq``'s next ``n`` tokens, preempting victims; False if seq itself was."""
        target = seq.num_computed_tokens + n
        while not self.block_manager.can_allocate(seq.request_id, target):
            victim = choose_victim(self._running.values(), *self._ranking)
            self._preempt(victim, work, budget)
            if victim is seq:
                return False
        self.block_manager.allocate(seq.request_id, target)
        return True

    def _preempt(self, victim: Sequence, work: _StepWork, budget: TokenBudget) -> None:
        granted = work.scheduled.pop(victim.request_id, 0)
        if granted:
            budget.give_back(granted)
        del self._running[victim.request_id]
        p = preempt(victim, self.config.preemption_mode, self.block_manager, self.slot_table)
        queue = self._swapped if p.mode == "swap" else self._waiting
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

    def _schedule_swapped(self, work: _StepWork, budget: TokenBudget) -> None:
        bm = self.block_manager
        while self._swapped and self.slot_table.num_free:
            seq = self._swapped[0]
            n = budget.chunk(seq.num_uncomputed_tokens)
            if not n or not bm.can_swap_in(seq.request_id, seq.num_computed_tokens + n):
                return
            self._swapped.popleft()
            work.swap_in.extend(bm.swap_in(seq.request_id))
            bm.allocate(seq.request_id, seq.num_computed_tokens + n)
            self.stats.num_swap_ins += 1
            self._start_running(seq)
            self._grant(seq, n, work, budget)

    @property
    def _ranking(self) -> tuple:
        """The arguments of ``preemption.importance_key`` after the sequence: policy, arrivals, aging."""
        return self.config.scheduling_policy, self._next_arrival, self.config.priority_aging

    def _next_waiting(self) -> Sequence:
        """The request admission looks at: the front of the queue (fcfs), or the most important
        waiting one (priority; ties by arrival)."""
        if self.config.scheduling_policy == "fcfs":
            return self._waiting[0]
        return min(self._waiting, key=lambda s: importance_key(s, *self._ranking))

    def _schedule_waiting(self, work: _StepWork, budget: TokenBudget) -> None:
        bm = self.block_manager
        while self._waiting and self.slot_table.num_free:
            seq = self._next_waiting()
            hits = bm.computed_blocks(seq.all_token_ids) if self.config.prefix_caching else []
            cached = len(hits) * bm.block_size
            n = budget.chunk(seq.num_tokens - cached)
            if not n or not bm.can_allocate(seq.request_id, cached + n, hits):
                return                            # stays at the front: admission stops (no overtaking)
            self._waiting.remove(seq)             # the front (fcfs): O(1)
            bm.allocate(seq.request_id, cached + n, hits)
            self._count_admission(seq, cached)
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            self._start_running(seq)
            self._grant(seq, n, work, budget)

    def _count_admission(self, seq: Sequence, num_cached: int) -> None:
        st = self.stats
        if seq.admitted_index < 0:                # its first admission
            st.num_prompt_tokens += seq.num_prompt_tokens
            st.num_cached_prompt_tokens += num_cached
        else:                                     # back after recompute preemption
            st.num_cached_reprefill_tokens += num_cached

    def _cache_blocks(self, seq: Sequence) -> None:
        """Offer the blocks that the recorded step filled to the prefix cache (continuous only)."""
        bm = self.block_manager
        if self.config.prefix_caching and \
                seq.num_computed_tokens // bm.block_size > bm.num_hashed_blocks(seq.request_id):
            bm.cache_full_blocks(seq.request_id, seq.all_token_ids, seq.num_computed_tokens)

    @staticmethod
    def _grant(seq: Sequence, n: int, work: _StepWork, budget: TokenBudget) -> None:
        budget.take(n)
        work.scheduled[seq.request_id] = n

    # --- padded policies (dynamic, static) ---------------------------------------------------------
    def _schedule_padded(self) -> _StepWork:
        if not self._batch and self._may_form_batch():
            self._form_batch()
        work = _StepWork()
        live = [s for s in self._batch if not s.is_finished]
        longest = max((s.num_uncomputed_tokens for s in live), default=0)
        for seq in self._batch:
            n = 0 if seq.is_finished else seq.num_uncomputed_tokens
            if n:
                work.scheduled[seq.request_id] = n
            if longest - n:
                work.padding.append(longest - n)
        return work

    def _may_form_batch(self) -> bool:
        if self.config.policy == "static" and self._arrivals_open:
            return len(self._waiting) >= self.config.max_num_seqs
        return bool(self._waiting)

    def _form_batch(self) -> None:
        bm = self.block_manager
        while self._waiting and len(self._batch) < self.config.max_num_seqs:
            seq = self._waiting[0]
            if not bm.can_allocate(seq.request_id, seq.max_total_tokens):
                return                            # FIFO: the first that does not fit waits
            self._waiting.popleft()
            bm.allocate(seq.request_id, seq.max_total_tokens)     # reserved up front: no preemption
            self._count_admission(seq, 0)
            self._start_running(seq)
            self._batch.append(seq)

    def _release_batch_if_done(self) -> None:
        if self._batch and all(s.is_finished for s in self._batch):
            for seq in self._batch:
                self._free(seq.request_id)
            self._batch.clear()

    # --- shared helpers ----------------------------------------------------------------------------
    def _start_running(self, seq: Sequence) -> None:
        seq.slot_id = self.slot_table.assign(seq.request_id)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_index, self._next_admission = self._next_admission, self._next_admission + 1
        self._running[seq.request_id] = seq

    def _make_plan(self, step: int, work: _StepWork, now: float) -> StepPlan:
        seqs = tuple(self._scheduled_seq(self._seqs[rid], n, now) for rid, n in work.scheduled.items())
        return StepPlan(step=step, seqs=seqs, padding=tuple(work.padding), swap_out=tuple(work.swap_out),
                        swap_in=tuple(work.swap_in), preempted=tuple(work.preempted),
                        block_size=self.config.block_size)

    def _scheduled_seq(self, seq: Sequence, n: int, now: float) -> ScheduledSeq:
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        start = seq.num_computed_tokens
        table = tuple(self.block_manager.block_tables[seq.request_id])
        return ScheduledSeq(request_id=seq.request_id, slot_id=seq.slot_id, start_pos=start,
                            token_ids=_token_slice(seq, start, n), block_table=table,
                            sample=start + n == seq.num_tokens)

    def _is_live(self, s: ScheduledSeq) -> bool:
        """Is the row ``s`` still about the running sequence it was planned for?"""
        seq = self._running.get(s.request_id)
        return seq is not None and seq.num_computed_tokens == s.start_pos

    @staticmethod
    def _sampled_token(sampled: Mapping[str, int], request_id: str) -> int:
        if request_id not in sampled:
            raise InvalidArgument(f"sampled has no token for request {request_id!r} (its row samples)")
        try:
            token = operator.index(sampled[request_id])
        except TypeError:
            raise InvalidArgument(f"sampled[{request_id!r}] must be an int, got "
                                  f"{type(sampled[request_id]).__name__}") from None
        if token < 0:
            raise InvalidArgument(f"sampled[{request_id!r}] must be >= 0, got {token}")
        return token

    def _retire(self, seq: Sequence) -> None:
        """``seq`` just finished normally: forget it; continuous frees its slot and blocks now, a
        padded batch keeps them (the member becomes a padding row) until the whole batch is done."""
        del self._running[seq.request_id]
        del self._seqs[seq.request_id]
        self.stats.num_finished += 1
        if self.config.policy == "continuous":
            self._free(seq.request_id)

    def _end(self, seq: Sequence, reason: FinishReason, now: float, error: str | None = None) -> None:
        """Finish ``seq`` from any state (abort, error) and free everything it holds at once."""
        self._unqueue(seq)
        self._free(seq.request_id)
        if seq in self._batch:
            self._batch.remove(seq)
        del self._seqs[seq.request_id]
        seq.finish(reason, now, error)
        self.stats.num_finished += 1
        self._release_batch_if_done()

    def _unqueue(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            del self._running[seq.request_id]
        elif seq.status is SequenceStatus.SWAPPED:
            self._swapped.remove(seq)
        else:
            self._waiting.remove(seq)

    def _free(self, request_id: str) -> None:
        slot = self.slot_table.slot_of(request_id)
        if slot is not None:
            self.slot_table.release(slot)
        self.block_manager.free(request_id)

    def _swapped_to_recompute(self, seq: Sequence | None) -> None:
        if seq is not None and seq.status is SequenceStatus.SWAPPED:
            self._swapped.remove(seq)
            drop_swapped(seq, self.block_manager)
            self._waiting.appendleft(seq)

    # --- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.slot_table.check_integrity()
        self.block_manager.check_integrity()
        waiting, swapped, running = list(self._waiting), list(self._swapped), list(self._running.values())
        ids = [s.request_id for s in waiting + swapped + running]
        assert len(ids) == len(set(ids)) and set(ids) == set(self._seqs), \
            "every unfinished request must be in exactly one of waiting / swapped / running"
        for seq in waiting:
            self._check_waiting(seq)
        for seq in swapped:
            self._check_swapped(seq)
        for seq in running:
            self._check_running(seq)
        self._check_holders(running)

    def _check_waiting(self, seq: Sequence) -> None:
        bm = self.block_manager
        assert seq.status is SequenceStatus.WAITING and seq.slot_id is None, seq.request_id
        assert seq.num_computed_tokens == 0, f"{seq.request_id} waits with computed tokens"
        assert seq.num_cached_tokens == 0, f"{seq.request_id} waits with cached tokens"
        assert seq.request_id not in bm.block_tables and not bm.is_swapped(seq.request_id), seq.request_id

    def _check_swapped(self, seq: Sequence) -> None:
        bm = self.block_manager
        assert seq.status is SequenceStatus.SWAPPED and seq.slot_id is None, seq.request_id
        assert bm.is_swapped(seq.request_id), f"{seq.request_id} is swapped without a host table"
        assert len(bm.host_tables[seq.request_id]) * bm.block_size >= seq.num_computed_tokens
        assert 0 <= seq.num_computed_tokens < seq.num_tokens, seq.request_id

    def _check_running(self, seq: Sequence) -> None:
        bm = self.block_manager
        assert seq.status is SequenceStatus.RUNNING, seq.request_id
        assert self.slot_table.owner(seq.slot_id) == seq.request_id, f"{seq.request_id}: slot mismatch"
        assert seq.request_id in bm.block_tables, f"{seq.request_id} runs without a device table"
        assert len(bm.block_tables[seq.request_id]) * bm.block_size >= seq.num_computed_tokens
        assert 0 <= seq.num_computed_tokens < seq.num_tokens, seq.request_id
        assert 0 <= seq.num_cached_tokens <= seq.num_computed_tokens, seq.request_id
        for i, block in enumerate(bm.block_tables[seq.request_id]):
            if not bm.is_cached(block):
                break                             # cached blocks are a prefix of the table, and ...
            assert (i + 1) * bm.block_size <= seq.num_computed_tokens, \
                f"{seq.request_id}: cached block {block} would still be written"   # ... never written

    def _check_holders(self, running: list[Sequence]) -> None:
        """Slots and device tables belong to running requests (and, padded, to the batch's members)."""
        holders = {s.request_id for s in running} | {s.request_id for s in self._batch}
        assert set(self.slot_table.held().values()) == holders, "slot holders != running requests"
        assert set(self.block_manager.block_tables) == holders, "device tables != running requests"
        assert set(self.block_manager.host_tables) == {s.request_id for s in self._swapped}
        assert len(holders) <= self.config.max_num_seqs
        if self.config.policy == "continuous":
            assert not self._batch, "continuous policy keeps no padded batch"
        for seq in self._batch:
            assert len(self.block_manager.block_tables[seq.request_id]) == \
                self.block_manager.blocks_needed(seq.max_total_tokens), "padded batch reserves everything"


def _token_slice(seq: Sequence, start: int, n: int) -> tuple[int, ...]:
    """``seq.all_token_ids[start:start + n]`` without concatenating the whole prompt every step."""
    prompt, out = seq.prompt_token_ids, seq.output_token_ids
    p = len(prompt)
    if start + n <= p:
        return tuple(prompt[start:start + n])
    if start >= p:
        return tuple(out[start - p:start - p + n])
    return tuple(prompt[start:]) + tuple(out[:start + n - p])
