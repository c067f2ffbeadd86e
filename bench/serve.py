"""``minicb serve`` under load: W2 arriving as a Poisson process through streaming HTTP clients.

    python bench/serve.py --rates 0.25,0.5,1 --out bench/out/serve.json          # starts minicb serve
    python bench/serve.py --url http://127.0.0.1:8001 --model smollm2 --rates ...  # any OpenAI server
    python bench/serve.py --peer http://127.0.0.1:8011 --rates ...   # minicb and a peer, alternating
    python bench/serve.py --watch-overhead --repeats 3                             # the live page's cost

Every request of W2 (``bench/workloads.py``: 64 requests, ShareGPT lengths, random-id prompts of at
most 256 tokens, 1-128 output tokens, EOS ignored) is sent at its arrival time, drawn from a Poisson
process of the given rate (seeded), as a streaming ``/v1/completions`` call with its token ids, through
the official ``openai`` client (asyncio, one connection per request in flight; ``run_load(...,
client="lean")``: the same requests read as bare SSE lines, ``bench/serve_peers.py --clients``).
Measured on the client side, as the benchmark table does on the server side:

* throughput: output tokens (``usage``) / (last token received - first request sent);
* TTFT: request sent -> first chunk with text; ITL: gaps between consecutive text chunks of a request
  (a chunk is one token, except where text is held back: an incomplete UTF-8 character);
* queueing: the one figure a client cannot see, read from the server's own
  ``vllm:request_queue_time_seconds`` histogram (mean over the run; vLLM exposes the same metric).

Each rate's run changes the first token of every prompt, so no run finds the previous run's prompts
in the prefix cache. With ``--peer URL`` (e.g. vLLM's OpenAI server on the same model) the same
requests go to minicb and then to the peer at each rate, alternately, so a slow spell of a shared
machine hits both alike. ``--watch-overhead`` measures what the live page costs: the whole W2 at once
(closed loop), alternately with and without a client reading ``/live/events`` as the page does, and
the engine thread's time inside the feed's listener (``/health``: ``live_listener_s`` vs
``engine_busy_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from workloads import w2  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
MINICB_ARGS = ("--threads 1 --max-num-seqs 64 --max-num-batched-tokens 1024 --attn-backend cpu-paged "
               "--max-waiting 1024")


@dataclass(slots=True)
class Record:
    """One request as its client saw it."""

    arrival: float                    # scheduled send time, from the run's start
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist() if rate > 0 else [0.0] * n


async def _one(c, model: str, prompt: list[int], max_tokens: int, rec: Record, t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + rec.arrival - time.perf_counter()))
    rec.sent = time.perf_counter()
    try:
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                rec.chunk_times.append(now)
            if chunk.usage is not None:
                rec.tokens = chunk.usage.completion_tokens
    except Exception as e:   # noqa: BLE001 - a failed request is counted and reported, not fatal
        rec.error = f"{type(e).__name__}: {e}"


async def _one_lean(c, model: str, prompt: list[int], max_tokens: int, rec: Record, t0: float) -> None:
    """``_one`` without the SDK: the same request, its stream read as bare ``data:`` lines (json.loads
    each), as ``vllm bench serve``'s aiohttp client does. About half the SDK's CPU (0.5 against 1.0 CPU
    s a W2 saturation turn, bench/RESULTS.md): nearer a client on another machine, which takes none of
    the server's CPU."""
    await asyncio.sleep(max(0.0, t0 + rec.arrival - time.perf_counter()))
    rec.sent = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:          # an error mid-stream ends the request, as the SDK raises it
                    raise RuntimeError(f"error in the stream: {chunk['error']}")
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    rec.chunk_times.append(now)
                if chunk.get("usage"):
                    rec.tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:   # noqa: BLE001 - a failed request is counted and reported, not fatal
        rec.error = f"{type(e).__name__}: {e}"


def run_load(url: str, model: str, prompts, outputs, arrivals, client: str = "openai") -> list[Record]:
    """Send every request at its arrival time and record what came back. ``client``: "openai" (the
    official SDK, what users run) or "lean" (``_one_lean``)."""
    import httpx2 as httpx  # the HTTP client the openai SDK itself is built on
    import openai

    async def main() -> list[Record]:
        if client == "lean":
            c = httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=None))
            one = _one_lean
        else:
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
            one = _one
        recs = [Record(a) for a in arrivals]
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, model, p, o, r, t0) for p, o, r in zip(prompts, outputs, recs)))
        await (c.aclose() if client == "lean" else c.close())
        return recs

    return asyncio.run(main())


