"""The frontend: everything a request needs before the engine sees it, in worker *processes*.

::

    event loop                  worker processes (a pool)                       engine thread
    ──────────                  ─────────────────────────                       ─────────────
    read the body (bounded)  ─► JSON -> checked fields (protocol.py)      ─►    add_request(ids)
    at most --max-frontend-     -> chat template -> token ids -> stop matchers  step, step, ...
    queue in here, else 503     (a Prepared comes back; never the prompt text)
    a structured output: its grammar compiled in a thread of the server's process (the cache the
    engine thread's ``register`` copies from)

Why processes, not a thread (``asyncio.to_thread``, Starlette's ``run_in_threadpool``): the chat
template is pure-Python Jinja2, so a thread rendering thousands of messages holds the GIL: the
engine thread's steps slow down and the streams' chunks wait; in a process it takes nothing from the
server's interpreter, and a ``tokenizers`` abort kills a worker, not the server. Side by side:
``python bench/serve_libraries.py --only pool``; pinned by ``test_serve_hostile.py``'s
innocent-stream test (it fails with threads bounded as the workers are).
vLLM V1 does this work in its API server process, SGLang in its tokenizer process.

* **Started once** (``forkserver``: never forked from this threaded process), each worker built with
  the tokenizer (pickled: the ``tokenizers`` library's JSON), the model's name, vocabulary size,
  ``max_model_len`` and the limits. Per request only the raw body goes out.
* **Bounded**: at most ``--max-frontend-queue`` requests in here at once; one more is a 503.
* **Errors are answers**: a worker returns an ``ApiError``'s fields (400 / 404 / 413) and the caller
  raises it. A worker that dies (``tokenizers`` aborts the process when an allocation fails) costs the
  requests it held a 503, and the pool is started afresh for the next ones.
* **Never an orphan, never a slow exit**: the workers ignore Ctrl-C (the server decides what it
  means), leave by themselves within a second if the server's process disappears (``kill -9``), and
  ``close()`` terminates them, waiting at most ``CLOSE_WAIT_S`` for each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

from minicb.core.errors import InvalidArgument, describe
from minicb.entrypoints.serve.limits import ServeLimits, flag
from minicb.entrypoints.serve.protocol import (
    ApiError,
    ParsedRequest,
    bad_request,
    parse_chat,
    parse_completion,
)
from minicb.entrypoints.serve.stops import StopMatcher

log = logging.getLogger("minicb.entrypoints.serve")

CLOSE_WAIT_S = 1.0            # close(): how long a terminated worker gets before it is killed
WORKER_NICE = 10               # the workers yield the CPU to the engine thread and the event loop
ORPHAN_CHECK_S = 0.5          # a worker checks this often that the server's process is still there


@dataclass(slots=True)
class Prepared:
    """A request ready for the engine thread: checked (``parsed``), and per prompt its token ids and
    stop-string matcher (one engine request each)."""

    parsed: ParsedRequest
    requests: list[tuple[list[int], StopMatcher]]


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class Preparer:
    """The work itself: a body in, a ``Prepared`` out, or an ``ApiError``. Each worker process holds
    one (built by its initializer); tests call ``prepare`` directly."""

    def __init__(self, *, model_name: str, tokenizer, vocab_size: int, max_model_len: int,
                 limits: ServeLimits, allow_control_text: bool = False) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.limits = limits.with_model_len(max_model_len)
        self.control_texts: tuple[str, ...] = ()
        if tokenizer is not None and not allow_control_text:
            texts = (tokenizer.id_to_token(i) for i in sorted(tokenizer.all_special_ids))
            self.control_texts = tuple(t for t in texts if t)

    def warm(self) -> None:
        """Build the tables the first request would otherwise build (the longest token, the template)."""
        if self.tokenizer is not None:
            _ = self.tokenizer.max_token_chars
            if self.tokenizer.chat_template:
                try:
                    self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
                except Exception:   # noqa: BLE001 - a broken template is each request's 400, not ours
                    pass

    def prepare(self, kind: str, raw: bytes) -> Prepared:
        body = parse_json(raw, self.limits.max_json_depth)
        self.check_model(body)
        if kind == "chat":
            parsed = parse_chat(body, self._render, self.limits, self.control_texts)
        else:
            parsed = parse_completion(body, self.limits)
        prompts = parsed.prompts or (parsed.generate.prompt,)
        ids = [self._token_ids(parsed, p) for p in prompts]
        total, cap = sum(map(len, ids)), self.limits.max_prompt_tokens
        if len(ids) > 1 and total > cap:          # the bound holds for the whole body, as for one prompt
            raise bad_request(f"the {len(ids)} prompts have {total:,} tokens; at most {cap:,} are allowed in "
                              f"one request ({flag('max_prompt_tokens')}, at most max_model_len)", "prompt",
                              "context_length_exceeded")
        gen = parsed.generate
        parsed = replace(parsed, generate=replace(gen, prompt=ids[0]))     # echo keeps the texts
        return Prepared(parsed, [(i, StopMatcher(gen.stops, gen.params.include_stop_str_in_output))
                                 for i in ids])

    def _compile(self, parsed: ParsedRequest) -> None:
        """Compile the request's grammar off the engine thread, in the server's process (``Frontend``
        runs it in a thread: the cache must be the engine thread's): a bad one is a 400 now, a good
        one is cached, and the engine thread's ``register`` only copies the compiled matcher."""
        spec = parsed.generate.params.structured_outputs
        if spec is None:
            return
        param = parsed.constraint_param
        if self.tokenizer is None or self.tokenizer.eos_token_id is None:
            raise bad_request("structured outputs need the model's tokenizer and its EOS token", param)
        from minicb.runtime.grammar import compiled

        try:
            compiled(spec, self.tokenizer, self.vocab_size, self.tokenizer.eos_token_id)
        except InvalidArgument as e:
            raise bad_request(str(e), param) from None

    def check_model(self, body) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model != self.model_name:
            plain = len(model) <= 100 and model.isprintable() and model.encode("utf-8", "ignore") == \
                model.encode("utf-8", "replace")
            shown = model if plain else describe(model)
            raise ApiError(404, f"the model `{shown}` does not exist; this server serves "
                                f"`{self.model_name}` (GET /v1/models)", "invalid_request_error", "model",
                           "model_not_found")

    def _render(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise InvalidArgument("the model has no tokenizer, so no chat template: use /v1/completions "
                                  "with token ids")
        return self.tokenizer.apply_chat_template(messages)

    def _token_ids(self, parsed: ParsedRequest, prompt) -> list[int]:
        param = "messages" if parsed.kind == "chat" else "prompt"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request("prompt is text but the model has no tokenizer; pass token ids", param)
            try:               # bounded first: at most max_model_len tokens' worth of characters
                ids = self.tokenizer.encode(prompt, max_tokens=self.max_model_len)
            except InvalidArgument as e:
                raise bad_request(str(e), param, "context_length_exceeded"
                                  if "allowed" in str(e) else None) from None
        else:
            ids = prompt
        if not ids:
            raise bad_request("prompt must not be empty: it needs at least 1 token (it has 0)", param)
        cap = self.limits.max_prompt_tokens
        if len(ids) > cap:               # the engine would refuse it too, after checking every id
            raise bad_request(f"the prompt has {len(ids):,} tokens; at most {cap:,} are allowed "
                              f"({flag('max_prompt_tokens')}, at most max_model_len)", param,
                              "context_length_exceeded")
        top = max(ids)                                   # one C loop: the ids are plain ints by now
        if top >= self.vocab_size:
            raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size - 1}] (the "
                              f"vocabulary), got {top} at index {ids.index(top)}", param)
        return ids


