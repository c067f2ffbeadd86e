"""The engine thread: the one thread that owns the ``LLMEngine`` while the server runs.

The engine is synchronous, not thread-safe, and a step takes milliseconds to seconds, so it lives in a
thread of its own and meets the event loop at two doors only: ``submit`` / ``abort`` / ``call`` post to
the inbox (a list and a ``Condition``: the thread sleeps on it while there is no work, zero CPU), and
each step's outputs go back in one ``loop.call_soon_threadsafe`` batch. The picture, and why a request
joins the batch at the next step: ``docs/concepts/serving.md``, section "Two threads, two doors".

* The inbox is drained completely before every step, so a burst is admitted (or refused with 503)
  together, in arrival order; ``max_waiting`` counts the requests that would *wait* beyond the free slots.
* Requests arrive as token ids (``frontend.py``) and each step's *token ids* go back; text and stop
  strings are made on the event loop (``detokenizer.py``), a stop string found there comes back as
  ``abort(id, "stop")`` (one choice of ``n > 1``: ``abort(id, "stop", index)``).
* Everything the loop learns about a request comes through its ``RequestHandle.queue``: ``Accepted``
  (or an ``ApiError``: 400 for a prompt the engine refuses, 503 when too many wait), then ``Delta``s
  (one per choice with new tokens), the last one of each choice ``finished``; a last ``Delta`` that
  ends a request without its answer (shutdown, a failed step) carries the ``ApiError`` to answer with.
* If ``step()`` raises, the engine is *dead*: every open and new request gets a 503 with the reason,
  ``dead`` holds it (``/health``), and ``on_dead(reason)`` tells the server, which shuts down.
* ``drain(timeout)`` (graceful shutdown) refuses new requests and aborts what is left when the time
  is up; ``call(fn)`` runs ``fn(engine)`` here between two steps (``/health``'s snapshot).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minicb.core.errors import EngineDeadError, InvalidArgument, RequestRejected
from minicb.engine.outputs import CompletionOutput, RequestOutput
from minicb.entrypoints.serve.protocol import ApiError, GenerateRequest, bad_request

log = logging.getLogger("minicb.entrypoints.serve")

STALL_RECHECK_S = 0.5      # an engine with requests but an empty plan (static batch filling) rechecks


def check_choices(n: int, max_n: int) -> None:
    """``n`` choices above the engine's ``max_n``: a 400 naming ``n``. The event loop calls it before it
    makes anything per choice (a decoder and stop matcher each: a million of them took 22 s), the
    engine thread again before it adds the request."""
    if n > max_n:
        raise bad_request(f"n={n} is more choices than this server makes for one request (max_n={max_n})",
                          "n")


@dataclass(slots=True)
class Accepted:
    """The engine took the request: it is queued and will join the batch at the next step."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class Delta:
    """What one step added to one request. The engine thread sends token ids and ``text == ""``;
    the loop's ``RequestText`` fills in the text (stop strings applied) before a client sees it."""

    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    error: str | None = None
    failure: ApiError | None = None       # the request ended without its answer: what a client is told
    logprobs: list | None = None          # one {token_id: Logprob} per token of token_ids (if asked for)
    prompt_logprobs: list | None = None   # the prompt's, once (on the first Delta that has them)
    index: int = 0                        # which of the request's n choices (parallel sampling)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (the loop's)


@dataclass(slots=True, eq=False)
class RequestHandle:
    """The event loop's side of one request. Made on the loop; its queue is fed by the engine thread."""

    request_id: str
    request: GenerateRequest              # its prompt: token ids (the frontend tokenized it)
    arrival_time: float
    text: Any = None                      # its detokenizer.RequestText, a list of one per choice (n > 1),
                                          # or None (Deltas pass as they are)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass(slots=True)
class _Live:
    """The engine thread's side of one request."""

    handle: RequestHandle
    num_prompt_tokens: int
    seen_first_token: bool = False
    n: int = 1                            # choices (parallel sampling)
    done: set[int] = field(default_factory=set)                  # n > 1: children that ended
    prompt_sent: bool = False             # its prompt logprobs went out already


