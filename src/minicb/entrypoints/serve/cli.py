"""``minicb serve``: the command line of the server.

    minicb serve                                   # SmolLM2 on http://127.0.0.1:8000, live page at /
    minicb serve --port 0 --max-num-seqs 8         # any free port (the first line says which)
    minicb serve --model tiny.gguf --dtype float64 --max-waiting 32 --shutdown-timeout 5

The engine flags are ``minicb generate``'s. Importing this module is cheap (argparse only): FastAPI,
uvicorn and torch are imported when the command runs.
"""

from __future__ import annotations

import pathlib
import sys

from minicb.core.errors import InvalidArgument, MinicbError, check_int

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


def add_parser(sub, add_engine_args) -> None:
    """Add ``serve`` to the ``minicb`` subcommands (``add_engine_args``: ``minicb.entrypoints.cli``'s)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible server with a live page of the slots",
                       description="Serve the model over HTTP: /v1/completions, /v1/chat/completions "
                                   "(streaming or not), /v1/models, /health, /metrics (Prometheus, "
                                   "vLLM's names) and a live page of the scheduler at /.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="refuse new requests with 503 + Retry-After while this many wait (default 256)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C: seconds running requests get to finish (default 30)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's name)")
    p.add_argument("--seed", type=int, default=None, help="the engine's seed for unseeded sampling")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default 0: torch's choice; 1 is often faster for a small "
                        "model on a busy machine)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    p.set_defaults(run=cmd_serve)


def _check_args(args) -> None:
    from minicb.core.kv_budget import gib_flag  # --kv-cache-memory in GiB, checked as generate checks it

    gib_flag(args.kv_cache_memory)
    check_int("--port", args.port, lo=0, hi=65535)
    check_int("--max-waiting", args.max_waiting, lo=0)
    check_int("--threads", args.threads, lo=0)
    if not args.shutdown_timeout >= 0:
        raise InvalidArgument(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")


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
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args, sock) -> int:
    import torch

    from minicb.core.kv_budget import gib_flag  # --kv-cache-memory in GiB, checked as generate checks it
    from minicb.entrypoints.llm import LLM
    from minicb.entrypoints.serve.server import Server, base_url

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, policy=args.policy, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              num_blocks=args.num_blocks, preemption_mode=args.preemption_mode, device=args.device,
              attn_backend=args.attn_backend, tensor_parallel_size=args.tp, seed=args.seed,
              enable_prefix_caching=args.prefix_caching, kv_cache_memory_bytes=gib_flag(args.kv_cache_memory))
    try:
        name = args.served_model_name or model_name(args.model)
        server = Server(llm.engine, model_name=name, max_waiting=args.max_waiting,
                        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
        url = base_url(sock)
        print(f"minicb serve: {name} on {url}  (live page {url}/  API {url}/v1  metrics {url}/metrics)",
              flush=True)
        if args.policy == "static":
            print(f"minicb serve: policy static: a batch starts once {llm.engine.config.max_num_seqs} "
                  "requests wait",
                  file=sys.stderr, flush=True)
        server.run(sock)
        print("minicb serve: stopped", flush=True)
    finally:
        llm.shutdown()
    return 0


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