def pct(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(recs: list[Record]) -> dict:
    ok = [r for r in recs if r.error is None and r.chunk_times]
    ttft = [r.chunk_times[0] - r.sent for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.chunk_times[-1] - r.sent for r in ok]
    # time per output token after the first, per request (vLLM's TPOT): its tokens may come fewer to a chunk
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.tokens - 1) for r in ok if r.tokens > 1]
    span = max(r.chunk_times[-1] for r in ok) - min(r.sent for r in ok) if ok else float("nan")
    tokens = sum(r.tokens for r in ok)
    return {"requests": len(recs), "failed": len(recs) - len(ok), "tokens": tokens, "seconds": span,
            "throughput": tokens / span if ok else 0.0,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50),
            "e2e_p50_s": pct(e2e, 50), "errors": sorted({r.error for r in recs if r.error})[:3]}


def queue_time(url: str) -> tuple[float, float]:
    """(sum, count) of the server's vllm:request_queue_time_seconds histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:request_queue_time_seconds_sum":
                total += s.value
            elif s.name == "vllm:request_queue_time_seconds_count":
                count += s.value
    return total, count


def w2_for_run(k: int, num: int):
    """W2's prompts with the first token made run-specific (no prefix-cache hits across runs)."""
    wl = w2(num)
    return [[100 + k] + p[1:] for p in wl.prompts], wl.output_lens


# --- the server ----------------------------------------------------------------------------------------
class MinicbServer:
    """``minicb serve`` as a subprocess on a free port."""

    def __init__(self, args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "minicb", "serve", "--port", "0", "--served-model-name", "smollm2",
               *args.split()]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if " on http" not in line:
            raise SystemExit(f"minicb serve did not start: {line!r}")
        self.url, self.model = line.split(" on ", 1)[1].split()[0], "smollm2"
        self.command = "minicb serve " + args

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health", timeout=60).read())


def warm_up(url: str, model: str) -> None:
    run_load(url, model, [[5, 6, 7, 8]], [4], [0.0])


def bench_rates(targets: list[tuple[str, str, str]], rates: list[float], num: int, seed: int) -> list[dict]:
    """``targets``: (system, url, model); at each rate every target gets the same requests in turn."""
    rows = []
    for k, rate in enumerate(rates):
        prompts, outputs = w2_for_run(k, num)
        arrivals = poisson_arrivals(len(prompts), rate, seed)
        for system, url, model in targets:
            q0 = queue_time(url)
            wall0 = time.strftime("%H:%M:%S")
            recs = run_load(url, model, prompts, outputs, arrivals)
            q1 = queue_time(url)
            row = {"system": system, "rate": rate, **summarize(recs), "started": wall0,
                   "load_avg": os.getloadavg()[0]}
            dq = q1[1] - q0[1]
            row["queue_mean_ms"] = 1e3 * (q1[0] - q0[0]) / dq if dq else float("nan")
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


HEADER = (f"{'system':<8} {'rate/s':>6} {'reqs':>4} {'fail':>4} {'tokens':>6} {'secs':>6} {'tok/s':>6} "
          f"{'queue ms':>8} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>7} {'ITL p99':>7} {'e2e p50 s':>9} "
          f"{'load':>5}")


def format_row(r: dict) -> str:
    return (f"{r['system']:<8} {r['rate']:>6g} {r['requests']:>4} {r['failed']:>4} {r['tokens']:>6} "
            f"{r['seconds']:>6.1f} {r['throughput']:>6.1f} {r['queue_mean_ms']:>8.0f} "
            f"{r['ttft_p50_ms']:>8.0f} {r['ttft_p99_ms']:>8.0f} {r['itl_p50_ms']:>7.0f} "
            f"{r['itl_p99_ms']:>7.0f} {r['e2e_p50_s']:>9.1f} {r['load_avg']:>5.1f}")


# --- the live page's cost --------------------------------------------------------------------------------
class Watcher:
    """Reads /live/events as the page does, until closed; counts frames and bytes.

    A plain socket (not urllib): closing a buffered HTTP response while another thread is blocked
    reading it deadlocks on the buffer's lock; ``shutdown`` wakes the reader instead."""

    def __init__(self, url: str) -> None:
        host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
        self.frames = self.bytes = 0
        self._sock = socket.create_connection((host, port), timeout=3600)
        self._sock.sendall(f"GET /live/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while data := self._sock.recv(65536):
            self.bytes += len(data)
            self.frames += data.count(b"data: ")

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)
        self._sock.close()


