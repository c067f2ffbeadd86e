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

Invariants (``check_integrity``, on top of the slot table's and block manager's): every unfinished
request is in exactly one of waiting / running / swapped / attached to its child 0; running ones hold
one slot and a device table, swapped ones a host table and no slot, waiting ones nothing (and
``num_computed_tokens == 0``);
``0 <= num_computed_tokens < num_tokens`` while unfinished; a block two tables share is never
written again: it is full for every holder, or it is the holder's partly filled last block and the
holder's next write copies it first. A step schedules at most ``max_num_seqs``
sequences and (continuous) at most ``max_num_batched_tokens`` tokens. This module imports no torch.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.continuous import ContinuousPolicy
from minicb.core.errors import InvalidArgument, RequestRejected
from minicb.core.padded import PaddedPolicy
from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.core.policy import Policy, StepWork
from minicb.core.preemption import drop_swapped
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
    _seqs: dict[str, Sequence] = field(init=False, repr=False)        # every unfinished request
    _waiting: deque[Sequence] = field(init=False, repr=False)
    _running: dict[str, Sequence] = field(init=False, repr=False)
    _swapped: deque[Sequence] = field(init=False, repr=False)
    _attached: dict[str, list[Sequence]] = field(init=False, repr=False)  # child 0 -> children to fork
    _policy: Policy = field(init=False, repr=False)                   # continuous or padded
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
        self._seqs, self._running, self._attached = {}, {}, {}
        self._waiting, self._swapped = deque(), deque()
        self._policy = ContinuousPolicy(self) if c.policy == "continuous" else PaddedPolicy(self)

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
            arrivals_open=self._arrivals_open, cached_blocks=bm.cached_blocks)

    # --- requests in -----------------------------------------------------------------------------
    def add(self, seq: Sequence, forks: list[Sequence] | tuple[Sequence, ...] = ()) -> None:
        """Validate ``seq`` and queue it (WAITING). ``forks``: the other children of a request with
        ``n > 1`` (same prompt, ``index`` 1 .. n - 1), forked from ``seq`` after its prompt (the
        module docstring). Raises before changing any state."""
        self.validate(seq, forks)
        for s in (seq, *forks):
            s.arrival_index, self._next_arrival = self._next_arrival, self._next_arrival + 1
            s.status = SequenceStatus.WAITING
            self._seqs[s.request_id] = s
        self._waiting.append(seq)
        if forks and self.config.policy == "continuous":
            self._attached[seq.request_id] = list(forks)
        else:                                   # the padded baselines: every child on its own
            self._waiting.extend(forks)

    def validate(self, seq: Sequence, forks: list[Sequence] | tuple[Sequence, ...] = ()) -> None:
        """Raise (``InvalidArgument``, or ``RequestRejected`` for a request that can never be served) if
        ``add(seq, forks)`` would; change nothing. ``LLM.generate`` calls it on every prompt first."""
        self._validate_one(seq)
        if 1 + len(forks) > self.config.max_n:
            raise RequestRejected(f"request {seq.request_id!r} asks for n={1 + len(forks)} parallel samples, "
                                  f"more than max_n={self.config.max_n}")
        ids = {seq.request_id}
        for child in forks:
            self._validate_one(child)
            if child.request_id in ids:
                raise InvalidArgument(f"request_id {child.request_id!r} is given twice")
            ids.add(child.request_id)
            if child.prompt_token_ids != seq.prompt_token_ids:
                raise InvalidArgument(
                    f"child {child.request_id!r} must have the prompt of {seq.request_id!r}")

    def _validate_one(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise InvalidArgument(f"seq must be a Sequence, got {type(seq).__name__}")
        rid = seq.request_id
        if not isinstance(rid, str):
            raise InvalidArgument(f"request_id must be a str, got {type(rid).__name__}")
        if rid in self._seqs or any(s.request_id == rid for s in self._policy.batch):
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
        """Plan one step (the policy chooses, see the module docstring); a plan without seqs means
        nothing to do now."""
        step = self.stats.num_steps
        self.stats.num_steps += 1
        return self._make_plan(step, self._policy.schedule(), now)

    def update(self, plan: StepPlan, sampled: Mapping[str, int], now: float) -> list[Sequence]:
        """Record a finished step: advance progress, append sampled tokens, retire finished requests.

        Rows whose request was aborted (or failed) since ``schedule`` are skipped.
        """
        live = [(s, self._running[s.request_id]) for s in plan.seqs if self._is_live(s)]
        tokens = {r: self._sampled_token(sampled, r) for s, _ in live if s.sample
                  for r in (s.request_id, *self._forking(s))}
        finished = []
        for s, seq in live:
            seq.num_computed_tokens += s.num_tokens
            if s.prompt_targets:
                seq.num_prompt_logprobs = max(seq.num_prompt_logprobs, s.start_pos + len(s.prompt_targets))
            self.stats.num_batched_tokens += s.num_tokens
            self._policy.computed(seq)
            if not s.sample:
                continue
            done = seq.append_token(tokens[s.request_id], now)
            if s.forks:                   # before child 0 may retire: the children take its blocks
                finished += self._fork(seq, self._forking(s), tokens, now)
            if done:
                self._retire(seq)
                finished.append(seq)
        self.stats.num_padding_tokens += plan.num_padding_tokens
        return finished

    def abort(self, request_id: str, now: float = 0.0) -> Sequence | None:
        """Finish ``request_id`` with ABORT from any state and free all it holds (None if unknown).
        A child 0 aborted before its fork takes its attached children with it."""
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
        children = [c for seq in failed for c in self._attached.get(seq.request_id, ())]
        for seq in failed:
            self._end(seq, FinishReason.ERROR, now, str(error))     # with its attached children
        failed += children
        for rid in plan.preempted:
            self._swapped_to_recompute(self._seqs.get(rid))
        return failed

    # --- helpers -----------------------------------------------------------------------------------
    def _make_plan(self, step: int, work: StepWork, now: float) -> StepPlan:
        """The policy's work (``{request_id: tokens granted}``, plus swaps, copies, preemptions) as a
        frozen ``StepPlan``: one row per granted request, in the order the policy granted them::

            work.scheduled = {"A": 1, "B": 5}     A decodes, B gets a 5-token chunk
            rows: A start_pos 9, 1 token, sample   B start_pos 0, 5 tokens, sample only if 5 ends it
        """
        seqs = tuple(self._scheduled_seq(self._seqs[rid], n, now) for rid, n in work.scheduled.items())
        return StepPlan(step=step, seqs=seqs, padding=tuple(work.padding), swap_out=tuple(work.swap_out),
                        swap_in=tuple(work.swap_in), preempted=tuple(work.preempted),
                        copy_blocks=tuple(work.copy_blocks.values()), block_size=self.config.block_size)

    def _scheduled_seq(self, seq: Sequence, n: int, now: float) -> ScheduledSeq:
        """The row of ``seq`` granted ``n`` tokens: they start where its computed tokens end
        (``start_pos = num_computed_tokens``), its block table covers them, and the row samples only
        when it reaches the sequence's last token (``start_pos + n == num_tokens``)."""
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        start = seq.num_computed_tokens
        table = tuple(self.block_manager.block_tables[seq.request_id])
        sample = start + n == seq.num_tokens
        forks = tuple(c.request_id for c in self._attached.get(seq.request_id, ())) if sample else ()
        return ScheduledSeq(request_id=seq.request_id, slot_id=seq.slot_id, start_pos=start,
                            token_ids=_token_slice(seq, start, n), block_table=table,
                            sample=sample, forks=forks, prompt_targets=_prompt_targets(seq, start, n))

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

    def _forking(self, s: ScheduledSeq) -> list[str]:
        """The children the row ``s`` forks that are still attached (one may be aborted since)."""
        attached = {c.request_id for c in self._attached.get(s.request_id, ())}
        return [r for r in s.forks if r in attached]

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
            if child.append_token(tokens[child.request_id], now):
                del self._seqs[child.request_id]
                self.stats.num_finished += 1
                finished.append(child)
            elif self.slot_table.num_free:
                self.block_manager.fork(parent.request_id, child.request_id)
                child.num_computed_tokens = parent.num_computed_tokens
                child.num_cached_tokens = parent.num_cached_tokens
                self._policy.start_running(child)
            else:
                queued.append(child)
        self._waiting.extendleft(reversed(queued))      # in index order, ahead of later arrivals
        return finished

    def _retire(self, seq: Sequence) -> None:
        """``seq`` just finished normally: forget it; the policy frees its slot and blocks now
        (continuous) or once the whole padded batch is done."""
        del self._running[seq.request_id]
        del self._seqs[seq.request_id]
        self.stats.num_finished += 1
        self._policy.finished(seq)

    def _end(self, seq: Sequence, reason: FinishReason, now: float, error: str | None = None) -> None:
        """Finish ``seq`` from any state (abort, error) and free everything it holds at once."""
        children = self._attached.pop(seq.request_id, ())
        self._unqueue(seq)
        self._free(seq.request_id)
        for s in (seq, *children):            # attached children were never forked: they end with it
            del self._seqs[s.request_id]
            s.finish(reason, now, error)
            self.stats.num_finished += 1
            self._policy.ended(s)

    def _unqueue(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING and seq not in self._waiting:   # attached to its child 0
            parent = next(rid for rid, c in self._attached.items() if seq in c)
            self._attached[parent].remove(seq)
            if not self._attached[parent]:
                del self._attached[parent]
        elif seq.status is SequenceStatus.RUNNING:
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
        attached = [c for children in self._attached.values() for c in children]
        ids = [s.request_id for s in waiting + swapped + running + attached]
        assert len(ids) == len(set(ids)) and set(ids) == set(self._seqs), \
            "every unfinished request must be in exactly one of waiting / swapped / running / attached"
        for seq in waiting + attached:
            self._check_waiting(seq)
        self._check_attached()
        for seq in swapped:
            self._check_swapped(seq)
        for seq in running:
            self._check_running(seq)
        self._check_holders(running)
        self._check_shared_blocks(running)
        self._policy.check_integrity()

    def _check_waiting(self, seq: Sequence) -> None:
        bm = self.block_manager
        assert seq.status is SequenceStatus.WAITING and seq.slot_id is None, seq.request_id
        assert seq.num_computed_tokens == 0, f"{seq.request_id} waits with computed tokens"
        assert seq.num_cached_tokens == 0, f"{seq.request_id} waits with cached tokens"
        assert seq.request_id not in bm.block_tables and not bm.is_swapped(seq.request_id), seq.request_id

    def _check_attached(self) -> None:
        """Attached children wait on an unfinished child 0 that has sampled nothing yet, with its prompt."""
        for rid, children in self._attached.items():
            parent = self._seqs.get(rid)
            assert parent is not None and not parent.output_token_ids, \
                f"{rid}: children still attached after the fork"
            assert self.config.policy == "continuous", "the padded policies never fork"
            for c in children:
                assert not c.output_token_ids and c.prompt_token_ids == parent.prompt_token_ids, c.request_id

    def _check_shared_blocks(self, running: list[Sequence]) -> None:
        """Copy-on-write leaves no block written by two sequences: a block that several tables name is,
        for each of its holders, either full of computed K/V or the holder's partly filled last block,
        which the holder copies before it writes (``BlockManager.needs_copy``)."""
        bm, bs = self.block_manager, self.block_manager.block_size
        for seq in running:
            table = bm.block_tables[seq.request_id]
            for i, block in enumerate(table):
                if bm.device.ref_counts[block] > 1 and (i + 1) * bs > seq.num_computed_tokens:
                    assert i == len(table) - 1 and i * bs <= seq.num_computed_tokens, \
                        f"{seq.request_id}: shared block {block} (ref {bm.device.ref_counts[block]}) " \
                        "would be written without a copy"

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
        holders = {s.request_id for s in running} | {s.request_id for s in self._policy.batch}
        assert set(self.slot_table.held().values()) == holders, "slot holders != running requests"
        assert set(self.block_manager.block_tables) == holders, "device tables != running requests"
        assert set(self.block_manager.host_tables) == {s.request_id for s in self._swapped}
        assert len(holders) <= self.config.max_num_seqs


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


def _token_slice(seq: Sequence, start: int, n: int) -> tuple[int, ...]:
    """``seq.all_token_ids[start:start + n]`` without concatenating the whole prompt every step."""
    prompt, out = seq.prompt_token_ids, seq.output_token_ids
    p = len(prompt)
    if start + n <= p:
        return tuple(prompt[start:start + n])
    if start >= p:
        return tuple(out[start - p:start - p + n])
    return tuple(prompt[start:]) + tuple(out[:start + n - p])