class Frontend:
    """The pool of worker processes that turn request bodies into ``Prepared`` requests."""

    def __init__(self, *, model_name: str, tokenizer, vocab_size: int, max_model_len: int,
                 limits: ServeLimits, allow_control_text: bool = False, workers: int | None = None) -> None:
        self.limits = limits.with_model_len(max_model_len)
        self.workers = default_workers() if workers is None else workers
        if self.workers < 1:
            raise InvalidArgument(f"--frontend-workers must be >= 1, got {self.workers}")
        self._setup = dict(model_name=model_name, tokenizer=tokenizer, vocab_size=vocab_size,
                           max_model_len=max_model_len, limits=limits, allow_control_text=allow_control_text)
        self.local = Preparer(**self._setup)    # extra_routes' checks, grammars; never a request's parsing
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._closed = False
        self.queued = 0                        # requests in the frontend now (on the event loop only)
        self.restarts = 0                      # pools started afresh after a worker died

    # --- the pool's life ---------------------------------------------------------------------------
    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        return concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                                      initargs=(self._setup, os.getpid()))

    async def start(self) -> None:
        """Start the workers and wait until each has run its initializer (a broken setup fails here,
        not at the first request); the pool starts its processes one per task, so ``workers`` pings."""
        self._pool = self._new_pool()
        with _main_not_imported():            # the processes are launched by these submits
            futs = [asyncio.wrap_future(self._pool.submit(_ping, 0.05)) for _ in range(self.workers)]
        pids = await asyncio.gather(*futs)
        log.debug("frontend workers ready: %s", sorted(set(pids)))

    def close(self) -> None:
        """Stop the workers now: requests still in here get a 503 (the server is going away anyway)."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            _terminate(pool)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (tests check that none outlives the server)."""
        return sorted(getattr(self._pool, "_processes", None) or ())

    # --- one request ---------------------------------------------------------------------------------
    async def prepare(self, kind: str, raw: bytes) -> Prepared:
        """``Preparer.prepare`` in a worker process; the caller's loop keeps serving meanwhile."""
        cap = self.limits.max_frontend_queue
        if self.queued >= cap:
            raise ApiError(503, f"{cap} requests are being prepared already ({flag('max_frontend_queue')} "
                                f"{cap}); retry later", "service_unavailable_error", code="server_overloaded",
                           retry_after=1)
        pool = self._pool
        if pool is None:
            raise ApiError(503, "the server is shutting down and takes no new requests",
                           "service_unavailable_error", code="server_shutting_down", retry_after=5)
        self.queued += 1
        try:
            with _main_not_imported():        # a fresh pool launches its processes here
                fut = pool.submit(_prepare_in_worker, kind, raw)
            ok, value = await asyncio.wrap_future(fut)
        except (BrokenProcessPool, RuntimeError) as e:   # a worker died; RuntimeError: shut down meanwhile
            raise self._worker_lost(pool, e) from None
        finally:
            self.queued -= 1
        if not ok:
            raise ApiError(*value)
        if value.parsed.generate.params.structured_outputs is not None:
            await asyncio.to_thread(self.local._compile, value.parsed)   # this process's grammar cache
        return value

    def _worker_lost(self, pool, e: Exception) -> ApiError:
        if self._closed:
            return ApiError(503, "the server is shutting down and takes no new requests",
                            "service_unavailable_error", code="server_shutting_down", retry_after=5)
        if self._pool is pool:                 # the first request to notice starts a fresh pool
            log.error("a frontend worker process died (%s); starting the pool afresh", e)
            self._pool = self._new_pool()
            self.restarts += 1
            _terminate(pool)
        return ApiError(503, "the worker process preparing this request died; retry",
                        "service_unavailable_error", code="frontend_worker_died", retry_after=1)


