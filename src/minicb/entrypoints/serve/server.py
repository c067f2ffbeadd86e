"""``Server``: an engine, its thread, the metrics, the live feed and the HTTP app, run by uvicorn.

::

    from minicb import LLM
    from minicb.entrypoints.serve.server import Server, listen

    llm = LLM(max_num_seqs=8)
    server = Server(llm.engine, model_name="smollm2")
    server.run(listen("127.0.0.1", 8000))         # blocks; SIGTERM / Ctrl-C shut it down gracefully

    url = server.start_in_thread(listen("127.0.0.1", 0))   # tests, tutorials: returns the base URL
    ...
    server.stop()

**Shutdown** (SIGTERM, Ctrl-C, ``stop()``; a second signal; a dead engine) and its exit codes
(``EXIT_*`` below): ``docs/concepts/serving.md``, section "Shutdown". ``limits.py`` bounds each
connection (uvicorn's options, and ``_DeadlineH11`` for what uvicorn lacks); ``guard.py`` is the
middleware in front of the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import socket
import threading
import time
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from minicb.core.errors import MinicbError
from minicb.entrypoints.serve import guard
from minicb.entrypoints.serve.app import build_app
from minicb.entrypoints.serve.engine_thread import EngineThread
from minicb.entrypoints.serve.frontend import Frontend
from minicb.entrypoints.serve.limits import ServeLimits, flag
from minicb.entrypoints.serve.live import LiveFeed
from minicb.entrypoints.serve.metrics import ServerMetrics

DEFAULT_MAX_WAITING = 256
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
FORCE_GRACE_S = 2.0           # after a second signal: the aborted requests' last chunks get this long

EXIT_STOPPED = 0
EXIT_ENGINE_DEAD = 1
EXIT_FORCED = 130


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port); ``MinicbError`` if impossible.

    The server binds before it starts, so a port in use is one clear line, and a client that connects
    between this call and uvicorn's start waits in the backlog instead of being refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise MinicbError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise MinicbError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling ours when a signal asks it to exit (the drain starts right then).

    A second signal does not drop the connections as uvicorn's own ``force_exit`` would (streams cut
    at a ``finish_reason: null`` chunk): it aborts every request at once, so each client gets its last
    chunk and ``[DONE]`` (or an error object), and forces the exit only ``FORCE_GRACE_S`` later."""

    def __init__(self, config: uvicorn.Config, on_exit, on_force) -> None:
        super().__init__(config)
        self._on_exit, self._on_force = on_exit, on_force

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self._on_force()
            return
        self._on_exit()
        super().handle_exit(sig, frame)


