"""Step events: how everything outside the engine watches it work.

Every step the engine publishes two events, each carrying immutable values only::

    PlanEvent(plan, state, time)                      after schedule(), before the tensor work
    StepEvent(plan, state, after, start, end,         when the step is recorded (tokens appended,
              outputs, error)                         finished requests gone), or failed

``state`` / ``after`` are ``SchedulerSnapshot``s (which request holds which slot, the block tables, the
free and cached blocks, the waiting / running / swapped queues), copied when the event is made, so a
listener may keep them as long as it likes and never sees them change. Metrics (``StepRecorder``),
slot traces (``TraceRecorder``), the tutorials, the server's live page and the docs' replay are all
listeners; none of them reaches into the scheduler.

Snapshots cost a little (they copy the queues), so the engine makes them only while somebody listens.
A ``PlanEvent`` listener runs between planning and computing: the tutorials use that moment to move a
simulated clock forward, so the step "takes" a chosen time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minicb.core.plan import StepPlan
from minicb.core.scheduler import Scheduler, SchedulerSnapshot


@dataclass(slots=True, frozen=True)
class PlanEvent:
    """A step has been planned and is about to run."""

    plan: StepPlan
    state: SchedulerSnapshot      # right after schedule(): the step's slots, blocks and queues
    time: float                   # the engine's clock when the step was planned


@dataclass(slots=True, frozen=True)
class StepEvent:
    """A step has ended: its tokens are recorded (or, with ``error``, its requests failed)."""

    plan: StepPlan
    state: SchedulerSnapshot      # as planned (the same values as the PlanEvent's)
    after: SchedulerSnapshot      # after the step: finished requests have left their slots
    start: float
    end: float
    outputs: tuple                # the RequestOutputs this step returns
    error: str | None = None      # the step failed and its requests ended with this reason

    @property
    def duration(self) -> float:
        return self.end - self.start


PlanListener = Callable[[PlanEvent], None]
StepListener = Callable[[StepEvent], None]


class Listeners:
    """The engine's subscribers, called in the order they were added."""

    def __init__(self) -> None:
        self._plan: list[PlanListener] = []
        self._step: list[StepListener] = []
        self.active = False           # anybody listening (the engine asks before taking snapshots)

    def add(self, on_plan: PlanListener | None = None,
            on_step: StepListener | None = None) -> Callable[[], None]:
        for fn in (on_plan, on_step):
            if fn is not None and not callable(fn):
                raise TypeError(f"listeners must be callable, got {type(fn).__name__}")
        if on_plan is not None:
            self._plan.append(on_plan)
        if on_step is not None:
            self._step.append(on_step)
        self.active = bool(self._plan or self._step)

        def remove() -> None:
            if on_plan is not None and on_plan in self._plan:
                self._plan.remove(on_plan)
            if on_step is not None and on_step in self._step:
                self._step.remove(on_step)
            self.active = bool(self._plan or self._step)

        return remove

    def __bool__(self) -> bool:
        return bool(self._plan or self._step)

    def emit_plan(self, plan: StepPlan, scheduler: Scheduler, now: float) -> SchedulerSnapshot | None:
        """Publish a PlanEvent; returns the snapshot taken (None when nobody listens)."""
        if not self:
            return None
        state = scheduler.snapshot()
        if self._plan:
            event = PlanEvent(plan, state, now)
            for fn in list(self._plan):
                fn(event)
        return state

    def emit_step(self, plan: StepPlan, scheduler: Scheduler, state: SchedulerSnapshot | None,
                  start: float, end: float, outputs: list, error: str | None) -> None:
        if not self._step or state is None:
            return
        event = StepEvent(plan, state, scheduler.snapshot(), start, end, tuple(outputs), error)
        for fn in list(self._step):
            fn(event)
