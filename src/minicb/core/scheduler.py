"""The scheduler: every step, decide which sequences compute which tokens; afterwards, record results.

It composes the slot table, the block manager, the chunked-prefill planner and the preemption policy
into the two calls the engine's loop makes::

    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)                 # StepPlan: who computes which tokens, where
        sampled = run_the_model(plan)                  # {request_id: token} for rows with sample=True
        done = scheduler.update(plan, sampled, now)    # advance, append tokens, retire finished ones

The scheduler owns the requests: every unfinished one is in exactly one queue (waiting, running,
swapped), and it adds, records, aborts and fails them. *Which* of them run in a step is the policy's
choice (``SchedulerConfig.policy``, the three columns of the benchmark table; ``policy.py``)::

    continuous   ContinuousPolicy (continuous.py)   the batch is rebuilt every step: running (with
                                                    preemption), then swapped, then waiting
    dynamic      PaddedPolicy (padded.py)           a batch of whatever waits, padded, run to the end
    static       PaddedPolicy (padded.py)           the same, once max_num_seqs requests wait

Recording (``update``) is the same for all three: each planned row advances its request, a sampled
token is appended, and a request that is done leaves the queues; the policy then frees its slot and
blocks (continuous, at once) or keeps them until the whole batch is done (padded). ``stats.py`` holds
the counters (``SchedulerStats``) and the listener's view (``SchedulerSnapshot``).

**Parallel sampling** (``SamplingParams.n > 1``; vLLM V0's fork after the prompt): ``add(seq, forks)``
queues child 0 (``seq``) like any request and keeps the other children *attached* to it, in no queue
and holding nothing. The row that finishes child 0's prompt names them (``ScheduledSeq.forks``), the
runner samples its logits once per child (each with its own generator), and ``update`` forks them::

    step k   child 0: prompt [p p p p|p p]  sample -> t0;  forks (1, 2): sampled t1, t2 from the same row
    update   children 1, 2 get the prompt's blocks by reference (block_manager.fork), their own token,
             a slot each; next step each writes its token: the shared last block is copied on write

A child that finishes with its first token ends at once. A child that finds **no free slot** at the
fork gives the blocks back and waits at the front of the waiting queue, with its token: it is admitted
as soon as a slot frees, and recomputes its prompt and its token like a recompute-preempted sequence
(with prefix caching only the prompt's last, partly filled block, since the full ones stay cached).
So ``n`` never needs ``n`` free slots, and the others are never held up. The padded policies do not
fork: every child is queued as a request of its own and computes the prompt itself, as a padded
static batch would. Aborting or failing child 0 before the fork ends its attached children too (the
engine aborts every child of a request together anyway).

**One writer.** The queues (``waiting``, ``running``, ``swapped``) are read by the policy and written by
the scheduler alone: a policy decides and asks for a move (``admit``: waiting -> running, ``resume``:
swapped -> running, ``preempt``: running -> the front of waiting or swapped, ``free``: a finished
request's slot and blocks); adding, recording, aborting and failing are the scheduler's own.

Invariants (``check_integrity``, ``integrity.py``, on top of the slot table's and block manager's): every
unfinished request is in exactly one of waiting / running / swapped / attached to its child 0; running ones
hold one slot and a device table, swapped ones a host table and no slot, waiting ones nothing (and
``num_computed_tokens == 0``); ``0 <= num_computed_tokens < num_tokens`` while unfinished; a block two
tables share is never written again: it is full for every holder, or it is the holder's partly filled last
block and the holder's next write copies it first. A step schedules at most ``max_num_seqs`` sequences and
(continuous) at most ``max_num_batched_tokens`` tokens. This module imports no torch.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from minicb.core import integrity
from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.continuous import ContinuousPolicy
from minicb.core.errors import InvalidArgument
from minicb.core.padded import PaddedPolicy
from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.core.policy import Policy
from minicb.core.preemption import Preemption, drop_swapped, preempt
from minicb.core.sequence import FinishReason, Sequence, SequenceStatus
from minicb.core.slot_table import SlotTable
from minicb.core.stats import SchedulerSnapshot, SchedulerStats

__all__ = ["Scheduler", "SchedulerSnapshot", "SchedulerStats"]


@dataclass(slots=True)
class Scheduler:
    """Plans every step (``schedule``) and records its results (``update``); see the module docstring."""

    config: SchedulerConfig
    slot_table: SlotTable = field(init=False)
    block_manager: BlockManager = field(init=False)
    stats: SchedulerStats = field(init=False)
    waiting: deque[Sequence] = field(init=False, repr=False)       # written here only (module docstring)
    running: dict[str, Sequence] = field(init=False, repr=False)   # ... in admission order
    swapped: deque[Sequence] = field(init=False, repr=False)
    policy: Policy = field(init=False, repr=False)                  # continuous or padded
    num_arrivals: int = field(init=False, default=0)                # requests added so far
    arrivals_open: bool = field(init=False, default=True)
    _seqs: dict[str, Sequence] = field(init=False, repr=False)     # every unfinished request
    _attached: dict[str, list[Sequence]] = field(init=False, repr=False)  # child 0 -> children to fork
    _next_admission: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.config, SchedulerConfig):
            raise InvalidArgument(f"config must be a SchedulerConfig, got {type(self.config).__name__}")
        c = self.config
        self.slot_table = SlotTable(c.max_num_seqs)
        self.block_manager = BlockManager(c.num_blocks, c.block_size, c.num_host_blocks,
                                          enable_caching=c.prefix_caching)
        self.stats = SchedulerStats()
        self._seqs, self.running, self._attached = {}, {}, {}
        self.waiting, self.swapped = deque(), deque()
        self.policy = ContinuousPolicy(self) if c.policy == "continuous" else PaddedPolicy(self)

    # --- queries ---------------------------------------------------------------------------
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
        return SchedulerSnapshot.of(self)

    # --- requests in -----------------------------------------------------------------------------
    def add(self, seq: Sequence, forks: list[Sequence] | tuple[Sequence, ...] = ()) -> None:
        """Validate ``seq`` and queue it (WAITING); raises before changing anything. ``forks``: the other
        children of a request with ``n > 1``, forked from ``seq`` after its prompt (module docstring)."""
        self.validate(seq, forks)
        for s in (seq, *forks):
            s.arrival_index, self.num_arrivals = self.num_arrivals, self.num_arrivals + 1
            s.status = SequenceStatus.WAITING
            self._seqs[s.request_id] = s
        self.waiting.append(seq)
        if forks and self.config.policy == "continuous":
            self._attached[seq.request_id] = list(forks)
        else:                                   # the padded baselines: every child on its own
            self.waiting.extend(forks)

    def validate(self, seq: Sequence, forks: list[Sequence] | tuple[Sequence, ...] = ()) -> None:
        """Raise what ``add(seq, forks)`` would (``integrity.check_request``); change nothing."""
        in_use = set(self._seqs) | {s.request_id for s in self.policy.batch}
        integrity.check_request(seq, forks, self.config, self.block_manager, in_use)

    def close_arrivals(self, closed: bool = True) -> None:
        """No more requests will come (or, ``False``, they may again): the static policy may now run a
        batch smaller than max_num_seqs."""
        self.arrivals_open = not closed

    # --- one step ----------------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> StepPlan:
        """Plan one step: the policy chooses (module docstring), each choice becomes a row."""
        step = self.stats.num_steps
        self.stats.num_steps += 1
        work = self.policy.schedule()
        rows = []
        for rid, n in work.scheduled.items():
            rows.append(self._row(self._seqs[rid], n, now))
        return StepPlan(step=step, seqs=tuple(rows), padding=tuple(work.padding),
                        swap_out=tuple(work.swap_out), swap_in=tuple(work.swap_in),
                        preempted=tuple(work.preempted), copy_blocks=tuple(work.copy_blocks.values()),
                        block_size=self.config.block_size)

    def _row(self, seq: Sequence, n: int, now: float) -> ScheduledSeq:
        """``seq``'s row: its next ``n`` tokens from ``num_computed_tokens`` on, in its blocks; it samples
        when the row reaches its last token (and then forks its attached children, if any)."""
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        start = seq.num_computed_tokens
        prompt, p, out = seq.prompt_token_ids, len(seq.prompt_token_ids), seq.output_token_ids
        tokens = prompt[start:start + n] if start + n <= p else (prompt[start:] + out[max(start - p, 0):])[:n]
        sample = start + n == p + len(seq.output_token_ids)
        forks = tuple(c.request_id for c in self._attached[seq.request_id]) \
            if sample and seq.request_id in self._attached else ()
        targets = _prompt_targets(seq, start, n) if seq.params.prompt_logprobs is not None else ()
        return ScheduledSeq(request_id=seq.request_id, slot_id=seq.slot_id, start_pos=start,
                            token_ids=tuple(tokens),
                            block_table=tuple(self.block_manager.block_tables[seq.request_id]),
                            sample=sample, forks=forks, prompt_targets=targets)

    def update(self, plan: StepPlan, sampled: Mapping[str, int], now: float) -> list[Sequence]:
        """Record a finished step: advance progress, append sampled tokens, retire finished requests.
        Rows whose request was aborted (or failed) since ``schedule`` are skipped. Every sampled token
        is checked before anything changes."""
        live = []
        for s in plan.seqs:
            seq = self.running.get(s.request_id)
            if seq is not None and seq.num_computed_tokens == s.start_pos:      # still the planned row
                live.append((s, seq))
                _check_tokens(s, sampled, self._seqs)
        bm, finished = self.block_manager, []
        caching = bm.cache is not None                # prefix caching in effect (config.prefix_caching)
        for s, seq in live:
            seq.num_computed_tokens += len(s.token_ids)
            self.stats.num_batched_tokens += len(s.token_ids)
            if s.prompt_targets:
                seq.num_prompt_logprobs = max(seq.num_prompt_logprobs, s.start_pos + len(s.prompt_targets))
            if caching and seq.num_computed_tokens // bm.block_size > bm.num_hashed.get(s.request_id, 0):
                bm.cache_full_blocks(s.request_id, seq.all_token_ids, seq.num_computed_tokens,
                                     seq.params.cache_salt)                 # offer the full blocks
            if not s.sample:
                continue
            done = seq.append_token(int(sampled[s.request_id]), now)
            if s.forks:                   # before child 0 may retire: the children take its blocks
                finished += self._fork(seq, [r for r in s.forks if r in self._seqs], sampled, now)
            if done:
                del self.running[s.request_id]
                del self._seqs[s.request_id]
                self.stats.num_finished += 1
                self.policy.finished(seq)           # continuous: frees its slot and blocks now
                finished.append(seq)
        self.stats.num_padding_tokens += sum(plan.padding)
        return finished

    def abort(self, request_id: str, now: float = 0.0, error: str | None = None) -> Sequence | None:
        """Finish ``request_id`` with ABORT (ERROR with ``error``: its row failed alone) from any state
        and free all it holds (None if unknown); an attached child 0 takes its children with it."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self._end(seq, FinishReason.ABORT if error is None else FinishReason.ERROR, now, error)
        return seq

    def fail_step(self, plan: StepPlan, error: str, now: float = 0.0) -> list[Sequence]:
        """The forward of ``plan`` raised: finish its requests with ERROR and free what they hold. Those it
        swapped out lose their (maybe uncopied) host copy and will recompute; everybody else goes on."""
        failed = [self.running[s.request_id] for s in plan.seqs if s.request_id in self.running
                  and self.running[s.request_id].num_computed_tokens == s.start_pos]
        children = [c for seq in failed for c in self._attached.get(seq.request_id, ())]
        for seq in failed:
            self._end(seq, FinishReason.ERROR, now, str(error))     # with its attached children
        failed += children
        for rid in plan.preempted:
            seq = self._seqs.get(rid)
            if seq is not None and seq.status is SequenceStatus.SWAPPED:
                self.swapped.remove(seq)
                drop_swapped(seq, self.block_manager)
                self.waiting.appendleft(seq)
        return failed

    # --- the policy's moves (the only writes to the queues besides add / update / abort) ------------
    def admit(self, seq: Sequence, num_tokens: int, hits=(), cached: int = 0) -> None:
        """The waiting ``seq`` runs: blocks for ``num_tokens`` positions (first the cache's ``hits``)."""
        self.waiting.remove(seq)              # the front (fcfs): O(1)
        self.block_manager.allocate(seq.request_id, num_tokens, hits)
        self.stats.count_admission(seq.num_prompt_tokens, cached, first=seq.admitted_index < 0)
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        self._start_running(seq)

    def resume(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """The swapped ``seq`` (the front of ``swapped``) runs again: its blocks come back to the device
        and grow to ``num_tokens`` positions; returns the (host, device) copies the runner makes."""
        assert self.swapped[0] is seq, "swapped requests resume in order"
        self.swapped.popleft()
        copies = self.block_manager.swap_in(seq.request_id)
        self.block_manager.allocate(seq.request_id, num_tokens)
        self.stats.num_swap_ins += 1
        self._start_running(seq)
        return copies

    def preempt(self, seq: Sequence) -> Preemption:
        """Suspend the running ``seq`` (``preemption.preempt``: swap or recompute) and put it at the front
        of its queue: victims are preempted newest first, so the oldest ends up in front."""
        del self.running[seq.request_id]
        p = preempt(seq, self.config.preemption_mode, self.block_manager, self.slot_table)
        (self.swapped if p.mode == "swap" else self.waiting).appendleft(seq)
        self.stats.count_preemption(p.mode, p.num_lost_tokens)
        return p

    def free(self, request_id: str) -> None:
        """Release the request's slot (if it holds one) and every block it holds."""
        slot = self.slot_table.slot_of(request_id)
        if slot is not None:
            self.slot_table.release(slot)
        self.block_manager.free(request_id)

    def _start_running(self, seq: Sequence) -> None:
        seq.slot_id = self.slot_table.assign(seq.request_id)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_index, self._next_admission = self._next_admission, self._next_admission + 1
        self.running[seq.request_id] = seq

    # --- forks and endings -------------------------------------------------------------------------
    def _fork(self, parent: Sequence, ids: list[str], tokens: Mapping[str, int],
              now: float) -> list[Sequence]:
        """``parent``'s prompt is computed: each attached child takes its sampled token and, unless that
        finished it, the parent's blocks by reference and a free slot, or waits at the front of the
        waiting queue without blocks (module docstring). Returns the children that finished."""
        children = self._attached.pop(parent.request_id)
        assert [c.request_id for c in children] == ids, "the row forks every attached child"
        finished, queued = [], []
        for child in children:
            child.first_scheduled_time = parent.first_scheduled_time
            if child.append_token(int(tokens[child.request_id]), now):
                del self._seqs[child.request_id]
                self.stats.num_finished += 1
                finished.append(child)
            elif self.slot_table.num_free:
                self.block_manager.fork(parent.request_id, child.request_id)
                child.num_computed_tokens = parent.num_computed_tokens
                child.num_cached_tokens = parent.num_cached_tokens
                self._start_running(child)
            else:
                queued.append(child)
        self.waiting.extendleft(reversed(queued))      # in index order, ahead of later arrivals
        return finished

    def _end(self, seq: Sequence, reason: FinishReason, now: float, error: str | None = None) -> None:
        """Finish ``seq`` from any state (abort, error) and free everything it holds at once."""
        children = self._attached.pop(seq.request_id, ())
        if seq.status is SequenceStatus.WAITING and seq not in self.waiting:   # attached to its child 0
            parent = next(rid for rid, c in self._attached.items() if seq in c)
            self._attached[parent].remove(seq)
            if not self._attached[parent]:
                del self._attached[parent]
        elif seq.status is SequenceStatus.RUNNING:
            del self.running[seq.request_id]
        else:
            (self.swapped if seq.status is SequenceStatus.SWAPPED else self.waiting).remove(seq)
        self.free(seq.request_id)
        for s in (seq, *children):            # attached children were never forked: they end with it
            del self._seqs[s.request_id]
            s.finish(reason, now, error)
            self.stats.num_finished += 1
            self.policy.ended(s)

    def check_integrity(self) -> None:
        """Every invariant of the module docstring (``integrity.check_scheduler``); tests call it."""
        integrity.check_scheduler(self, self._seqs, self._attached)


def _check_tokens(s: ScheduledSeq, sampled: Mapping[str, int], unfinished: Mapping[str, Sequence]) -> None:
    """A sampling row has a plain token id >= 0 for itself and each child it still forks."""
    for rid in (s.request_id, *s.forks) if s.sample else ():
        token = sampled.get(rid)
        if (type(token) is not int or token < 0) and (rid == s.request_id or rid in unfinished):
            _sampled_token(sampled, rid)         # raises, naming the request


def _sampled_token(sampled: Mapping[str, int], request_id: str) -> int:
    """The runner's token for ``request_id`` as a plain int, or ``InvalidArgument`` saying what is wrong."""
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


def _prompt_targets(seq: Sequence, start: int, n: int) -> tuple[int, ...]:
    """The prompt tokens that rows ``start .. start + n - 1`` score for prompt logprobs: row ``p``
    scores token ``p + 1`` while that is a prompt token. Empty unless the request asks for prompt
    logprobs and this chunk reaches rows it has not had yet (a recompute after preemption asks again
    only for rows past those, from the chunk's start: the engine keeps the first copy of each)."""
    if not seq.wants_prompt_rows:
        return ()
    end = min(start + n, seq.num_prompt_tokens - 1)       # rows past this one score generated tokens
    if end <= max(start, seq.num_prompt_logprobs):
        return ()
    return tuple(seq.prompt_token_ids[start + 1:end + 1])
