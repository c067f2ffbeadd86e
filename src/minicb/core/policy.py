"""A scheduling policy: how the batch of one step is chosen.

The scheduler (``scheduler.py``) owns the requests: it queues them (``add``), records each step
(``update``), ends them early (``abort``, ``fail_step``) and checks its invariants. What it runs each
step is the policy's choice; two policies implement the interface below, the columns of the benchmark
table::

    ContinuousPolicy  (continuous.py)  the batch is rebuilt every step (iteration-level scheduling)
    PaddedPolicy      (padded.py)      dynamic / static: a batch is formed, padded to its longest
                                       member, run until every member is done, then released

The scheduler calls ``schedule()`` once a step and tells the policy what happened to its requests:
``computed(seq)`` after a step computed tokens of ``seq``, ``finished(seq)`` when ``seq`` ended
normally (it has left the queues), ``ended(seq)`` when it was aborted or failed (its slot and blocks
are already freed). A policy reads the queues through its scheduler (``waiting``, ``running``,
``swapped`` below): they are the scheduler's, since adding, aborting and recording change them too.
This module imports no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.sequence import Sequence, SequenceStatus
from minicb.core.slot_table import SlotTable
from minicb.core.stats import SchedulerStats


@dataclass(slots=True)
class StepWork:
    """What one ``schedule()`` call decided, before the scheduler freezes it into a ``StepPlan``."""

    scheduled: dict[str, int] = field(default_factory=dict)      # request_id -> num_tokens, in order
    padding: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    copy_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)   # request_id -> (src, dst)


class Policy:
    """The interface of a scheduling policy, and the steps both policies share (admission counting,
    starting a request). ``sched`` is the ``Scheduler`` that owns the requests."""

    def __init__(self, sched) -> None:
        self.sched = sched
        # requests that hold a slot and blocks without running: a padded batch's finished members
        # (a continuous policy frees a request when it ends, so this stays empty)
        self.batch: list[Sequence] = []

    # --- what a policy implements ---------------------------------------------------------------
    def schedule(self) -> StepWork:
        """Choose this step's rows (and swaps, preemptions) from the queues."""
        raise NotImplementedError

    def computed(self, seq: Sequence) -> None:
        """A recorded step computed some of ``seq``'s tokens."""

    def finished(self, seq: Sequence) -> None:
        """``seq`` finished normally in ``update`` and has left the queues; free what it holds (or not)."""

    def ended(self, seq: Sequence) -> None:
        """``seq`` was aborted or failed; its slot and blocks are already freed."""

    def check_integrity(self) -> None:
        """The policy's own invariants, on top of the scheduler's."""

    # --- the scheduler's state, read through it ---------------------------------------------------
    @property
    def config(self) -> SchedulerConfig:
        return self.sched.config

    @property
    def slots(self) -> SlotTable:
        return self.sched.slot_table

    @property
    def blocks(self) -> BlockManager:
        return self.sched.block_manager

    @property
    def stats(self) -> SchedulerStats:
        return self.sched.stats

    @property
    def waiting(self) -> deque[Sequence]:
        return self.sched._waiting

    @property
    def running(self) -> dict[str, Sequence]:
        return self.sched._running

    @property
    def swapped(self) -> deque[Sequence]:
        return self.sched._swapped

    @property
    def num_arrivals(self) -> int:
        """Requests added so far (priority aging measures waiting in arrivals)."""
        return self.sched._next_arrival

    # --- steps both policies take ---------------------------------------------------------------
    def start_running(self, seq: Sequence) -> None:
        """``seq`` (just admitted or swapped in, its blocks allocated) takes a slot and runs."""
        s = self.sched
        seq.slot_id = s.slot_table.assign(seq.request_id)
        seq.status = SequenceStatus.RUNNING
        seq.admitted_index, s._next_admission = s._next_admission, s._next_admission + 1
        s._running[seq.request_id] = seq

    def free(self, request_id: str) -> None:
        """Release the request's slot (if it holds one) and every block it holds."""
        self.sched._free(request_id)

    def count_admission(self, seq: Sequence, num_cached: int) -> None:
        """Count ``seq``'s admission with ``num_cached`` tokens served from the prefix cache."""
        st = self.stats
        if seq.admitted_index < 0:                # its first admission
            st.num_prompt_tokens += seq.num_prompt_tokens
            st.num_cached_prompt_tokens += num_cached
        else:                                     # back after recompute preemption
            st.num_cached_reprefill_tokens += num_cached
