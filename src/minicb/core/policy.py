"""A scheduling policy: how the batch of one step is chosen.

The scheduler (``scheduler.py``) owns the requests: it queues them (``add``), records each step
(``update``), ends them early (``abort``, ``fail_step``) and checks its invariants. What it runs each
step is the policy's choice; two policies implement the interface below, the columns of the benchmark
table::

    ContinuousPolicy  (continuous.py)  the batch is rebuilt every step (iteration-level scheduling)
    PaddedPolicy      (padded.py)      dynamic / static: a batch is formed, padded to its longest
                                       member, run until every member is done, then released

The scheduler calls ``schedule()`` once a step and tells the policy what happened to its requests:
``finished(seq)`` when ``seq`` ended normally (it has left the queues), ``ended(seq)`` when it was
aborted or failed (its slot and blocks are already freed). The queues (``waiting``, ``running``,
``swapped``) are the scheduler's, and only the scheduler writes them: a policy reads them and asks
the scheduler to move a request (``admit``, ``resume``, ``preempt``, ``free``), so each queue has
one writer (``tests/test_architecture.py`` checks it). This module imports no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.sequence import Sequence
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
    """The interface of a scheduling policy. ``sched`` is the ``Scheduler`` that owns the requests.

    The policy *reads* the scheduler's state through the names below (the same objects, never
    copies) and *changes* it only through the scheduler's moves (``admit``, ``resume``, ``preempt``,
    ``free``): the queues have one writer, the scheduler."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.slots: SlotTable = sched.slot_table
        self.blocks: BlockManager = sched.block_manager
        self.stats: SchedulerStats = sched.stats
        self.waiting: deque[Sequence] = sched.waiting          # read only: the scheduler writes them
        self.running: dict[str, Sequence] = sched.running
        self.swapped: deque[Sequence] = sched.swapped
        # requests that hold a slot and blocks without running: a padded batch's finished members
        # (a continuous policy frees a request when it ends, so this stays empty)
        self.batch: list[Sequence] = []

    @property
    def config(self) -> SchedulerConfig:
        """The scheduler's configuration (read through it: it is the scheduler's)."""
        return self.sched.config

    def schedule(self) -> StepWork:
        """Choose this step's rows (and swaps, preemptions) from the queues."""
        raise NotImplementedError

    def finished(self, seq: Sequence) -> None:
        """``seq`` finished normally in ``update`` and has left the queues; free what it holds (or not)."""

    def ended(self, seq: Sequence) -> None:
        """``seq`` was aborted or failed; its slot and blocks are already freed."""

    def check_integrity(self) -> None:
        """The policy's own invariants, on top of the scheduler's."""
