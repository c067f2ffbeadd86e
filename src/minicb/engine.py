"""The engine: the step loop that turns a scheduler's plans into tokens.

One step, every iteration (the heart of continuous batching)::

    plan    = scheduler.schedule()         # who runs, which tokens, which blocks (no torch)
    emit PlanEvent(plan, snapshot)         # listeners: metrics, traces, the live page, the tutorials
    sampled = runner.run(plan, params)     # swap, pack, forward, sample: the only tensor work
    done    = scheduler.update(plan, sampled)   # finished requests free their slot and blocks *now*
    emit StepEvent(plan, snapshots, times, outputs)

The engine talks to the scheduler through those two calls only, and to everything outside it
through its methods (``add_request``, ``abort_request``, ``step``, ``close_arrivals``) and its events
(``listen``; ``minicb.events``): nothing outside the engine reads the scheduler, the slot table or the
block manager. Streaming is vLLM's shape: ``add_request`` queues, each ``step`` returns the outputs
that changed (new tokens, or finished). ``run(request_ids)`` steps until given requests finish and
keeps the outputs of any others for the next ``step`` (``LLM.generate`` is built on it).

If the model raises inside a step, the requests of that step end with ``finish_reason == "error"``
(their blocks and slots are freed by the scheduler) and the engine keeps serving the others. A
``KeyboardInterrupt`` inside a step does the same to that step's requests (their outputs come out of
the next ``step()``) and is then re-raised, so an interrupted engine is still consistent.

The error contract (which argument, which range, which exception) is the table in ``docs/errors.md``.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Iterable

from minicb.config import SchedulerConfig
from minicb.errors import InvalidArgument, check_int
from minicb.events import Listeners, PlanEvent, StepEvent
from minicb.model.llama import LlamaForCausalLM
from minicb.outputs import OutputTracker, RequestOutput
from minicb.plan import StepPlan
from minicb.runner import ModelRunner
from minicb.sampling_params import SamplingParams
from minicb.scheduler import Scheduler, SchedulerStats
from minicb.sequence import Sequence

__all__ = ["LLMEngine", "RequestOutput"]


class LLMEngine:
    """Owns a scheduler and a model runner; ``step()`` runs one iteration of the loop."""

    def __init__(self, model: LlamaForCausalLM, config: SchedulerConfig, tokenizer=None,
                 seed: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 attn_backend: str = "auto", runner: ModelRunner | None = None) -> None:
        if seed is not None:
            check_int("seed", seed, lo=0, hi=2**63 - 1)
        self.config = config
        self.tokenizer = tokenizer
        self.clock = clock
        self.runner = runner or ModelRunner(model, num_blocks=config.num_blocks,
                                            block_size=config.block_size,
                                            num_host_blocks=config.num_host_blocks,
                                            attn_backend=attn_backend, seed=seed)
        self.scheduler = Scheduler(config)
        cfg = model.config
        self.eos_token_id = cfg.eos_token_id if tokenizer is None else tokenizer.eos_token_id
        self.last_plan: StepPlan | None = None
        self._live: dict[str, OutputTracker] = {}
        self._ids = itertools.count()
        self._listeners = Listeners()
        self._pending: list[RequestOutput] = []   # outputs not yet handed out by step()
        self._in_step = False

    # --- what the outside may read --------------------------------------------------------------
    @property
    def model(self) -> LlamaForCausalLM:
        return self.runner.model

    @property
    def stats(self) -> SchedulerStats:
        """Running totals of the scheduler (steps, preemptions, tokens); a live object, read it."""
        return self.scheduler.stats

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._live)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def snapshot(self):
        """The scheduler's state now (``minicb.scheduler.SchedulerSnapshot``: immutable)."""
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
        vocab = self.model.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument("prompt is text but the engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
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
        check_int("priority", priority)
        now = self.clock() if arrival_time is None else arrival_time
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
        if seq.request_id in self._live:
            raise InvalidArgument(f"request_id {seq.request_id!r} is already in use")
        self.scheduler.add(seq)
        self.runner.sampler.register(seq.request_id, seq.params)
        dec = self.tokenizer.incremental_decoder() if self.tokenizer is not None else None
        self._live[seq.request_id] = OutputTracker(seq, dec)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End ``request_id`` (any state) with ``finish_reason == "abort"`` and free what it holds;
        returns its final output, or None if it is not an unfinished request of this engine."""
        if not isinstance(request_id, str):
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        seq = self.scheduler.abort(request_id, self.clock())
        if seq is None or request_id not in self._live:
            return None
        return self._finish(request_id)

    def close_arrivals(self) -> None:
        """No more requests will come for now: the static policy may run a batch smaller than its slots."""
        self.scheduler.close_arrivals()

    def open_arrivals(self) -> None:
        self.scheduler.open_arrivals()

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests that got a token or finished."""
        if self._in_step:
            raise InvalidArgument("step() / run() / generate() called from inside a step (an event "
                                  "listener): the engine runs one step at a time")
        self._in_step = True
        try:
            return self._step()
        finally:
            self._in_step = False

    def _step(self) -> list[RequestOutput]:
        outs, self._pending = self._pending, []
        start = self.clock()
        plan = self.scheduler.schedule(start)
        self.last_plan = plan
        before = self._listeners.emit_plan(plan, self.scheduler, start)
        if plan.is_empty:
            self._listeners.emit_step(plan, self.scheduler, before, start, self.clock(), outs, None)
            return outs
        error = None
        try:
            sampled = self.execute(plan)
        except Exception as exc:   # noqa: BLE001 - a failed step must not take the engine down
            error = _describe(exc)
            outs += self._fail_step(plan, error)
        except BaseException as exc:   # Ctrl-C: end this step's requests so the engine stays consistent
            self._pending = outs + self._fail_step(plan, _describe(exc))
            raise
        else:
            outs += self._record(plan, sampled)
        self._listeners.emit_step(plan, self.scheduler, before, start, self.clock(), outs, error)
        return outs

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """The tensor half of a step: the runner's ``run`` (tensor-parallel rank 0 shares the plan first)."""
        return self.runner.run(plan, {s.request_id: self._live[s.request_id].seq.params
                                      for s in plan.seqs if s.sample})

    def _record(self, plan: StepPlan, sampled: dict[str, int]) -> list[RequestOutput]:
        finished = {s.request_id for s in self.scheduler.update(plan, sampled, self.clock())}
        outs = []
        for rid in sampled:
            if rid in self._live:
                outs.append(self._finish(rid) if rid in finished else self._live[rid].output())
        for rid in finished - sampled.keys():
            if rid in self._live:
                outs.append(self._finish(rid))
        return outs

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
        tracker = self._live.pop(rid)
        self.runner.sampler.release(rid)
        return tracker.output()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _token_id(t, i: int, vocab: int) -> int:
    """A prompt token id as a plain int (numpy / torch integers welcome), checked against the vocabulary."""
    try:
        v = None if isinstance(t, bool) else operator.index(t)
    except TypeError:
        v = None
    if v is None or not 0 <= v < vocab:
        raise InvalidArgument(f"prompt token ids must be integers in [0, {vocab - 1}] (the vocabulary), "
                              f"got {t!r} at index {i}")
    return v
