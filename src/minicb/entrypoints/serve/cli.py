"""``minicb serve``: the command line of the server.

    minicb serve                                   # SmolLM2 on http://127.0.0.1:8000, live page at /
    minicb serve --port 0 --max-num-seqs 8         # any free port (the first line says which)
    minicb serve --model tiny.gguf --dtype float64 --max-waiting 32 --shutdown-timeout 5
    minicb serve --host 0.0.0.0 --allowed-hosts myhost.lan --api-key "$KEY"     # on a network

The limits of one request and one connection (``--max-body-bytes`` ... ``--max-live-watchers``) are
``limits.py``'s table; the security flags are ``guard.py``'s. Exit codes: 0 stopped, 130 a second
SIGTERM / Ctrl-C cut the drain short, 1 the engine died, 2 a bad flag; the process exits as soon as
"minicb serve: stopped" is printed (no interpreter teardown: everything was shut down in order).

The engine flags are ``minicb generate``'s. Importing this module is cheap (argparse only): FastAPI,
uvicorn and torch are imported when the command runs.
"""

from __future__ import annotations

import os
import pathlib
import sys
from dataclasses import fields

from minicb.core.errors import InvalidArgument, MinicbError, check_int
from minicb.entrypoints.serve.limits import ServeLimits, flag

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