class EngineThread:
    """Owns the engine in a thread; see the module docstring for the picture."""

    def __init__(self, engine, *, max_waiting: int, metrics=None,
                 on_start: Callable[[Any], None] | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._on_start = on_start                    # runs on the thread first (listeners attach here)
        self._on_dead = on_dead                      # runs on the thread when the engine dies
        self.dead: str | None = None                 # why the engine died (None: it is alive)
        self.aborted_at_shutdown = 0                 # requests cut short by the drain's deadline
        self._closed = False                         # the thread has ended: nobody takes messages
        self._admit: list[int] | None = None         # [waiting, free slots] for this inbox batch
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: list[tuple[RequestHandle, Any]] = []
        self._deadline: float | None = None          # draining: abort what is left at this time
        self._draining = False
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="minicb-engine", daemon=True)
        self.busy_seconds = 0.0                      # time spent inside engine.step()

    # --- the event loop's side (any thread) ------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def submit(self, handle: RequestHandle) -> None:
        if not self._post(("add", handle)):          # the thread has ended: answer here (on the loop)
            handle.queue.put_nowait(self._refusal())

    def abort(self, request_id: str, reason: str = "abort", index: int | None = None) -> None:
        """Abort if still running (a finished or unknown id is ignored): a client went away
        (``reason == "abort"``), or the loop found a stop string (``"stop"``: what the metrics count).
        ``index``: only that choice of an ``n > 1`` request (its stop string), the others go on."""
        self._post(("abort", request_id, reason, index))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps; its result (or exception)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self._post(("call", fn, fut)):
            fut.set_exception(RuntimeError("the engine thread has stopped"))
        return fut

    def drain(self, timeout: float) -> None:
        """Refuse new requests from now on; abort the accepted ones still running after ``timeout`` s
        (``timeout=0``: now; a second drain can only bring the deadline closer)."""
        self._post(("drain", time.monotonic() + timeout))

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread (aborting whatever is left) and wait for it."""
        self._post(("stop",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        """Messages posted and not yet taken by the engine thread."""
        with self._cond:
            return len(self._inbox)

    def _post(self, msg: tuple) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._inbox.append(msg)
            self._cond.notify()
        return True

    def _refusal(self) -> ApiError:
        if self.dead is not None:
            return ApiError(503, f"the engine failed and the server is shutting down: {self.dead}",
                            "service_unavailable_error", code="engine_dead")
        return ApiError(503, "the server is shutting down and takes no new requests",
                        "service_unavailable_error", code="server_shutting_down", retry_after=5)

    # --- the engine thread -----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self._on_start is not None:
                self._on_start(self.engine)
            self._loop_until_stopped()
        except BaseException as e:   # noqa: BLE001 - whatever it was, clients must hear of it
            log.exception("the engine thread failed")
            self._die(_reason(e))
            self._loop_until_stopped()
        finally:
            with self._cond:
                self._closed = True
                late, self._inbox = self._inbox, []
            for msg in late:                  # posted while the thread was ending
                if msg[0] == "add":
                    self._send(msg[1], self._refusal())
                elif msg[0] == "call" and msg[2].set_running_or_notify_cancel():
                    msg[2].set_exception(RuntimeError("the engine thread has stopped"))
            self._abort_all("the server stopped")
            self._flush()

    def _loop_until_stopped(self) -> None:
        stalled = False
        while not self._stop:
            msgs, handled = self._wait(stalled), []
            self._admit = None
            while msgs:                       # what arrives while we handle these joins this step too
                for msg in msgs:
                    try:
                        self._handle(msg)
                    except Exception:   # noqa: BLE001 - one bad message must not stop the engine thread
                        log.exception("engine thread: handling %s failed", msg[0])
                handled += msgs
                msgs = self._take()
            if self.dead is not None:         # nothing to step: answer messages until stopped
                self._deadline = None
                self._flush()
                continue
            if self.metrics is not None and any(m[0] in ("add", "abort") for m in handled):
                self.metrics.observe_state(self.engine.snapshot())   # the gauges, between steps too
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self.aborted_at_shutdown += self._abort_all("the server is shutting down")
                self._deadline = None
            stalled = False
            if not self._stop and self.engine.has_unfinished_requests():
                stalled = not self._step()
            self._flush()

    def _wait(self, stalled: bool) -> list[tuple]:
        """Take the inbox; block (no timeout, so no CPU) while there is nothing to do."""
        with self._cond:
            while not self._inbox and (stalled or self.dead is not None
                                       or not self.engine.has_unfinished_requests()):
                timeout = STALL_RECHECK_S if stalled else None
                if self._deadline is not None:
                    left = max(0.0, self._deadline - time.monotonic())
                    timeout = left if timeout is None else min(timeout, left)
                    if left == 0.0:
                        break
                if not self._cond.wait(timeout) and stalled:
                    break
            msgs, self._inbox = self._inbox, []
        return msgs

    def _take(self) -> list[tuple]:
        with self._cond:
            msgs, self._inbox = self._inbox, []
        return msgs

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(msg[1])
        elif kind == "abort":
            live = self._live.get(msg[1])
            index = msg[3] if live is not None and live.n > 1 else None     # one choice of n > 1
            if live is not None and index not in live.done:
                out = self.engine.abort_request(msg[1], index=index)
                if out is not None or index is not None:
                    self._finish(live, out, msg[2], index=index)
        elif kind == "call":
            fut = msg[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(msg[1](self.engine))
                except Exception as e:   # noqa: BLE001 - the caller gets the exception
                    fut.set_exception(e)
        elif kind == "drain":
            self._draining = True
            self._deadline = msg[1] if self._deadline is None else min(self._deadline, msg[1])
            if self.dead is None:
                self.engine.close_arrivals()      # a static batch need not wait for more requests
        elif kind == "stop":
            self._stop = True

    def _add(self, handle: RequestHandle) -> None:
        req = handle.request
        try:
            if self._draining or self.dead is not None:
                raise self._refusal()
            if self._admit is None:           # once per inbox batch: the scheduler's counts
                snap = self.engine.snapshot()
                self._admit = [len(snap.waiting) + len(snap.swapped), sum(r is None for r in snap.slots)]
            waiting, free = self._admit
            if waiting - free >= self.max_waiting:     # this one would be the (max_waiting + 1)-th to wait
                raise ApiError(503, f"too many requests are waiting ({max(0, waiting - free)} beyond the "
                               f"{free} free slots, --max-waiting {self.max_waiting}); retry later",
                               "service_unavailable_error", code="server_overloaded", retry_after=1)
            ids = req.prompt
            params = req.params
            check_choices(params.n, self.engine.config.max_n)
            if req.priority and self.engine.config.scheduling_policy != "priority":
                raise bad_request(f"priority {req.priority} needs priority scheduling; this server schedules "
                                  f"{self.engine.config.scheduling_policy} (--scheduling-policy priority)",
                                  "priority")
            if req.max_tokens_from_room:
                params = dataclasses.replace(params, max_tokens=self._room(len(ids)))
            self.engine.add_request(handle.request_id, ids, params, arrival_time=handle.arrival_time,
                                    priority=req.priority)
            self._admit[0] += 1
        except ApiError as e:
            self._send(handle, e)
            return
        except RequestRejected as e:       # can never fit: the message names the limit
            self._send(handle, bad_request(str(e), "prompt", "context_length_exceeded"))
            return
        except InvalidArgument as e:       # the prompt, or a knob only the engine can judge
            knob = next((k for k in ("logit_bias", "bad_words", "min_tokens", "request_id")
                         if str(e).startswith(k)), None)
            self._send(handle, bad_request(str(e), knob or "prompt"))
            return
        except Exception:   # noqa: BLE001 - a bug must cost this request only, and never show a traceback
            log.exception("adding request %s failed", handle.request_id)
            self._send(handle, ApiError(500, "internal error while adding the request", "server_error"))
            return
        live = _Live(handle, len(ids), n=params.n)
        self._live[handle.request_id] = live
        self._send(handle, Accepted(ids, params.max_tokens))

    def _room(self, prompt_len: int) -> int:
        """Chat without max_tokens: all the room the prompt leaves (context length and KV pool)."""
        c = self.engine.config
        limit = min(c.max_model_len, c.num_blocks * c.block_size)
        if prompt_len >= limit:
            raise bad_request(f"the prompt has {prompt_len} tokens, which leaves no room to generate: "
                              f"the limit is {limit} tokens (max_model_len={c.max_model_len}, KV pool "
                              f"{c.num_blocks} blocks x {c.block_size})", "messages",
                              "context_length_exceeded")
        return limit - prompt_len

    def _step(self) -> bool:
        """One engine step and its outputs; False when the step did nothing (nothing runnable)."""
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:   # noqa: BLE001 - the engine fails a bad step itself: this one is dead
            log.error("the engine step raised %s; the engine is dead, the server shuts down", _reason(e),
                      exc_info=not isinstance(e, EngineDeadError))
            self._die(_reason(e))
            return True
        finally:
            self.busy_seconds += time.perf_counter() - t0
        for out in outs:
            live = self._live.get(out.request_id)
            if live is not None:
                self._output(live, out)
        plan = self.engine.last_plan
        return bool(outs) or (plan is not None and not plan.is_empty)

    def _output(self, live: _Live, out: RequestOutput) -> None:
        """A Delta per choice with new tokens (``n == 1``: one choice); a choice that finished sends its
        last."""
        new = any(c.new_token_ids for c in out.outputs)
        if self.metrics is not None:
            self.metrics.observe_tokens(out, first=not live.seen_first_token and new)
        live.seen_first_token |= new
        for c in out.outputs:
            if c.index in live.done:
                continue
            if c.finished():
                self._child_done(live, out, c.index, c.finish_reason, c)
            elif c.new_token_ids:
                self._send(live.handle, Delta("", list(c.new_token_ids), live.num_prompt_tokens,
                                              len(c.token_ids), logprobs=_new_logprobs(c),
                                              prompt_logprobs=self._prompt_once(live, out), index=c.index))

    @staticmethod
    def _prompt_once(live: _Live, out: RequestOutput) -> list | None:
        """The prompt's logprobs on the first Delta that can carry them, None after."""
        if live.prompt_sent or out.prompt_logprobs is None:
            return None
        live.prompt_sent = True
        return out.prompt_logprobs

    def _child_done(self, live: _Live, out: RequestOutput | None, i: int, reason: str | None,
                    c: CompletionOutput | None, failure: ApiError | None = None) -> None:
        """Child ``i`` ended (``c``: its completion, None if the engine could not say): its finished
        Delta; the request is over once every child's is sent."""
        live.done.add(i)
        error = c.error if c is not None else None
        if failure is None and reason == "error":
            failure = ApiError(500, f"the engine step serving this request failed: {error}", "server_error")
        prompt = self._prompt_once(live, out) if out is not None else None
        self._send(live.handle, Delta("", list(c.new_token_ids) if c else [], live.num_prompt_tokens,
                                      len(c.token_ids) if c else 0, True, reason,
                                      error if failure is None else failure.message, failure,
                                      _new_logprobs(c) if c else None, prompt, i))
        if len(live.done) == live.n:
            del self._live[live.handle.request_id]
            if self.metrics is not None and out is not None:
                self.metrics.observe_finished(out, reason)

    def _finish(self, live: _Live, out: RequestOutput | None, reason: str | None,
                failure: ApiError | None = None, index: int | None = None) -> None:
        """End choice ``index`` (default: every choice not yet ended)."""
        by_index = {c.index: c for c in out.outputs} if out is not None else {}
        left = sorted(set(range(live.n)) - live.done) if index is None else [index]
        for i in left:
            self._child_done(live, out, i, reason, by_index.get(i), failure)

    def _abort_all(self, why: str, failure: ApiError | None = None, reason: str = "abort") -> int:
        """End every live request with ``finish_reason == reason`` and ``failure`` (default: a 503
        "the server is shutting down" carrying ``why``); returns how many there were."""
        if failure is None:
            failure = ApiError(503, f"{why}: the request was aborted", "service_unavailable_error",
                               code="server_shutting_down")
        n = len(self._live)
        for rid, live in list(self._live.items()):
            out = None
            if self.dead is None:
                try:
                    out = self.engine.abort_request(rid)
                except Exception:   # noqa: BLE001 - a broken engine must still let clients go
                    log.exception("abort of %s failed", rid)
            self._finish(live, out, reason, failure)
        return n

    def _die(self, reason: str) -> None:
        """The engine failed: end every request with a 503 that says why, refuse new ones, tell the server."""
        if self.dead is not None:
            return
        self.dead = reason
        self._abort_all(reason, self._refusal(), "error")
        self._flush()
        if self._on_dead is not None:
            try:
                self._on_dead(reason)
            except Exception:   # noqa: BLE001
                log.exception("on_dead failed")

    # --- delivery to the event loop --------------------------------------------------------------
    def _send(self, handle: RequestHandle, item) -> None:
        self._outbox.append((handle, item))

    def _flush(self) -> None:
        """Hand this iteration's items to the event loop in one call (one wake-up per step)."""
        if not self._outbox or self._loop is None:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:          # the loop is closed: nobody is listening any more
            pass

    def _deliver(self, batch: list[tuple[RequestHandle, Any]]) -> None:
        """On the event loop: each request's Deltas get their text (``handle.text``), then its queue."""
        for handle, item in batch:
            if isinstance(item, Delta) and handle.text is not None:
                text = handle.text[item.index] if isinstance(handle.text, list) else handle.text
                try:
                    item = text.push(item)
                except Exception as e:   # noqa: BLE001 - a bug costs this request only
                    log.exception("making the text of %s failed", handle.request_id)
                    text.done = True
                    self.abort(handle.request_id, index=item.index if isinstance(handle.text, list) else None)
                    failure = ApiError(500, f"internal error while decoding the output: {_reason(e)}",
                                       "server_error")
                    item = Delta("", [], item.num_prompt_tokens, item.num_output_tokens, True, "error",
                                 failure.message, failure, index=item.index)
                if item is None:
                    continue
            handle.queue.put_nowait(item)


def _new_logprobs(out: RequestOutput | CompletionOutput) -> list | None:
    """The logprobs of ``out.new_token_ids`` (None when the request asked for none); of a request, or
    of one of its ``n`` choices."""
    if out.logprobs is None:
        return None
    return out.logprobs[len(out.token_ids) - len(out.new_token_ids):]


def _reason(e: BaseException) -> str:
    """One line naming an exception: ``EngineDeadError: the runner process exited``."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__