def process_cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (all its threads), from /proc; NaN if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watch_overhead(url: str, model: str, num: int, repeats: int, pid: int | None = None) -> dict:
    """Alternate runs without and with a page watching; ``pid``: the server's, for its CPU time."""
    runs = []
    for k in range(2 * repeats):
        watched = k % 2 == 1
        prompts, outputs = w2_for_run(k, num)
        h0, c0 = health(url), process_cpu_seconds(pid)
        watcher = Watcher(url) if watched else None
        recs = run_load(url, model, prompts, outputs, [0.0] * len(prompts))
        if watcher is not None:
            watcher.close()
        h1, c1 = health(url), process_cpu_seconds(pid)
        s = summarize(recs)
        run = {"watched": watched, "throughput": s["throughput"], "seconds": s["seconds"],
               "tokens_per_cpu_s": s["tokens"] / (c1 - c0) if c1 > c0 else float("nan"),
               "failed": s["failed"], "engine_busy_s": h1["engine_busy_s"] - h0["engine_busy_s"],
               "listener_s": h1["live_listener_s"] - h0["live_listener_s"],
               "frame_s": h1["live_frame_s"] - h0["live_frame_s"],
               "frames": watcher.frames if watcher else 0, "load_avg": os.getloadavg()[0]}
        runs.append(run)
        print(f"{'watched' if watched else 'alone  '}  {run['throughput']:6.1f} tok/s  "
              f"{run['tokens_per_cpu_s']:6.1f} tok/CPU-s  {run['seconds']:6.1f} s  "
              f"engine busy {run['engine_busy_s']:6.1f} s  "
              f"listener {1e3 * run['listener_s']:7.1f} ms  frames {run['frames']:4d} "
              f"({1e3 * run['frame_s']:.0f} ms to build)  load {run['load_avg']:.1f}", flush=True)
    def median(key: str, watched: bool) -> float:
        return statistics.median(r[key] for r in runs if r["watched"] == watched)

    seen = [r for r in runs if r["watched"]]
    busy = sum(r["engine_busy_s"] for r in seen)
    out = {"runs": runs, "median_alone": median("throughput", False),
           "median_watched": median("throughput", True),
           "cpu_alone": median("tokens_per_cpu_s", False), "cpu_watched": median("tokens_per_cpu_s", True),
           "listener_share": sum(r["listener_s"] for r in seen) / busy,
           "frame_share": sum(r["frame_s"] for r in seen) / busy}
    print(f"median tokens/s alone {out['median_alone']:.1f}, watched {out['median_watched']:.1f} "
          f"({out['median_watched'] / out['median_alone']:.3f}); tokens per server CPU-second alone "
          f"{out['cpu_alone']:.2f}, watched {out['cpu_watched']:.2f} "
          f"({out['cpu_watched'] / out['cpu_alone']:.3f}); while watched, the engine thread spent "
          f"{100 * out['listener_share']:.2f}% of its busy time in the live listener and the event loop "
          f"{100 * out['frame_share']:.2f}% of it building frames", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--url", help="an already running OpenAI-compatible server (default: start minicb serve)")
    p.add_argument("--name", default="minicb", help="the --url server's name in the table (default: minicb)")
    p.add_argument("--model", default="smollm2", help="model name to send with --url and --peer")
    p.add_argument("--peer", help="a second server (e.g. vLLM) that gets the same requests after minicb")
    p.add_argument("--peer-name", default="peer", help="its name in the table (default: peer)")
    p.add_argument("--minicb-args", default=MINICB_ARGS,
                   help=f"flags of minicb serve (default: {MINICB_ARGS})")
    p.add_argument("--rates", default="0.25,0.5,1", help="Poisson arrival rates, requests/s, comma-separated")
    p.add_argument("--num-requests", type=int, default=64, help="W2 requests per rate (default: all 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--watch-overhead", action="store_true", help="measure the live page's cost instead")
    p.add_argument("--repeats", type=int, default=3, help="with --watch-overhead: runs of each kind")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    server = None if args.url else MinicbServer(args.minicb_args)
    url, model = (args.url, args.model) if args.url else (server.url, server.model)
    try:
        warm_up(url, model)
        result = {"server": args.url or server.command, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                  "cores": os.cpu_count()}
        if args.watch_overhead:
            pid = server.proc.pid if server is not None else None
            result["watch_overhead"] = watch_overhead(url, model, args.num_requests, args.repeats, pid)
        else:
            targets = [(args.name, url, model)]
            if args.peer:
                warm_up(args.peer, args.model)
                targets.append((args.peer_name, args.peer, args.model))
                result["peer"] = args.peer
            print(HEADER, flush=True)
            result["rows"] = bench_rates(targets, [float(r) for r in args.rates.split(",")],
                                         args.num_requests, args.seed)
    finally:
        if server is not None:
            server.close()
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=lambda o: asdict(o)))


if __name__ == "__main__":
    main()
