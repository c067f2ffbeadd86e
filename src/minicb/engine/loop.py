"""The step loop: schedule, run, update, outputs. The heart of continuous batching, nothing else.

One step, every iteration::

    plan    = scheduler.schedule(now)           # 1. who runs, which tokens, which blocks (no torch)
    sampled = runner.run(plan, params)          # 2. swap, pack, forward, sample: the only tensor work
    done    = scheduler.update(plan, tokens)    # 3. finished requests free their slot and blocks *now*
    outputs = [tracker.output() ...]            # 4. each request that got a token or finished (only
                                                #    finished ones for output_kind FINAL_ONLY)

``StepLoop`` is that loop and the bookkeeping it needs: which requests are live (one
``outputs.RequestTracker`` each, with an ``OutputTracker`` per child), which sampling parameters each
sampled row uses, and the outputs not yet handed out. It talks to the scheduler through
``schedule`` / ``update`` (and ``add`` / ``abort`` / ``fail_step``) only, and to the model through
its runner (``minicb.engine.interface.Runner``), so it imports no torch.

If the tensor work raises, that step's requests end with ``finish_reason == "error"`` and the reason
(``fail_step``), and every other request is served on. Everything else that can go wrong (Ctrl-C,
a bug in the bookkeeping, a listener that raises, requests added or aborted at a bad moment) is
handled from outside, by ``LLMEngine`` (``llm_engine.py``), which wraps this loop: read this file
for what a step does, that one for how it stays safe.

Listeners (``engine.listen``; ``minicb.engine.events``) see a ``PlanEvent`` after step 1 and a
``StepEvent`` after step 4; a step nobody listens to takes no snapshot.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable

from minicb.core.config import SchedulerConfig
from minicb.core.plan import StepPlan
from minicb.core.sampling_params import RequestOutputKind, SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import Sequence
from minicb.engine.events import Listeners
from minicb.engine.interface import Runner
from minicb.engine.logprobs import PromptLogprobs, RowOutput
from minicb.engine.outputs import OutputTracker, RequestOutput, RequestTracker

GREEDY = SamplingParams()    # sampling for a row whose request was aborted after planning


class StepLoop:
    """Owns a scheduler and drives a runner: ``_step()`` is one iteration of the loop (module
    docstring). ``clock`` stamps arrivals, tokens and finishes."""

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
        self._live: dict[str, RequestTracker] = {}     # request id -> its output state
        self._owner: dict[str, str] = {}                # sequence id (a child's) -> request id
        self._params: dict[str, SamplingParams] = {}    # sequence id -> what its rows sample with
        self._ids = itertools.count()
        self._listeners = Listeners()
        self._pending: list[RequestOutput] = []         # outputs not yet handed out by step()
        self._deferred_aborts: deque[tuple[str, int | None]] = deque()   # asked for by a listener
        self._token_texts: dict[int, str] = {}          # token id -> its text alone (logprobs)

    # --- the loop ---------------------------------------------------------------------------------
    def _step(self) -> None:
        """One iteration: schedule, run, update, outputs (into ``self._pending``)."""
        start = self.clock()
        plan = self.scheduler.schedule(start)                 # 1. schedule
        self.last_plan = plan
        before = self._emit_plan(plan, start) if self._listeners.active else None
        params = self._sampling_params(plan)
        todo = plan.seqs or plan.padding or plan.swap_out or plan.swap_in or plan.copy_blocks  # not is_empty
        error = None
        try:
            with self._interruptible():
                sampled = self.runner.run(plan, params) if todo else {}     # 2. run
        except BaseException as exc:                          # the step's requests fail, the rest go on
            error = describe(exc)
            self._fail_step(plan, error)
            if not isinstance(exc, Exception):                # Ctrl-C: the caller hears it too
                raise Passthrough(exc) from None
        else:
            self._record(plan, sampled)                       # 3. update, 4. outputs
        while self._deferred_aborts:                          # aborts a listener asked for in this step
            rid, index = self._deferred_aborts.popleft()
            self._abort(rid, deliver=True, index=index)
        if self._listeners.active:
            try:
                self._listeners.emit_step(plan, self.scheduler, before, start, self.clock(), self._pending,
                                          error)
            except BaseException as exc:                      # the step is recorded: its outputs stay
                raise Passthrough(exc) from None

    def _emit_plan(self, plan: StepPlan, start: float):
        """Tell the plan listeners (user code: Ctrl-C may act at once); if one raises, the step's
        requests fail and its exception leaves ``step()`` as it is."""
        try:
            with self._interruptible():
                return self._listeners.emit_plan(plan, self.scheduler, start)
        except BaseException as exc:
            self._fail_step(plan, describe(exc))
            raise Passthrough(exc) from None

    def _interruptible(self):
        """Where a Ctrl-C may act at once: the runner's work and listeners (``LLMEngine`` defers it
        everywhere else); here, nothing changes."""
        return contextlib.nullcontext()

    def _sampling_params(self, plan: StepPlan) -> dict[str, SamplingParams]:
        """What each sampled row samples with; a fork's row samples once per child. A row whose
        request was aborted since planning is computed but samples with default params. The runner
        (a model, rank 0 of a tensor-parallel group, a simulated clock) returns, per request id, a
        token or a ``RowOutput`` (the token and the logprobs it asked for; ``engine.logprobs``)."""
        params = {}
        for s in plan.seqs:
            if s.sample or s.prompt_targets:
                for sid in (s.request_id, *s.forks):
                    params[sid] = self._params.get(sid, GREEDY)
        return params

    def _record(self, plan: StepPlan, sampled: dict[str, int | RowOutput]) -> None:
        """Record the step in the scheduler and make the outputs of the requests it touched. A row
        that failed alone (``RowOutput.error``: logits not finite, a broken grammar) ends its request
        with ``finish_reason == "error"`` before the others are recorded."""
        tokens, failed = {}, []
        for sid, value in sampled.items():
            if not isinstance(value, RowOutput):
                if value is not None:
                    tokens[sid] = value
                continue
            if value.error is not None:
                self.scheduler.abort(sid, self.clock(), error=value.error)
                failed.append(sid)
                continue
            if value.token is not None:
                tokens[sid] = value.token
            tracker = self._child(sid)
            if tracker is not None:
                self._keep_logprobs(tracker, value)
        finished = self.scheduler.update(plan, tokens, self.clock())
        self._outputs_of(failed + list(tokens) + sorted({s.request_id for s in finished} - tokens.keys()))

    def _outputs_of(self, seq_ids: list[str]) -> None:
        """Make the outputs of the requests these sequences belong to, each once, in that order: the
        final one (and forget the request) when its last child has finished."""
        done = set()
        for sid in seq_ids:
            rid = self._owner.get(sid)
            if rid is None or rid in done:
                continue
            tracker = self._live[rid]      # FINAL_ONLY: nothing while the sequence or a sibling runs
            if tracker.final_only and (self.scheduler.get(sid) is not None or not tracker.finished):
                continue
            done.add(rid)
            out = tracker.output()
            if out.finished:
                self._finish(rid)
            else:
                self._pending.append(out)

    def _fail_step(self, plan: StepPlan, error: str) -> None:
        """The step's requests end with ``finish_reason == "error"``; their slots and blocks are freed."""
        self._outputs_of([s.request_id for s in self.scheduler.fail_step(plan, error, self.clock())])

    # --- driving it -------------------------------------------------------------------------------
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
            self._pending = others + self._pending        # handed out by the next step()
        return done

    def _pending_has(self, wanted: set[str]) -> bool:
        return any(o.request_id in wanted for o in self._pending)

    def run_until_done(self, progress=None) -> list[RequestOutput]:
        """Step until every request has finished; their final outputs in the order they finished."""
        return self.run(None, progress)

    # --- requests in and out ----------------------------------------------------------------------
    def _enqueue(self, request_id: str, seqs: list[Sequence]) -> None:
        """Register the request's ``n`` sequences with the runner and queue them in the scheduler."""
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
            self._params[seq.request_id] = seq.params
        final_only = seqs[0].params.output_kind == RequestOutputKind.FINAL_ONLY
        self._live[request_id] = RequestTracker(request_id, children, final_only)

    def _abort(self, request_id: str, deliver: bool, index: int | None = None) -> RequestOutput | None:
        """End the request (or its child ``index``) with ``finish_reason == "abort"``; its output."""
        if request_id not in self._live:
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

    def _finish(self, rid: str, deliver: bool = True) -> RequestOutput:
        """Make a finished request's final output (into the step's outputs if ``deliver``), then
        forget the request. In this order, so that if anything here fails the output is not lost:
        ``LLMEngine._die`` hands out a final output that was made but not yet handed out."""
        tracker = self._live[rid]
        out = tracker.final if tracker.final is not None else tracker.output()
        if deliver:
            tracker.handed_out = True
            self._pending.append(out)
        for child in tracker.children:
            sid = child.seq.request_id
            self.runner.release(sid)
            self._owner.pop(sid, None)
            self._params.pop(sid, None)
        del self._live[rid]
        return out

    # --- logprobs ---------------------------------------------------------------------------------
    def _child(self, seq_id: str) -> OutputTracker | None:
        """The output tracker of the live sequence ``seq_id`` (a child of some request), or None."""
        tracker = self._live.get(self._owner.get(seq_id, ""))
        if tracker is None:
            return None
        return next((c for c in tracker.children if c.seq.request_id == seq_id), None)

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


class Passthrough(Exception):
    """Carries an exception that must leave ``step()`` as it is: a listener's, or a Ctrl-C in the
    tensor work (not to be taken for a bug in the bookkeeping)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