def add_parser(sub, add_engine_args) -> None:
    """Add ``serve`` to the ``minicb`` subcommands (``add_engine_args``: ``minicb.entrypoints.cli``'s)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible server with a live page of the slots",
                       description="Serve the model over HTTP: /v1/completions, /v1/chat/completions "
                                   "(streaming or not), /v1/models, /tokenize, /detokenize, /version, "
                                   "/ping, /health, /metrics (Prometheus, vLLM's names) and a live page "
                                   "of the scheduler at /.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="refuse new requests with 503 + Retry-After while this many wait (default 256)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C: seconds running requests get to finish (default 30)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs (default): arrival order; priority: a request's 'priority' field orders it "
                        "(lower first, as vLLM; without it the field is a 400)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's name)")
    p.add_argument("--seed", type=int, default=None, help="the engine's seed for unseeded sampling")
    p.add_argument("--max-logprob-entries", type=int, default=500_000,
                   help="refuse (400) a request asking for more logprob entries than this: rows x "
                        "(top-k + 1) over its prompt (prompt_logprobs, echo) and its tokens (logprobs); "
                        "default 500000, about 40 MB of response")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default 0: torch's choice; 1 is often faster for a small "
                        "model on a busy machine)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    lim = p.add_argument_group("limits of one request and one connection "
                               "(refused with 400 unless another status is named)")
    for f in fields(ServeLimits):
        default = "" if f.default is None else f" (default {f.default:,})"
        lim.add_argument(flag(f.name), type=float if f.type == "float" else int, default=None, metavar="N",
                         help=f"at most N {f.metadata['help']}{default}")
    sec = p.add_argument_group("security")
    sec.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                     help="Host header names the server answers to (default: the --host address, localhost, "
                          "127.0.0.1, ::1; '*' = any). Others get 400: DNS rebinding")
    sec.add_argument("--allowed-origins", default="", metavar="O1,O2",
                     help="CORS: origins whose pages may call the API ('*' = any; default none, as vLLM)")
    sec.add_argument("--api-key", default=os.environ.get("MINICB_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, the live "
                          "page and its feed and /metrics (401 otherwise); default $MINICB_API_KEY, "
                          "else none")
    sec.add_argument("--open-metrics", action="store_true",
                     help="with --api-key: leave /metrics open (a Prometheus scraper without the key)")
    sec.add_argument("--allow-control-text", action="store_true",
                     help="pass chat message text that contains control tokens (<|im_start|>) to the "
                          "template; default: refuse it with 400 (a user could forge a system turn)")
    p.add_argument("--frontend-workers", type=int, default=None, metavar="N",
                   help="worker processes that parse, render and tokenize requests (default min(4, CPUs))")
    p.set_defaults(run=cmd_serve)


def limits_from(args) -> ServeLimits:
    """The ``ServeLimits`` the flags ask for (a bad value: ``InvalidArgument`` naming the flag)."""
    return ServeLimits(**{f.name: getattr(args, f.name) for f in fields(ServeLimits)
                          if getattr(args, f.name, None) is not None})


def _hosts(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(h.strip() for h in text.split(",") if h.strip())


def _check_args(args) -> None:
    from minicb.core.kv_budget import gib_flag  # --kv-cache-memory in GiB, checked as generate checks it

    gib_flag(args.kv_cache_memory)
    check_int("--port", args.port, lo=0, hi=65535)
    check_int("--max-waiting", args.max_waiting, lo=0)
    check_int("--threads", args.threads, lo=0)
    if not args.shutdown_timeout >= 0:
        raise InvalidArgument(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.frontend_workers is not None:
        check_int("--frontend-workers", args.frontend_workers, lo=1)
    limits_from(args)


def model_name(path: str | None) -> str:
    """What clients call the model: the file's or directory's name without suffixes."""
    if path is None:
        from minicb.model.weights.loader import DEFAULT_MODEL_FILE

        return DEFAULT_MODEL_FILE.split(".")[0]
    p = pathlib.Path(path)
    return p.name.removesuffix(".gguf") if p.suffix == ".gguf" else p.name


def cmd_serve(args) -> int:
    _check_args(args)
    missing = [m for m in SERVE_PACKAGES if _missing(m)]
    if missing:
        raise MinicbError(f"minicb serve needs {', '.join(missing)}: pip install 'minicb[serve]'")
    from minicb.entrypoints.serve.server import listen

    sock = listen(args.host, args.port)          # first: a port in use fails before the model loads
    try:
        code = _serve(args, sock)
    finally:
        sock.close()
    if _as_program():
        exit_now(code)
    return code


def _as_program() -> bool:
    """This process *is* ``minicb serve`` (not a test calling ``main([...])``): the command line,
    which imported this module, says so (read from ``sys.modules``, not imported: it imports us)."""
    return bool(getattr(sys.modules.get("minicb.entrypoints.cli"), "_AS_PROGRAM", False))


def _serve(args, sock) -> int:
    from minicb.entrypoints.checks import model_name as shown_name  # torch-free
    from minicb.entrypoints.loading import load_lines
    from minicb.measure.progress import LOAD_AFTER, Progress

    # the load's phases on one progress line (stderr), from the imports on; which GEMM path the model
    # gets: one line (-v: and why)
    with load_lines(args.verbose), Progress(f"loading {shown_name(args.model)}", after=LOAD_AFTER) as prog:
        prog.phase("importing torch and the server")
        import torch

        from minicb.core.kv_budget import gib_flag  # --kv-cache-memory in GiB, as generate checks it
        from minicb.entrypoints.llm import LLM, SERVE_STALL_CAP
        from minicb.entrypoints.serve.server import EXIT_ENGINE_DEAD, EXIT_FORCED, Server, base_url

        if args.threads:
            torch.set_num_threads(args.threads)
        cap = args.max_prefill_tokens_while_decoding     # streams: serve's stall-free cap (LLM() has none)
        if cap is None and args.policy == "continuous":
            cap = SERVE_STALL_CAP
        llm = LLM(args.model, dtype=args.dtype, policy=args.policy, max_num_seqs=args.max_num_seqs,
                  scheduling_policy=args.scheduling_policy, fast_paths=not args.reference,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                  max_prefill_tokens_while_decoding=cap,
                  num_blocks=args.num_blocks, preemption_mode=args.preemption_mode, device=args.device,
                  attn_backend=args.attn_backend, tensor_parallel_size=args.tp, seed=args.seed,
                  enable_prefix_caching=args.prefix_caching,
                  kv_cache_memory_bytes=gib_flag(args.kv_cache_memory),
                  max_logprob_entries=args.max_logprob_entries)
    try:
        name = args.served_model_name or model_name(args.model)
        server = Server(llm.engine, model_name=name, max_waiting=args.max_waiting,
                        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                        limits=limits_from(args), allowed_hosts=_hosts(args.allowed_hosts),
                        allowed_origins=_hosts(args.allowed_origins) or (), api_key=args.api_key or None,
                        open_metrics=args.open_metrics, allow_control_text=args.allow_control_text,
                        frontend_workers=args.frontend_workers)
        url = base_url(sock)

        def ready() -> None:    # said once a Ctrl-C on seeing it stops the server cleanly (Server.run)
            print(f"minicb serve: {name} on {url}  (live page {url}/  API {url}/v1  metrics {url}/metrics)",
                  flush=True)
            if args.policy == "static":
                print(f"minicb serve: policy static: a batch starts once {llm.engine.config.max_num_seqs} "
                      "requests wait", file=sys.stderr, flush=True)

        code = server.run(sock, ready)
        if server.failure is not None:
            print(f"minicb serve: the engine failed: {server.failure}", file=sys.stderr, flush=True)
        aborted = server.engine_thread.aborted_at_shutdown
        why = {EXIT_FORCED: " (interrupted again: every request was aborted)",
               EXIT_ENGINE_DEAD: " (the engine died)"}.get(code, "")
        if code == 0 and aborted:
            why = f" ({aborted} request{'s' * (aborted != 1)} aborted at --shutdown-timeout)"
        print(f"minicb serve: stopped{why}", flush=True)
    finally:
        llm.shutdown()
    return code


def exit_now(code: int) -> None:
    """Leave at once with ``code``: the server, its threads and the engine are already shut down in
    order and the output is flushed, so the interpreter's teardown (seconds, for torch's and the
    tokenizer's threads and finalisers) has nothing left to do."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None