class _DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head: a connection that sends no complete
    request line and headers within ``header_timeout`` seconds of connecting, or of its previous
    response, is closed; a refused body (404, 405, 413, 408) still arriving ``body_linger`` seconds
    after its answer closes it (uvicorn reads and drops the rest meanwhile, so the next request on the
    connection is served); a head past ``max_header_bytes`` is a 431 naming the flag.

    Why a subclass of uvicorn's (private) protocol: uvicorn 0.55 has no deadline on a request's head
    (a slowloris or silent connection holds a slot for ever: ``python bench/serve_libraries.py --only
    head``; ``test_serve_hostile``), and answers a head past ``h11_max_incomplete_event_size`` with a
    plain-text 400."""

    header_timeout = 10.0
    body_linger = 2.0
    max_header_bytes = 16 * 2**10

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_deadline, self.cycle)

    def _head_deadline(self, cycle_then) -> None:
        if self.cycle is cycle_then and (cycle_then is None or cycle_then.response_complete):
            self.transport.close()            # no new request's head since the timer was armed

    def _linger_deadline(self, cycle_then) -> None:
        if self.cycle is cycle_then and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()            # the refused body is still arriving: enough of it

    def on_response_complete(self) -> None:
        body_left = self.conn.their_state is h11.SEND_BODY       # before uvicorn starts the next cycle
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if body_left:                         # uvicorn drops the rest of it (h11 still parses it, so
            self.loop.call_later(self.body_linger, self._linger_deadline, self.cycle)   # the next head is
        self._head_timer.cancel()             # found after it), for at most body_linger seconds
        self._arm()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request's head: too large (its buffer outgrew the limit) is a 431 that
        names the flag; anything else is uvicorn's own 400."""
        if len(self.conn.trailing_data[0]) <= self.max_header_bytes:
            return super().send_400_response(msg)
        body = json.dumps({"error": {
            "message": f"the request line and headers exceed {self.max_header_bytes:,} bytes "
                       f"({flag('max_header_bytes')})", "type": "invalid_request_error", "param": None,
            "code": "request_header_fields_too_large"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        head = h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large")
        for event in (head, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


class Server:
    """One model served over HTTP (see the module docstring)."""

    def __init__(self, engine, *, model_name: str, max_waiting: int = DEFAULT_MAX_WAITING,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, log_level: str = "warning",
                 limits: ServeLimits | None = None, allowed_hosts: tuple[str, ...] | None = None,
                 allowed_origins: tuple[str, ...] = (), api_key: str | None = None,
                 open_metrics: bool = False, allow_control_text: bool = False,
                 frontend_workers: int | None = None,
                 exit_on_engine_death: bool = True) -> None:
        if max_waiting < 0:
            raise MinicbError(f"max_waiting must be >= 0, got {max_waiting}")
        if not shutdown_timeout >= 0:
            raise MinicbError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        cfg = engine.config
        self.model_name = model_name
        self.shutdown_timeout = shutdown_timeout
        self.log_level = log_level
        self.created = int(time.time())
        self.max_model_len = cfg.max_model_len
        self.clock = engine.clock                 # the engine's clock: arrival times must be on it
        self.tokenizer = engine.tokenizer
        engine.detokenize = False                 # the event loop makes the text (detokenizer.py)
        if self.tokenizer is not None:
            self.tokenizer.incremental_decoder()  # its byte table, built now rather than at a first request
        self.limits = (limits or ServeLimits()).with_model_len(cfg.max_model_len)
        self.allowed_hosts, self.allowed_origins, self.api_key = allowed_hosts, allowed_origins, api_key
        self.open_metrics = open_metrics
        self.exit_on_engine_death = exit_on_engine_death
        self.exit_code = EXIT_STOPPED
        self.frontend = Frontend(model_name=model_name, tokenizer=engine.tokenizer,
                                 vocab_size=engine.runner.vocab_size, max_model_len=cfg.max_model_len,
                                 limits=self.limits, allow_control_text=allow_control_text,
                                 workers=frontend_workers)
        self.metrics = ServerMetrics(model_name, max_model_len=cfg.max_model_len)
        self.live = LiveFeed({"model": model_name, "policy": cfg.policy, "max_num_seqs": cfg.max_num_seqs,
                              "num_blocks": cfg.num_blocks, "block_size": cfg.block_size,
                              "max_num_batched_tokens": cfg.max_num_batched_tokens, "history": 96},
                             max_watchers=self.limits.max_live_watchers)
        self.engine_thread = EngineThread(engine, max_waiting=max_waiting, metrics=self.metrics,
                                          on_start=self._attach, on_dead=self._on_engine_dead)
        self.draining = False
        self.app = build_app(self)
        self._uvicorn: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _make_uvicorn(self, sock: socket.socket) -> _Uvicorn:
        hosts = self.allowed_hosts
        if hosts is None:
            hosts = guard.default_allowed_hosts(sock.getsockname()[0])
        asgi = guard.wrap(self.app, allowed_hosts=hosts, api_key=self.api_key,
                          allowed_origins=self.allowed_origins, max_header_bytes=self.limits.max_header_bytes,
                          open_metrics=self.open_metrics)
        lim = self.limits
        protocol = type("DeadlineH11", (_DeadlineH11,), {"header_timeout": lim.header_timeout,
                                                         "body_linger": lim.body_linger,
                                                         "max_header_bytes": lim.max_header_bytes})
        config = uvicorn.Config(asgi, log_level=self.log_level, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=self.shutdown_timeout + 2.0, http=protocol,
                                timeout_keep_alive=lim.keep_alive_timeout,
                                limit_concurrency=lim.max_connections,
                                h11_max_incomplete_event_size=lim.max_header_bytes)
        return _Uvicorn(config, self.begin_shutdown, self.force_shutdown)

    def _attach(self, engine) -> None:
        """On the engine thread, before its first step: metrics and the live feed listen to steps."""
        self.metrics.watch_stats(engine.stats)
        engine.listen(on_step=self.metrics.on_step)
        engine.listen(on_step=self.live.on_step)

    # --- running ----------------------------------------------------------------------------------
    def run(self, sock: socket.socket, ready: Callable[[], None] = lambda: None) -> int:
        """Serve on ``sock`` until SIGTERM / Ctrl-C (main thread) or ``stop()``; then shut down cleanly.
        ``ready`` (the listening line) is called once a signal would stop the server cleanly.
        Returns the exit code (module docstring)."""
        if self._uvicorn is None:
            self._uvicorn = self._make_uvicorn(sock)
        quiet = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            # Until uvicorn installs its own handlers (after the collection below and its start-up), a
            # signal must not be lost: the listening line is printed once this handler is in, and a
            # Ctrl-C or SIGTERM sent on seeing it would otherwise leave the server running (or, before
            # this handler, end the program with KeyboardInterrupt, 130). So it goes where uvicorn's
            # handler would send it (should_exit set before start-up: uvicorn returns right after it).
            # uvicorn also re-raises the signal it caught once it has shut down, with the handler that
            # was there before it: once it has started, that one is harmless (exit code 0).
            uv = self._uvicorn

            def early(sig, frame) -> None:
                if not uv.started:
                    uv.handle_exit(sig, frame)

            for sig in quiet:
                signal.signal(sig, early)
        ready()
        # What exists now (the model, the tokenizer, every import) lives as long as the server: take it
        # out of the garbage collector's scans. A full collection runs on whichever thread allocates at
        # that moment (the engine thread, the event loop) and holds the GIL while it walks every tracked
        # object: with the start-up heap frozen it walks only what requests made.
        gc.collect()
        gc.freeze()
        try:
            asyncio.run(self._serve(sock))
        finally:
            self.engine_thread.stop()
            self.frontend.close()
            gc.unfreeze()
            if in_main:
                for sig, handler in quiet.items():
                    signal.signal(sig, handler)
        return self.exit_code

    async def _serve(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        await self._uvicorn.serve(sockets=[sock])

    def start_in_thread(self, sock: socket.socket, timeout: float = 30.0) -> str:
        """Serve from a background thread; return the base URL once the server answers."""
        self._uvicorn = self._make_uvicorn(sock)
        self._thread = threading.Thread(target=self.run, args=(sock,), name="minicb-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise MinicbError("the server did not start")
            time.sleep(0.01)
        return base_url(sock)

    def begin_shutdown(self) -> None:
        """Start the graceful shutdown (any thread, signal handlers included)."""
        if self.draining:
            return
        self.draining = True
        self.engine_thread.drain(self.shutdown_timeout)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.live.close)

    def force_shutdown(self) -> None:
        """A second signal: abort every request now (each client still gets its last chunk / an error
        object), exit ``FORCE_GRACE_S`` later at the latest, with code 130."""
        if self.exit_code == EXIT_STOPPED:
            self.exit_code = EXIT_FORCED
        self.begin_shutdown()
        self.engine_thread.drain(0.0)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._loop.call_later, FORCE_GRACE_S, self._force_exit)

    def _force_exit(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.force_exit = True

    def _on_engine_dead(self, reason: str) -> None:
        """On the engine thread: the engine died. Every client has its 503 already; shut down."""
        self.exit_code = EXIT_ENGINE_DEAD
        self.failure = reason
        if self.exit_on_engine_death:
            self.begin_shutdown()
            if self._uvicorn is not None:
                self._uvicorn.should_exit = True

    failure: str | None = None

    def stop(self, timeout: float | None = None) -> None:
        """Shut down as a signal would, and wait for it (from another thread than the server's)."""
        self.begin_shutdown()
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(self.shutdown_timeout + 10.0 if timeout is None else timeout)
