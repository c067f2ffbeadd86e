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

**Shutdown** (SIGTERM, Ctrl-C, or ``stop()``): the engine thread refuses new requests (503) and closes
arrivals; uvicorn stops accepting connections and waits for the open ones; the accepted requests
run on, and those still unfinished after ``shutdown_timeout`` seconds are aborted (their clients get
``finish_reason: "abort"``); live pages are ended; the engine thread stops; ``run`` returns and the
command exits 0. A second Ctrl-C skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time

import uvicorn

from minicb.core.errors import MinicbError
from minicb.entrypoints.serve.app import build_app
from minicb.entrypoints.serve.engine_thread import EngineThread
from minicb.entrypoints.serve.live import LiveFeed
from minicb.entrypoints.serve.metrics import ServerMetrics

DEFAULT_MAX_WAITING = 256
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


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
    """uvicorn's server, telling ours when a signal asks it to exit (the drain starts right then)."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


class Server:
    """One model served over HTTP (see the module docstring)."""

    def __init__(self, engine, *, model_name: str, max_waiting: int = DEFAULT_MAX_WAITING,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, log_level: str = "warning") -> None:
        if max_waiting < 0:
            raise MinicbError(f"max_waiting must be >= 0, got {max_waiting}")
        if not shutdown_timeout >= 0:
            raise MinicbError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        cfg = engine.config
        self.model_name = model_name
        self.shutdown_timeout = shutdown_timeout
        self.created = int(time.time())
        self.max_model_len = cfg.max_model_len
        self.clock = engine.clock                 # the engine's clock: arrival times must be on it
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(model_name)
        self.live = LiveFeed({"model": model_name, "policy": cfg.policy, "max_num_seqs": cfg.max_num_seqs,
                              "num_blocks": cfg.num_blocks, "block_size": cfg.block_size,
                              "max_num_batched_tokens": cfg.max_num_batched_tokens, "history": 96})
        self.engine_thread = EngineThread(engine, max_waiting=max_waiting, metrics=self.metrics,
                                          on_start=self._attach)
        self.draining = False
        self.app = build_app(self)
        self._uvicorn = _Uvicorn(uvicorn.Config(self.app, log_level=log_level, access_log=False,
                                                timeout_graceful_shutdown=shutdown_timeout + 2.0,
                                                lifespan="on"), self.begin_shutdown)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _attach(self, engine) -> None:
        """On the engine thread, before its first step: metrics and the live feed listen to steps."""
        engine.listen(on_step=self.metrics.on_step)
        engine.listen(on_step=self.live.on_step)

    def render_chat(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            from minicb.core.errors import InvalidArgument

            raise InvalidArgument("the model has no tokenizer, so no chat template: use /v1/completions "
                                  "with token ids")
        return self.tokenizer.apply_chat_template(messages)

    # --- running ----------------------------------------------------------------------------------
    def run(self, sock: socket.socket) -> None:
        """Serve on ``sock`` until SIGTERM / Ctrl-C (main thread) or ``stop()``; then shut down cleanly."""
        quiet = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            # uvicorn re-raises the signal it caught once it has shut down, with the handler that was
            # there before it: make that one harmless, so a graceful shutdown ends with exit code 0
            for sig in quiet:
                signal.signal(sig, _ignore)
        try:
            asyncio.run(self._serve(sock))
        finally:
            self.engine_thread.stop()
            if in_main:
                for sig, handler in quiet.items():
                    signal.signal(sig, handler)

    async def _serve(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        await self._uvicorn.serve(sockets=[sock])

    def start_in_thread(self, sock: socket.socket, timeout: float = 30.0) -> str:
        """Serve from a background thread; return the base URL once the server answers."""
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

    def stop(self, timeout: float | None = None) -> None:
        """Shut down as a signal would, and wait for it (from another thread than the server's)."""
        self.begin_shutdown()
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(self.shutdown_timeout + 10.0 if timeout is None else timeout)


def _ignore(signum, frame) -> None:
    pass
