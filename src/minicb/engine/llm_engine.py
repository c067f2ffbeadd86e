"""The engine: the step loop that turns a scheduler's plans into tokens.

One step, every iteration (the heart of continuous batching)::

    plan    = scheduler.schedule()         # who runs, which tokens, which blocks (no torch)
    emit PlanEvent(plan, snapshot)         # listeners: metrics, traces, the live page, the tutorials
    sampled = runner.run(plan, params)     # swap, pack, forward, sample: the only tensor work
    done    = scheduler.update(plan, sampled)   # finished requests free their slot and blocks *now*
    emit StepEvent(plan, snapshots, times, outputs)

The engine talks to the scheduler through those two calls only, and to everything outside it
through its methods (``add_request``, ``abort_request``, ``step``, ``close_arrivals``) and its events
(``listen``; ``minicb.engine.events``): nothing outside the engine reads the scheduler, the slot table or the
block manager. Streaming is vLLM's shape: ``add_request`` queues, each ``step`` returns the outputs
that changed (new tokens, or finished). ``run(request_ids)`` steps until given requests finish and
keeps the outputs of any others for the next ``step`` (``LLM.generate`` is built on it).

If the model raises inside a step, the requests of that step end with ``finish_reason == "error"``
(their blocks and slots are freed by the scheduler) and the engine keeps serving the others. A
``KeyboardInterrupt`` inside a step does the same to that step's requests (their outputs come out of
the next ``step()``) and is then re-raised, so an interrupted engine is still consistent.

The engine is handed its runner (``minicb.engine.interface.Runner``) and never builds one, so this
module imports no torch: the same loop drives a model (``minicb.runtime.runner.engine_for(model,
config)`` makes both), rank 0 of a tensor-parallel group, and the simulator's clock. A runner that
breaks for good (``runner.failure``: a tensor-parallel rank died) makes every later ``step()`` raise
that failure; ``shutdown()`` ends every request and closes the runner.

The error contract (which argument, which range, which exception) is the table in ``docs/errors.md``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, as_int, check_float, check_int, describe
from minicb.core.plan import StepPlan
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler, SchedulerStats
from minicb.core.sequence import Sequence
from minicb.engine.events import Listeners, PlanEvent, StepEvent
from minicb.engine.interface import Runner
from minicb.engine.outputs import OutputTracker, RequestOutput

__all__ = ["LLMEngine", "RequestOutput"]

_GREEDY = SamplingParams()    # sampling for a row whose request was aborted after planning
_SHUT_DOWN = ("this engine was shut down (its runner is closed): create a new engine (or LLM) to serve more "
              "requests")


class LLMEngine:
    """Owns a scheduler and drives a runner; ``step()`` runs one iteration of the loop.

    ``runner`` does the tensor half of every step (``minicb.engine.interface.Runner``); its KV pool
    must have the shape ``config`` schedules. ``clock`` stamps arrivals, tokens and finishes."""

    def __init__(self, runner: Runner, config: SchedulerConfig, tokenizer=None, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.clock = clock
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.eos_token_id = runner.eos_token_id if tokenizer is None else tokenizer.eos_token_id
        self.last_plan: StepPlan | None = None
        self._live: dict[str, OutputTracker] = {}
        self._ids = itertools.count()
        self._listeners = Listeners()
        self._pending: list[RequestOutput] = []   # outputs not yet handed out by step()
        self._lock = threading.Lock()             # one step (or request change) at a time
        self._step_thread: int | None = None      # the thread running a step now
        self._deferred_aborts: deque[str] = deque()
        self._needs_reconcile = False
        self._closed = False                      # shutdown() was called

    # --- what the outside may read --------------------------------------------------------------
    @property
    def stats(self) -> SchedulerStats:
        """Running totals of the scheduler (steps, preemptions, tokens); a live object, read it."""
        return self.scheduler.stats

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._live)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._needs_reconcile

    def snapshot(self):
        """The scheduler's state now (``minicb.core.scheduler.SchedulerSnapshot``: immutable)."""
        return self.scheduler.snapshot()

    def listen(self, on_plan: Callable[[PlanEvent], None] | None = None,
               on_step: Callable[[StepEvent], None] | None = None) -> Callable[[], None]:
        """Call ``on_plan`` after every ``schedule()`` (before the tensor work) and ``on_step`` when the
        step is recorded; listeners run in the order they were added. Returns a function that removes
        them again. Listeners must not call back into ``step`` / ``run`` (``InvalidArgument``)."""
        return self._listeners.add(on_plan, on_step)

    # --- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        """Validate a prompt (text or token ids) and return its token ids."""
        vocab = self.runner.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument("prompt is text but the engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt, max_tokens=self.config.max_model_len)   # bounded first
            if ids and max(ids) >= vocab:
                raise InvalidArgument(f"prompt text encodes to token id {max(ids)}, outside the model's "
                                      f"vocabulary [0, {vocab - 1}]: the tokenizer does not match the model")
        elif isinstance(prompt, (list, tuple)):
            ids = [_token_id(t, i, vocab) for i, t in enumerate(prompt)]
        else:
            raise InvalidArgument(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidArgument("prompt must not be empty: it needs at least 1 token (it has 0)")
        return ids

    def make_sequence(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      arrival_time: float | None = None, priority: int = 0) -> Sequence:
        """A checked, not yet queued ``Sequence`` (raises what ``add_request`` would; changes nothing)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        rid = self.new_request_id() if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidArgument(f"request_id must be a non-empty str, got {rid!r}")
        priority = check_int("priority", priority)          # a plain int (numpy / torch ints too)
        now = self.clock() if arrival_time is None else check_float("arrival_time", arrival_time, finite=True)
        seq = Sequence(rid, self.tokenize(prompt), params, arrival_time=now, priority=priority,
                       eos_token_id=self.eos_token_id)
        self.scheduler.validate(seq)
        return seq

    def new_request_id(self, prefix: str = "") -> str:
        """A request id that no unfinished request uses (generated ids never collide with users')."""
        while True:
            rid = f"{prefix}{next(self._ids)}"
            if rid not in self._live:
                return rid

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Queue one request; a bad one raises here and leaves the engine and other requests untouched."""
        seq = self.make_sequence(prompt, params, request_id, arrival_time, priority)
        self._add(seq)
        return seq.request_id

    def _add(self, seq: Sequence) -> None:
        self._not_inside_a_step("add_request()")
        self._check_open()
        if seq.request_id in self._live:
            raise InvalidArgument(f"request_id {seq.request_id!r} is already in use")
        with self._lock:
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.runner.register(seq.request_id, seq.params)
        dec = self.tokenizer.incremental_decoder() if self.tokenizer is not None else None
        self._live[seq.request_id] = OutputTracker(seq, dec)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End ``request_id`` (any state) with ``finish_reason == "abort"`` and free what it holds;
        returns its final output, or None if it is not an unfinished request of this engine.

        Called from a step listener (in the middle of a step) the abort is applied when the step ends
        and its final output comes out of the next ``step()``; from another thread it waits for the
        running step to end."""
        if not isinstance(request_id, str):
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        if self._step_thread == threading.get_ident():
            self._deferred_aborts.append(request_id)
            return None
        with self._lock:
            return self._abort(request_id, deliver=False)

    def _abort(self, request_id: str, deliver: bool) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id, self.clock())
        if seq is None or request_id not in self._live:
            return None
        out = self._finish(request_id)
        if deliver:
            self._pending.append(out)
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, so that the next requests compute their prompts in full
        (vLLM's ``reset_prefix_cache``: for benchmarks that rerun the same prompts). Returns False and
        changes nothing while any request holds blocks."""
        self._not_inside_a_step("reset_prefix_cache()")
        with self._lock:
            return self.scheduler.reset_prefix_cache()

    def close_arrivals(self) -> None:
        """No more requests will come for now: the static policy may run a batch smaller than its slots."""
        self.scheduler.close_arrivals()

    def open_arrivals(self) -> None:
        self.scheduler.open_arrivals()

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests that got a token or finished."""
        self._not_inside_a_step("step() / run() / generate()")
        with self._lock:
            if self._closed and self._pending:    # the final outputs of requests ended by shutdown()
                outs, self._pending = self._pending, []
                return outs
            self._check_usable()
            self._step_thread = threading.get_ident()
            try:
                if self._needs_reconcile:
                    self._reconcile()
                outs = self._step()
            except BaseException:
                self._needs_reconcile = True       # an output may be half made: check at the next step
                raise
            finally:
                self._step_thread = None
                while self._deferred_aborts:       # aborts asked for by a listener of this step
                    self._abort(self._deferred_aborts.popleft(), deliver=True)
            self._check_usable()                   # the runner broke inside this step: say so now
            return outs

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(_SHUT_DOWN)

    def _check_usable(self) -> None:
        """Refuse to step a shut-down engine or one whose runner broke for good (``runner.failure``)."""
        if self._closed:
            raise InvalidArgument(_SHUT_DOWN)
        failure = self.runner.failure
        if failure is not None:
            raise failure.with_traceback(None)

    def shutdown(self) -> None:
        """End every unfinished request (``finish_reason == "abort"``) and close the runner (a
        tensor-parallel group's other ranks stop). The next ``step()`` hands out those final outputs;
        after that every ``step()`` / ``add_request()`` raises ``InvalidArgument``. Idempotent."""
        if not self._closed:
            self._closed = True
            for rid in list(self._live):
                out = self.abort_request(rid)
                if out is not None:
                    self._pending.append(out)
        self.runner.close()

    def _not_inside_a_step(self, what: str) -> None:
        if self._step_thread == threading.get_ident():
            raise InvalidArgument(f"{what} called from inside a step (an event listener): the engine "
                                  "runs one step at a time; call it after step() returns")

    def _reconcile(self) -> None:
        """After an interrupted step: hand out the final output of any request that finished but whose
        output was not made yet (the scheduler had recorded it when the interrupt landed)."""
        for rid, tracker in list(self._live.items()):
            if tracker.seq.is_finished:
                self._pending.append(self._finish(rid))
        self._needs_reconcile = False

    def _step(self) -> list[RequestOutput]:
        """One step as a transaction (DESIGN.md 2b): plan, compute, record, each phase all or nothing.

        * plan (``schedule`` and the PlanEvent listeners): nothing has touched a tensor yet, so an
          exception or Ctrl-C here restores the scheduler's checkpoint: the step never happened.
        * compute (``runner.run``: swaps, forward, sampling): KV blocks may be half written, so the
          step's requests end with ``finish_reason == "error"`` and the reason; everybody else is
          untouched (a victim swapped out by this plan falls back to recompute).
        * record (``update``): restored to the checkpoint and then failed the same way if it raises.
        Outputs go to ``_pending`` as they are made, so an interrupt never loses one: the next
        ``step()`` hands it out. A KeyboardInterrupt is re-raised after the engine is consistent.
        """
        sched = self.scheduler
        start = self.clock()
        cp = sched.checkpoint()
        try:
            plan = sched.schedule(start)
            before = self._listeners.emit_plan(plan, sched, start)
        except BaseException:
            sched.restore(cp)                      # the step never happened
            raise
        self.last_plan = plan
        error = None
        if not plan.is_empty:
            try:
                sampled = self.execute(plan)
            except BaseException as exc:           # Ctrl-C included: fail the step, stay consistent
                error = _describe(exc)
                self._pending += self._fail_step(plan, error)
                if not isinstance(exc, Exception):
                    raise
            else:
                error = self._record(plan, sampled)
        outs = list(self._pending)                 # stay pending until every step listener has seen them
        self._listeners.emit_step(plan, sched, before, start, self.clock(), outs, error)
        self._pending = []
        return outs

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """The tensor half of a step: the runner's ``run`` (whatever the runner is: a model, rank 0 of a
        tensor-parallel group, a simulated clock). A row whose request was aborted since planning is
        computed but samples with default params."""
        params = {}
        for s in plan.seqs:
            if s.sample:
                tracker = self._live.get(s.request_id)
                params[s.request_id] = tracker.seq.params if tracker is not None else _GREEDY
        return self.runner.run(plan, params)

    def _record(self, plan: StepPlan, sampled: dict[str, int]) -> str | None:
        """Record the step in the scheduler (all or nothing) and queue the outputs; returns an error."""
        cp = self.scheduler.checkpoint()
        try:
            finished = {s.request_id for s in self.scheduler.update(plan, sampled, self.clock())}
        except BaseException as exc:
            self.scheduler.restore(cp)
            error = _describe(exc)
            self._pending += self._fail_step(plan, error)
            if not isinstance(exc, Exception):
                raise
            return error
        for rid in list(sampled) + sorted(finished - sampled.keys()):
            tracker = self._live.get(rid)
            if tracker is not None:
                self._pending.append(self._finish(rid) if rid in finished else tracker.output())
        return None

    def _fail_step(self, plan: StepPlan, error: str) -> list[RequestOutput]:
        """The step's requests end with ``finish_reason == "error"``; their slots and blocks are freed."""
        failed = self.scheduler.fail_step(plan, error, self.clock())
        return [self._finish(s.request_id) for s in failed if s.request_id in self._live]

    def run(self, request_ids: Iterable[str] | None = None, progress=None) -> list[RequestOutput]:
        """Step until the given requests (default: all) have finished; return their final outputs in
        the order they finished. Outputs of other requests are kept for the next ``step()``."""
        wanted = None if request_ids is None else set(request_ids)
        done: list[RequestOutput] = []
        others: list[RequestOutput] = []
        try:
            while (self.has_unfinished_requests() if wanted is None
                   else any(r in self._live for r in wanted) or self._pending_has(wanted)):
                for out in self.step():
                    if wanted is not None and out.request_id not in wanted:
                        others.append(out)
                    elif out.finished:
                        done.append(out)
                        if progress is not None:
                            progress(out)
        finally:
            self._pending = others + self._pending
        return done

    def _pending_has(self, wanted: set[str]) -> bool:
        return any(o.request_id in wanted for o in self._pending)

    def run_until_done(self, progress=None) -> list[RequestOutput]:
        """Step until every request has finished; their final outputs in the order they finished."""
        return self.run(None, progress)

    # --- outputs --------------------------------------------------------------------------------
    def _finish(self, rid: str) -> RequestOutput:
        out = self._live[rid].output()              # made before it is forgotten: never lost
        del self._live[rid]
        self.runner.release(rid)
        return out


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _token_id(t, i: int, vocab: int) -> int:
    """A prompt token id as a plain int (numpy / torch integers welcome), checked against the vocabulary."""
    v = as_int(t)                 # bools and boolean tensors are not token ids
    if v is None or not 0 <= v < vocab:
        raise InvalidArgument(f"prompt token ids must be integers in [0, {vocab - 1}] (the vocabulary), "
                              f"got {describe(t)} at index {i}")
    return v
