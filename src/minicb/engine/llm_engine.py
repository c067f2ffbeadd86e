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

What can go wrong, and what happens then (the consistency contract, ``docs/errors.md``):

* the tensor work raises (``runner.run``, or a plan listener): that step's requests end with
  ``finish_reason == "error"`` and the reason; everybody else is served on;
* one request's row fails alone (``RowOutput.error``: its logits are not finite, its grammar's
  matcher broke): that request ends with ``finish_reason == "error"`` and the message, the step's
  other requests are recorded as usual;
* Ctrl-C: the bookkeeping (planning, recording, finishing, aborting) runs with it *deferred*
  (``engine.interrupts``), so it lands inside the forward (the step's requests fail as above) or at
  the step boundary (nobody is harmed), never half way through moving a request;
* the bookkeeping itself raises: that is a bug, and nobody can vouch for the state it left. The
  engine ends every request with ``finish_reason == "error"`` and the reason, hands those outputs
  out, and is dead from then on (``EngineDeadError``, as in vLLM V1);
* an output is made all or nothing (``outputs.OutputTracker``), so whatever fails, the tokens a
  request streamed concatenate to its final ``token_ids`` and its text is their decode.

**Parallel sampling** (``SamplingParams.n > 1``): ``add_request`` makes ``n`` sequences, child ``i``
with id ``f"{i}_{request_id}"`` (vLLM V1's naming; a request with ``n == 1`` keeps its own id) and
``params.child_params(i)`` (seed ``s + i``), each registered with the runner (its own generator);
the scheduler forks them after the prompt. Outputs are per request: ``RequestOutput.outputs`` has a
``CompletionOutput`` per child, ``finished`` once the last child has. ``abort_request`` ends every
child. ``n`` above ``SchedulerConfig.max_n`` is refused (``RequestRejected``) before anything is made.

The engine is handed its runner (``minicb.engine.interface.Runner``) and never builds one, so this
module imports no torch: the same loop drives a model (``minicb.runtime.runner.engine_for(model,
config)`` makes both), rank 0 of a tensor-parallel group, and the simulator's clock. A runner that
breaks for good (``runner.failure``: a tensor-parallel rank died) makes that step and every later
one raise its failure; ``shutdown()`` ends every request and closes the runner.

The error contract (which argument, which range, which exception) is the table in ``docs/errors.md``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from minicb.core.config import SchedulerConfig
from minicb.core.errors import (
    EngineDeadError,
    InvalidArgument,
    MinicbError,
    RequestRejected,
    check_int,
)
from minicb.core.plan import StepPlan
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler, SchedulerStats
from minicb.core.sequence import FinishReason, Sequence
from minicb.engine import inputs
from minicb.engine.events import Listeners, PlanEvent, StepEvent
from minicb.engine.interface import Runner
from minicb.engine.interrupts import DeferredInterrupts
from minicb.engine.logprobs import PromptLogprobs, RowOutput, token_of
from minicb.engine.outputs import CompletionOutput, OutputTracker, RequestOutput, RequestTracker

__all__ = ["CompletionOutput", "LLMEngine", "RequestOutput", "child_id"]

log = logging.getLogger("minicb.engine")
_GREEDY = SamplingParams()    # sampling for a row whose request was aborted after planning
_SHUT_DOWN = ("this engine was shut down (its runner is closed): create a new engine (or LLM) to serve more "
              "requests")


def child_id(request_id: str, index: int, n: int) -> str:
    """The id of child ``index`` of a request with ``n`` children: the request's own id when ``n == 1``,
    else ``f"{index}_{request_id}"`` (vLLM V1's naming)."""
    return request_id if n == 1 else f"{index}_{request_id}"


class LLMEngine:
    """Owns a scheduler and drives a runner; ``step()`` runs one iteration of the loop.

    ``runner`` does the tensor half of every step (``minicb.engine.interface.Runner``); its KV pool
    must have the shape ``config`` schedules. ``clock`` stamps arrivals, tokens and finishes."""

    def __init__(self, runner: Runner, config: SchedulerConfig, tokenizer=None, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # make each output's text (the tokenizer's incremental decoder, on the stepping thread); a
        # caller that decodes elsewhere (``minicb serve``: its event loop) turns it off before adding
        # requests, and outputs then carry token ids only (``text == ""``)
        self.detokenize = True
        self.clock = clock
        self.runner = runner
        self.scheduler = Scheduler(config)
        self.eos_token_id = runner.eos_token_id if tokenizer is None else tokenizer.eos_token_id
        self.last_plan: StepPlan | None = None
        self._live: dict[str, RequestTracker] = {}     # by request id
        self._owner: dict[str, str] = {}                # sequence id (a child's) -> request id
        self._ids = itertools.count()
        self._listeners = Listeners()
        self._pending: list[RequestOutput] = []   # outputs not yet handed out by step()
        self._lock = threading.Lock()             # one step (or request change) at a time
        self._step_thread: int | None = None      # the thread running a step now
        self._aborts_waiting = 0                  # other threads' aborts waiting for the running step
        self._turn = threading.Condition()        # ... which go before the next step (step() waits)
        self._deferred_aborts: deque[tuple[str, int | None]] = deque()   # (request id, child index)
        self._ready: list[RequestOutput] = []     # seen by the step listeners, not yet returned
        self.dead: str | None = None              # why the engine died (EngineDeadError), or None
        self._closed = False                      # shutdown() was called
        self._token_texts: dict[int, str] = {}    # token id -> its text alone (logprobs' decoded_token)

    # --- what the outside may read --------------------------------------------------------------
    @property
    def stats(self) -> SchedulerStats:
        """Running totals of the scheduler (steps, preemptions, tokens); a live object, read it."""
        return self.scheduler.stats

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._live)

    def has_unfinished_requests(self) -> bool:
        if self.dead is not None:
            return bool(self._pending or self._ready)     # the final outputs still to hand out
        return self.scheduler.has_unfinished() or bool(self._pending or self._ready)

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
        """Validate a prompt (text or token ids) and return its token ids (``engine.inputs``)."""
        return inputs.prompt_token_ids(prompt, self.tokenizer, self.runner.vocab_size,
                                       self.config.max_model_len)

    def make_sequence(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      arrival_time: float | None = None, priority: int = 0) -> Sequence:
        """A checked, not yet queued ``Sequence`` (raises what ``add_request`` would; changes nothing).
        With ``params.n > 1`` it is child 0, and all ``n`` children were checked."""
        return self._make_sequences(prompt, params, request_id, arrival_time, priority)[0]

    def _make_sequences(self, prompt, params, request_id, arrival_time, priority) -> list[Sequence]:
        """The request's ``n`` checked, not yet queued sequences (module docstring)."""
        params = inputs.checked_params(params)
        inputs.check_params_fit(params, self.runner.vocab_size, self.tokenizer)
        rid = inputs.checked_request_id(self.new_request_id() if request_id is None else request_id)
        priority = inputs.checked_priority(priority)
        now = self.clock() if arrival_time is None else inputs.checked_arrival_time(arrival_time)
        if params.n > self.config.max_n:
            raise RequestRejected(f"request {rid!r} asks for n={params.n} parallel samples, more than "
                                  f"max_n={self.config.max_n}")
        ids = self.tokenize(prompt)
        inputs.check_logprob_cost(params, len(ids), self.config.max_logprob_entries)
        seqs = [Sequence(child_id(rid, i, params.n), list(ids), params.child_params(i), arrival_time=now,
                         priority=priority, eos_token_id=self.eos_token_id, index=i)
                for i in range(params.n)]
        self.scheduler.validate(seqs[0], seqs[1:])
        return seqs

    def new_request_id(self, prefix: str = "") -> str:
        """A request id that no unfinished request uses (generated ids never collide with users')."""
        while True:
            rid = f"{prefix}{next(self._ids)}"
            if rid not in self._live:
                return rid

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Queue one request; a bad one raises here and leaves the engine and other requests untouched."""
        rid = request_id if request_id is not None else self.new_request_id()
        seqs = self._make_sequences(prompt, params, rid, arrival_time, priority)
        self._add(rid, seqs)
        return rid

    def _add(self, request_id: str, seqs: list[Sequence]) -> None:
        self._not_inside_a_step("add_request()")
        if request_id in self._live:
            raise InvalidArgument(f"request_id {request_id!r} is already in use")
        with self._lock, self._bookkeeping():
            self._check_alive()
            self._check_open()
            self._enqueue(request_id, seqs)

    def _enqueue(self, request_id: str, seqs: list[Sequence]) -> None:
        # the runner first (each child: its own generator and logits processors): what it cannot build
        # for the request (a bad grammar) raises before the scheduler holds anything of it
        registered = []
        try:
            for seq in seqs:
                self.runner.register(seq.request_id, seq.params, seq.prompt_token_ids,
                                     eos_token_id=seq.eos_token_id, tokenizer=self.tokenizer)
                registered.append(seq.request_id)
            self.scheduler.add(seqs[0], seqs[1:])
        except BaseException:
            for sid in registered:
                self.runner.release(sid)
            raise
        tok = self.tokenizer if self.detokenize else None
        children = []
        for seq in seqs:
            skip = seq.params.skip_special_tokens
            dec = tok.incremental_decoder(skip) if tok is not None else None
            decode = functools.partial(tok.decode, skip_special_tokens=skip) if tok is not None else None
            child = OutputTracker(seq, dec, decode)
            if seq.params.logprobs is not None:
                child.logprobs = []
            if seq.params.prompt_logprobs is not None and seq is seqs[0]:   # child 0 prefills for all
                child.prompt = PromptLogprobs()
            children.append(child)
            self._owner[seq.request_id] = request_id
        self._live[request_id] = RequestTracker(request_id, children)

    def abort_request(self, request_id: str, index: int | None = None) -> RequestOutput | None:
        """End ``request_id`` (any state) with ``finish_reason == "abort"`` and free what it holds;
        returns its final output, or None if it is not an unfinished request of this engine.

        ``index`` ends only that child of a request with ``n > 1`` (a stop string it produced, say)
        and returns the request's output now, final if it was the last child. Child 0 before its
        prompt is done takes the children still waiting for the fork with it (they have nothing yet).

        Called from a step listener (in the middle of a step) the abort is applied when the step ends
        and its final output comes out of the next ``step()``; from another thread it waits for the
        running step to end, and goes before the next one (a loop calling ``step()`` cannot starve it:
        Python's lock is not fair, so ``step()`` waits for the aborts already waiting)."""
        if not isinstance(request_id, str):
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        if index is not None:
            index = check_int("index", index, lo=0)
        if self._step_thread == threading.get_ident():
            self._deferred_aborts.append((request_id, index))
            return None
        out = None
        with self._turn:
            self._aborts_waiting += 1
        try:
            with self._lock:
                try:
                    with self._bookkeeping():
                        out = self._abort(request_id, deliver=False, index=index)
                except KeyboardInterrupt:     # a Ctrl-C deferred to the end of the abort, which is done:
                    if out is not None:       # its output comes out of the next step()
                        self._ready.append(out)
                    raise
        finally:
            with self._turn:
                self._aborts_waiting -= 1
                self._turn.notify_all()
        return out

    def _abort(self, request_id: str, deliver: bool, index: int | None = None) -> RequestOutput | None:
        if self.dead is not None or request_id not in self._live:
            return None
        now = self.clock()
        tracker = self._live[request_id]
        for child in tracker.children:                 # every child (finished ones are no-ops), or one
            if index is None or child.seq.index == index:
                self.scheduler.abort(child.seq.request_id, now)
        if tracker.finished:
            return self._finish(request_id, deliver)
        out = tracker.output()
        if deliver:
            self._pending.append(out)
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, so that the next requests compute their prompts in full
        (vLLM's ``reset_prefix_cache``: for benchmarks that rerun the same prompts). Returns False and
        changes nothing while any request holds blocks."""
        self._not_inside_a_step("reset_prefix_cache()")
        with self._lock, self._bookkeeping():
            self._check_alive()
            return self.scheduler.reset_prefix_cache()

    def close_arrivals(self) -> None:
        """No more requests will come for now: the static policy may run a batch smaller than its slots."""
        self.scheduler.close_arrivals()

    def open_arrivals(self) -> None:
        self.scheduler.open_arrivals()

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests that got a token or finished.

        A dead engine (``self.dead``) first hands out the final outputs of the requests it ended, then
        raises ``EngineDeadError``."""
        self._not_inside_a_step("step() / run() / generate()")
        with self._turn:                            # aborts from other threads go first
            self._turn.wait_for(lambda: self._aborts_waiting == 0)
        with self._lock:
            if self._closed and self._ready:        # the final outputs of requests ended by shutdown()
                outs, self._ready = self._ready, []
                return outs
            self._check_usable()
            self._step_thread = threading.get_ident()
            try:
                with DeferredInterrupts() as ctrl_c:
                    try:
                        if self.dead is None:
                            self._step(ctrl_c)
                        elif not (self._pending or self._ready):
                            raise EngineDeadError(f"the engine is dead: {self.dead}")
                    except _Passthrough as p:   # the forward's Ctrl-C, a step listener's exception
                        raise p.exc from None
                    except EngineDeadError:
                        raise
                    except BaseException as exc:                # a bug in the bookkeeping
                        self._die(exc)
                        if not isinstance(exc, Exception):
                            raise
                    self._ready += self._pending
                    self._pending = []
            finally:
                self._step_thread = None
            if self.runner.failure is not None:       # the runner broke in this step: say so now (the
                raise self.runner.failure.with_traceback(None)     # outputs stay; nobody is dropped)
            outs, self._ready = self._ready, []       # a Ctrl-C at the boundary keeps them for later
            return outs

    def _step(self, ctrl_c: DeferredInterrupts) -> None:
        """One step: plan, compute, record (see the module docstring for what each failure does)."""
        sched = self.scheduler
        start = self.clock()
        plan = sched.schedule(start)
        self.last_plan = plan
        error = None
        try:
            with ctrl_c.allowed():                     # a listener is user code: Ctrl-C acts at once
                before = self._listeners.emit_plan(plan, sched, start)
        except BaseException as exc:                   # the step's requests fail, the caller hears it
            self._fail_step(plan, _describe(exc))
            raise _Passthrough(exc) from None
        try:
            with ctrl_c.allowed():                     # Ctrl-C acts here, in the tensor work
                sampled = self.execute(plan) if not plan.is_empty else {}
        except BaseException as exc:                   # the step's requests fail; the rest go on
            error = _describe(exc)
            self._fail_step(plan, error)
            if not isinstance(exc, Exception):
                raise _Passthrough(exc) from None
        else:
            self._record(plan, sampled)
        while self._deferred_aborts:                  # aborts asked for by a listener of this step
            rid, index = self._deferred_aborts.popleft()
            self._abort(rid, deliver=True, index=index)
        try:
            self._listeners.emit_step(plan, sched, before, start, self.clock(), self._pending, error)
        except BaseException as exc:                  # the step is recorded: its outputs stay ours
            self._ready += self._pending
            self._pending = []
            raise _Passthrough(exc) from None

    def _not_inside_a_step(self, what: str) -> None:
        if self._step_thread == threading.get_ident():
            raise InvalidArgument(f"{what} called from inside a step (an event listener): the engine "
                                  "runs one step at a time; call it after step() returns")

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")

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
                    self._ready.append(out)
        self.runner.close()

    @contextmanager
    def _bookkeeping(self):
        """Changes to the engine's state outside ``step``: Ctrl-C deferred; an exception other than a
        deliberate ``MinicbError`` is a bug that kills the engine (see ``_die``)."""
        with DeferredInterrupts():
            try:
                yield
            except MinicbError:
                raise
            except BaseException as exc:
                self._die(exc)
                if not isinstance(exc, Exception):
                    raise
                raise EngineDeadError(f"the engine is dead: {self.dead}") from exc

    def _die(self, exc: BaseException) -> None:
        """The bookkeeping raised: end every request with ``finish_reason == "error"`` and hand out
        its final output; from now on the engine refuses work. The scheduler's state is not trusted
        (nor touched) any more: only each request's own sequence and output tracker are read."""
        self.dead = f"internal error: {_describe(exc)}"
        log.error("minicb: the engine's bookkeeping failed; every request ends with an error",
                  exc_info=(type(exc), exc, exc.__traceback__))
        now = self.clock()
        for tracker in list(self._live.values()):
            if tracker.final is None:
                for child in tracker.children:
                    if not child.seq.is_finished:
                        child.seq.finish(FinishReason.ERROR, now, self.dead)
                tracker.last_resort()
            if not tracker.handed_out:
                tracker.handed_out = True
                self._pending.append(tracker.final)
        self._live.clear()
        self._owner.clear()
        self._deferred_aborts.clear()

    def execute(self, plan: StepPlan) -> dict[str, int | RowOutput]:
        """The tensor half of a step: the runner's ``run`` (whatever the runner is: a model, rank 0 of a
        tensor-parallel group, a simulated clock). A row whose request was aborted since planning is
        computed but samples with default params. The result maps request ids to a token, or to a
        ``RowOutput`` (the token and the logprobs its request asked for; ``minicb.engine.logprobs``)."""
        params = {}
        for s in plan.seqs:
            if s.sample or s.prompt_targets:
                for sid in (s.request_id, *s.forks):       # a fork samples the row once per child
                    params[sid] = self._seq_params(sid)
        return self.runner.run(plan, params)

    def _child(self, seq_id: str) -> OutputTracker | None:
        """The output tracker of the live sequence ``seq_id`` (a child of some request), or None."""
        tracker = self._live.get(self._owner.get(seq_id, ""))
        if tracker is None:
            return None
        return next((c for c in tracker.children if c.seq.request_id == seq_id), None)

    def _seq_params(self, seq_id: str) -> SamplingParams:
        child = self._child(seq_id)
        return _GREEDY if child is None else child.seq.params

    def _record(self, plan: StepPlan, sampled: dict[str, int | RowOutput]) -> None:
        """Record the step in the scheduler and make the outputs of the requests it touched. A row
        that failed alone (``RowOutput.error``: logits not finite, a broken grammar) ends its request
        with ``finish_reason == "error"`` before the others are recorded."""
        tokens, failed = {}, []
        for sid, value in sampled.items():
            if isinstance(value, RowOutput) and value.error is not None:
                failed += [s.request_id for s in self.scheduler.fail(sid, value.error, self.clock())]
                continue
            token = token_of(value)
            if token is not None:
                tokens[sid] = token
            if isinstance(value, RowOutput):
                child = self._child(sid)
                if child is not None:
                    self._keep_logprobs(child, value)
        finished = {s.request_id for s in self.scheduler.update(plan, tokens, self.clock())}
        self._outputs_of(failed + list(tokens) + sorted(finished - tokens.keys()))

    def _outputs_of(self, seq_ids: list[str]) -> None:
        """Make the outputs of the requests these sequences belong to, each once, in that order: the
        final one (and forget the request) when its last child has finished."""
        rids = dict.fromkeys(self._owner[sid] for sid in seq_ids if sid in self._owner)
        for rid in rids:
            tracker = self._live[rid]
            if tracker.finished:
                self._finish(rid)
            else:
                self._pending.append(tracker.output())

    def _keep_logprobs(self, tracker: OutputTracker, row: RowOutput) -> None:
        """File a row's logprobs with its request, beside the token they describe (appended before
        ``scheduler.update`` appends the token; ``OutputTracker`` copies both into an output)."""
        if tracker.logprobs is not None and row.logprobs is not None and row.token is not None:
            del tracker.logprobs[tracker.seq.num_output_tokens:]     # none left from a failed record
            tracker.logprobs.append(row.logprobs.as_dict(self._token_text))
        if tracker.prompt is not None and row.prompt:
            tracker.prompt.add(row.prompt_start, row.prompt, self._token_text)

    def _token_text(self, token_id: int) -> str | None:
        """One token's text alone (``Logprob.decoded_token``): cached, at most one per vocabulary entry."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _fail_step(self, plan: StepPlan, error: str) -> None:
        """The step's requests end with ``finish_reason == "error"``; their slots and blocks are freed."""
        self._outputs_of([s.request_id for s in self.scheduler.fail_step(plan, error, self.clock())])

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
            self._ready = others + self._ready        # handed out by the next step()
        return done

    def _pending_has(self, wanted: set[str]) -> bool:
        return any(o.request_id in wanted for o in self._pending + self._ready)

    def run_until_done(self, progress=None) -> list[RequestOutput]:
        """Step until every request has finished; their final outputs in the order they finished."""
        return self.run(None, progress)

    # --- outputs --------------------------------------------------------------------------------
    def _finish(self, rid: str, deliver: bool = True) -> RequestOutput:
        """Make a finished request's final output (into the step's outputs if ``deliver``), then
        forget the request. In this order, so that if anything here fails the output is not lost:
        ``_die`` hands out a final output that was made but not yet handed out."""
        tracker = self._live[rid]
        out = tracker.final if tracker.final is not None else tracker.output()
        if deliver:
            tracker.handed_out = True
            self._pending.append(out)
        for child in tracker.children:
            self.runner.release(child.seq.request_id)
            self._owner.pop(child.seq.request_id, None)
        del self._live[rid]
        return out


class _Passthrough(Exception):
    """Carries an exception that must leave ``step()`` as it is (not be taken for a bookkeeping bug)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

