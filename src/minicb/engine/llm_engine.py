"""The engine: the step loop (``loop.py``) behind its public API, with the guards that keep it safe.

``LLMEngine`` is what everything outside uses: ``add_request``, ``abort_request``, ``step``, ``run``,
``listen``, ``shutdown``. Streaming is vLLM's shape: ``add_request`` queues, each ``step`` returns the
outputs that changed (new tokens, or finished). ``run(request_ids)`` steps until given requests finish
and keeps the outputs of any others for the next ``step`` (``LLM.generate`` is built on it). Nothing
outside the engine reads the scheduler, the slot table or the block manager.

The loop itself (schedule, run, update, outputs) is ``StepLoop._step``. This module wraps it from
outside; what can go wrong, and what happens then (the consistency contract, ``docs/errors.md``):

* the tensor work raises (``runner.run``): that step's requests end with ``finish_reason == "error"``
  and the reason; everybody else is served on (the loop does this);
* one request's row fails alone (``RowOutput.error``: its logits are not finite, its grammar's
  matcher broke): that request ends with ``finish_reason == "error"`` and the message, the step's
  other requests are recorded as usual (the loop does this too);
* Ctrl-C: the bookkeeping (planning, recording, finishing, aborting) runs with it *deferred*
  (``DeferredInterrupts`` below), so it lands inside the forward (the step's requests fail as above)
  or at the step boundary (nobody is harmed), never half way through moving a request;
* the bookkeeping itself raises: that is a bug, and nobody can vouch for the state it left. The
  engine ends every request with ``finish_reason == "error"`` and the reason, hands those outputs
  out, and is dead from then on (``EngineDeadError``, as in vLLM V1);
* a listener raises: its exception leaves ``step()`` as it is, the step's outputs stay for the next;
* an output is made all or nothing (``outputs.OutputTracker``), so whatever fails, the tokens a
  request streamed concatenate to its final ``token_ids`` and its text is their decode.

The engine is not thread-safe: one thread calls it (``minicb serve`` steps it in an engine thread of
its own and posts requests and aborts to that thread). A listener runs inside a step: it may abort a
request (applied when the step ends) but not add one or step.

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
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager

from minicb.core.errors import EngineDeadError, InvalidArgument, MinicbError, RequestRejected, check_int
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import SchedulerStats
from minicb.core.sequence import FinishReason, Sequence
from minicb.engine import inputs
from minicb.engine.events import PlanEvent, StepEvent
from minicb.engine.loop import Passthrough, StepLoop, describe
from minicb.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "DeferredInterrupts", "LLMEngine", "child_id"]

log = logging.getLogger("minicb.engine")
_SHUT_DOWN = ("this engine was shut down (its runner is closed): create a new engine (or LLM) to serve more "
              "requests")


def child_id(request_id: str, index: int, n: int) -> str:
    """The id of child ``index`` of a request with ``n`` children: the request's own id when ``n == 1``,
    else ``f"{index}_{request_id}"`` (vLLM V1's naming)."""
    return request_id if n == 1 else f"{index}_{request_id}"


class LLMEngine(StepLoop):
    """The step loop behind its public API, guarded (module docstring); ``step()`` runs one iteration.

    ``runner`` does the tensor half of every step (``minicb.engine.interface.Runner``); its KV pool
    must have the shape ``config`` schedules. ``clock`` stamps arrivals, tokens and finishes."""

    dead: str | None = None          # why the engine died (EngineDeadError), or None
    _closed = False                  # shutdown() was called
    _in_step = False                 # a step is running (a listener is calling back)
    _ctrl_c: DeferredInterrupts | None = None

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
            return bool(self._pending)                # the final outputs still to hand out
        return self.scheduler.has_unfinished() or bool(self._pending)

    def occupancy(self) -> tuple[int, int]:
        """(slots held, device KV blocks in use) now: two counts, where a snapshot copies every table."""
        bm = self.scheduler.block_manager
        return self.scheduler.slot_table.num_held, bm.num_blocks - bm.num_free_blocks

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
                         priority=priority, eos_token_id=self.eos_token_id, index=i,
                         prompt=prompt if isinstance(prompt, str) else None)
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
        self._not_inside_a_step("add_request()")
        if rid in self._live:
            raise InvalidArgument(f"request_id {rid!r} is already in use")
        with self._bookkeeping():
            self._check_alive()
            if self._closed:
                raise InvalidArgument(_SHUT_DOWN)
            self._enqueue(rid, seqs)
        return rid

    def abort_request(self, request_id: str, index: int | None = None) -> RequestOutput | None:
        """End ``request_id`` (any state) with ``finish_reason == "abort"`` and free what it holds;
        returns its final output, or None if it is not an unfinished request of this engine.

        ``index`` ends only that child of a request with ``n > 1`` (a stop string it produced, say)
        and returns the request's output now, final if it was the last child. Child 0 before its
        prompt is done takes the children still waiting for the fork with it (they have nothing yet).
        Called from a step listener (in the middle of a step) the abort is applied when the step ends
        and its final output comes out of the next ``step()``."""
        if not isinstance(request_id, str):
            raise InvalidArgument(f"request_id must be a str, got {type(request_id).__name__}")
        if index is not None:
            index = check_int("index", index, lo=0)
        if self._in_step:
            self._deferred_aborts.append((request_id, index))
            return None
        if self.dead is not None:
            return None
        out = None
        try:
            with self._bookkeeping():
                out = self._abort(request_id, deliver=False, index=index)
        except KeyboardInterrupt:     # a Ctrl-C deferred to the end of the abort, which is done:
            if out is not None:       # its output comes out of the next step()
                self._pending.append(out)
            raise
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block, so that the next requests compute their prompts in full
        (vLLM's ``reset_prefix_cache``: for benchmarks that rerun the same prompts). Returns False and
        changes nothing while any request holds blocks."""
        self._not_inside_a_step("reset_prefix_cache()")
        with self._bookkeeping():
            self._check_alive()
            return self.scheduler.reset_prefix_cache()

    def close_arrivals(self) -> None:
        """No more requests will come for now: the static policy may run a batch smaller than its slots."""
        self.scheduler.close_arrivals()

    def open_arrivals(self) -> None:
        self.scheduler.close_arrivals(False)

    # --- the loop, guarded ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration of the loop (``StepLoop._step``); return the outputs of the requests that
        got a token or finished. A dead engine first hands out the final outputs of the requests it
        ended, then raises ``EngineDeadError``."""
        if self._in_step:
            self._not_inside_a_step("step() / run() / generate()")    # raises
        if self._closed:
            if not self._pending:               # else: the final outputs of requests ended by shutdown()
                raise InvalidArgument(_SHUT_DOWN)
        elif self.runner.failure is not None:   # a tensor-parallel rank died: this runner is done
            raise self.runner.failure.with_traceback(None)
        elif self.dead is None:
            self._in_step = True
            try:
                with DeferredInterrupts() as self._ctrl_c:
                    try:
                        self._step()
                    except Passthrough as p:           # a listener's exception, or Ctrl-C in the forward
                        raise p.exc from None
                    except BaseException as exc:       # a bug in the bookkeeping
                        self._die(exc)
                        if not isinstance(exc, Exception):
                            raise
            finally:
                self._in_step, self._ctrl_c = False, None
            if self.runner.failure is not None:       # the runner broke in this step: say so now (the
                raise self.runner.failure.with_traceback(None)     # outputs stay; nobody is dropped)
        elif self.dead is not None and not self._pending:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        outs, self._pending = self._pending, []        # a Ctrl-C at the boundary keeps them for later
        return outs

    def _interruptible(self):
        """Ctrl-C acts at once in the tensor work and in listeners (``DeferredInterrupts.allowed``)."""
        return self._ctrl_c.allowed()

    def _not_inside_a_step(self, what: str) -> None:
        if self._in_step:
            raise InvalidArgument(f"{what} called from inside a step (an event listener): the engine "
                                  "runs one step at a time; call it after step() returns")

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")

    def shutdown(self) -> None:
        """End every unfinished request (``finish_reason == "abort"``) and close the runner (a
        tensor-parallel group's other ranks stop). The next ``step()`` hands out those final outputs;
        after that every ``step()`` / ``add_request()`` raises ``InvalidArgument``. Idempotent."""
        if not self._closed:
            for rid in list(self._live):
                out = self.abort_request(rid)
                if out is not None:
                    self._pending.append(out)
            self._closed = True
        self.runner.close()

    # --- death ----------------------------------------------------------------------------------
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
        self.dead = f"internal error: {describe(exc)}"
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


class DeferredInterrupts:
    """Ctrl-C at a safe point: a context in which SIGINT is recorded instead of raised.

    In Python a ``KeyboardInterrupt`` is raised by the SIGINT handler, between any two bytecodes of the
    main thread. Inside the engine's bookkeeping (plain Python that moves requests between queues and
    blocks between lists) that is the worst possible moment: a request can be in no queue, a block can
    be freed twice, an output can be made and then dropped. So minicb does what a kernel does with a
    critical section: it *defers* the signal::

        with DeferredInterrupts() as ctrl_c:        # SIGINT now only sets a flag
            plan = scheduler.schedule()             # bookkeeping: never interrupted
            with ctrl_c.allowed():                  # the forward: Ctrl-C acts at once here, and a
                sampled = runner.run(plan, params)  #   pending one is delivered on entry
            scheduler.update(plan, sampled)         # bookkeeping again
        # leaving the block: a Ctrl-C still pending is raised here, at the step boundary

    So a Ctrl-C is delivered at the next safe point: inside the forward (the step's requests then end
    with ``finish_reason == "error"``, as for any failure of the tensor work) or at the step boundary
    (no request is harmed: the step's outputs come out of the next ``step()``). Only the main thread
    receives signals, so in any other thread (``minicb serve`` steps the engine in one) this is a
    no-op, and so it is when the program has its own SIGINT handler (left alone) or ignores the
    signal. A second Ctrl-C while one is pending changes nothing: it is delivered once."""

    __slots__ = ("pending", "_active", "_previous")

    def __enter__(self) -> DeferredInterrupts:
        self.pending = False          # a Ctrl-C arrived while deferred and is not delivered yet
        self._active = False          # our recording handler is installed
        self._previous = None         # the handler it replaced (Python's default_int_handler)
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._record)
            self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._active:
            signal.signal(signal.SIGINT, self._previous)
            self._active = False
        if self.pending and exc_type is None:
            self.pending = False
            raise KeyboardInterrupt          # delivered at the safe point: the end of the block

    def _record(self, signum, frame) -> None:
        self.pending = True

    @contextmanager
    def allowed(self):
        """A window in which Ctrl-C acts at once (the tensor work); a pending one is raised on entry."""
        if not self._active:
            yield
            return
        signal.signal(signal.SIGINT, self._previous)
        try:
            if self.pending:
                self.pending = False
                raise KeyboardInterrupt
            yield
        finally:
            signal.signal(signal.SIGINT, self._record)