@contextlib.contextmanager
def _main_not_imported():
    """Launch worker processes without the program's main module: ``multiprocessing`` would import
    a script (``python tutorial.py``) once more in every worker, running whatever is not behind
    ``if __name__ == "__main__"`` (a second server). The workers need nothing from it: their
    initializer and task are this module's functions. (It looks for ``__main__.__file__``.)"""
    main = sys.modules.get("__main__")
    hidden = main is not None and getattr(main, "__spec__", None) is None and hasattr(main, "__file__")
    if hidden:
        path = main.__file__
        del main.__file__
    try:
        yield
    finally:
        if hidden:
            main.__file__ = path


def _terminate(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Shut ``pool`` down without waiting for its work: terminate its processes (SIGTERM), give each
    ``CLOSE_WAIT_S`` in all, then kill. (Python 3.14 has ``terminate_workers()``; before it the
    processes are only reachable as ``_processes``.)"""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + CLOSE_WAIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(CLOSE_WAIT_S)


# --- inside a worker process ---------------------------------------------------------------------------
_PREPARER: Preparer | None = None


def _init_worker(setup: dict, server_pid: int) -> None:
    """Runs once in each worker: ignore Ctrl-C, watch for the server's end, build the ``Preparer``."""
    global _PREPARER
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if WORKER_NICE:
        os.nice(WORKER_NICE)
    threading.Thread(target=_leave_with, args=(server_pid,), name="minicb-frontend-orphan-check",
                     daemon=True).start()
    _PREPARER = Preparer(**setup)
    _PREPARER.warm()


def _leave_with(server_pid: int) -> None:
    """Exit as soon as the server's process is gone (it was killed: nobody will shut us down).

    Gone includes a zombie: a server that has exited but whose parent has not reaped it yet still has
    its process id. A parent that reads the server's output until end of file before reaping it
    (``subprocess.communicate``, ``$(minicb serve ...)``) would then wait forever on the pipes a worker
    inherited, while the worker waited for the id to disappear. (Not "our parent is gone": the parent
    is the fork server, which stays while any child, a worker included, holds its alive pipe.)"""
    while True:
        time.sleep(ORPHAN_CHECK_S)
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:      # the id was reused by another user's process: ours is gone
            os._exit(0)
        if _is_zombie(server_pid):
            os._exit(0)


def _is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (Linux's /proc; False where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _ping(delay: float) -> int:
    time.sleep(delay)                # long enough that each ping of ``start()`` gets a process of its own
    return os.getpid()


def _prepare_in_worker(kind: str, raw: bytes):
    """``(True, Prepared)`` or ``(False, ApiError's fields)``: the fields, not the exception, cross
    the process boundary (an exception pickles only its positional arguments)."""
    try:
        return True, _PREPARER.prepare(kind, raw)
    except ApiError as e:
        return False, (e.status, e.message, e.type, e.param, e.code, e.retry_after)


def parse_json(raw: bytes, max_depth: int = ServeLimits().max_json_depth):
    """The body as JSON, or a 400: invalid JSON or UTF-8, an integer of more than 4,300 digits,
    nesting deeper than ``max_depth`` (``--max-json-depth``)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as e:        # JSONDecodeError is a ValueError; so is 10**5000
        raise bad_request(f"the request body is not valid JSON: {_one_line(e)}") from None
    _check_depth(body, max_depth)
    return body


def _too_deep(max_depth: int) -> ApiError:
    return bad_request(f"the request body nests deeper than {max_depth} levels ({flag('max_json_depth')})")


def _check_depth(body, max_depth: int) -> None:
    """Walk the containers only (no recursion): a body of 100,000 ints costs one pass over them."""
    level: list = [body]
    for _depth in range(max_depth + 1):
        nxt = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(x for x in v.values() if isinstance(x, (list, dict)))
            elif isinstance(v, list):
                nxt.extend(x for x in v if isinstance(x, (list, dict)))
        if not nxt:
            return
        level = nxt
    raise _too_deep(max_depth)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def body_limit_error(size: int, limits: ServeLimits) -> ApiError:
    return ApiError(413, f"the request body has {size:,} bytes or more; at most {limits.max_body_bytes:,} "
                         f"are allowed ({flag('max_body_bytes')})", "invalid_request_error", None,
                    "request_too_large")
