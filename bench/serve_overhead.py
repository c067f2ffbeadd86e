"""The server's overhead per token (issue 47, item 4): one stream through ``minicb serve`` beside the
same request stepped by ``LLM()``'s engine, alternating round by round.

    python bench/serve_overhead.py                            # bfloat16, 200 tokens, 8 rounds
    python bench/serve_overhead.py --dtype float32 --rounds 12 --out bench/out/serve_overhead.json

Both run SmolLM2 as their command builds it (``minicb serve --dtype D``; ``LLM(dtype=D)``), each in its
own process, both alive the whole time (the idle one sleeps). A round sends one request (a 64-token
prompt, ``--tokens`` new tokens, EOS ignored, greedy) to each, in an order that alternates, so a slow
spell of a shared machine, or of its memory, hits both alike. Measured the same way on both sides:

* served: a streaming ``/v1/completions`` call read line by line (``http.client``); the time per output
  token is (last chunk - first chunk) / (chunks - 1), each chunk one token;
* offline: ``LLMEngine.step()`` called in a loop, as the server's engine thread calls it; the time per
  output token is (the step that gave the last token - the one that gave the first) / (tokens - 1).

The difference is what serving a token costs beyond computing it: the engine thread's hand-over
(``call_soon_threadsafe``), the event loop's work (detokenizing, stop strings, the chunk's JSON, h11,
the socket), and what that work takes from the compute threads on a machine whose cores the forward
already uses. Printed per round and as the median and range of the rounds' differences (the issue's
bar: under 1 ms), with two figures from inside the server: its main thread's (the event loop's) CPU
time per token (``/proc/PID/task``: the server's own work, whatever the contention), and the time
per token outside ``engine.step()`` (the served time per token less ``/health``'s ``engine_busy_s``
over its ``num_steps``, the prompt's step included): what the engine thread spends between steps.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.parse

from common import cpu_header

from serve import MinicbServer, health

PROMPT = list(range(1000, 1064))

OFFLINE = """
import json, sys, time
from minicb import LLM, SamplingParams
eng = LLM(dtype=sys.argv[1]).engine
sp = SamplingParams(max_tokens=int(sys.argv[2]), ignore_eos=True, temperature=0)
print("ready", flush=True)
for k, line in enumerate(sys.stdin):
    eng.add_request(f"r{k}", PROMPT, sp)
    times = []
    while eng.has_unfinished_requests():
        if any(c.new_token_ids for o in eng.step() for c in o.outputs):
            times.append(time.perf_counter())
    print(json.dumps(times), flush=True)
""".replace("PROMPT", repr(PROMPT))


def per_token_ms(times: list[float]) -> float:
    """The mean gap between consecutive tokens' arrival times, in ms (the first token's wait excluded)."""
    if len(times) < 2:
        raise ValueError(f"need two tokens' times to measure a gap, got {len(times)}")
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def sse_token_times(lines, clock=time.perf_counter) -> list[float]:
    """The arrival time of each ``data: {...}`` line of a server-sent event stream (``[DONE]`` and
    blank lines are not tokens)."""
    return [clock() for line in lines if line.startswith(b"data: {")]


def main_thread_cpu_ticks(pid: int) -> int:
    """User + system clock ticks so far of process ``pid``'s main thread (its task id is the pid):
    ``minicb serve``'s event loop, which runs uvicorn, detokenizes and writes the chunks."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()           # the name, in brackets, may hold spaces
    return int(fields[11]) + int(fields[12])


def served(url: str, model: str, tokens: int) -> list[float]:
    u = urllib.parse.urlsplit(url)
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"the server answered {resp.status}: {resp.read()[:300]!r}")
    times = sse_token_times(iter(resp.readline, b""))
    conn.close()
    if len(times) != tokens:
        raise SystemExit(f"expected {tokens} chunks of one token each, got {len(times)}")
    return times


def summary(rows: list[dict]) -> dict:
    """Medians of the rounds, and the range of the paired differences."""
    diffs = [r["served_ms"] - r["offline_ms"] for r in rows]
    return {"served_ms": statistics.median(r["served_ms"] for r in rows),
            "offline_ms": statistics.median(r["offline_ms"] for r in rows),
            "overhead_ms": statistics.median(diffs), "overhead_min_ms": min(diffs),
            "overhead_max_ms": max(diffs),
            "event_loop_cpu_ms": statistics.median(r["event_loop_cpu_ms"] for r in rows),
            "between_steps_ms": statistics.median(r["between_steps_ms"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", help="write the rounds and the summary here (JSON)")
    args = ap.parse_args()
    print(cpu_header(), f"; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", sep="", flush=True)
    offline = subprocess.Popen([sys.executable, "-c", OFFLINE, args.dtype, str(args.tokens)], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    server = None
    try:
        if offline.stdout.readline().strip() != "ready":
            raise SystemExit("the offline engine did not start")
        server = MinicbServer(f"--dtype {args.dtype}")
        tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")

        def run_offline() -> list[float]:
            offline.stdin.write("go\n")
            offline.stdin.flush()
            return json.loads(offline.stdout.readline())

        def run_served() -> tuple[list[float], float, float]:
            h0, t0 = health(server.url), main_thread_cpu_ticks(server.proc.pid)
            times = served(server.url, server.model, args.tokens)
            cpu = (main_thread_cpu_ticks(server.proc.pid) - t0) * tick_ms / args.tokens
            h1 = health(server.url)
            step_ms = 1e3 * (h1["engine_busy_s"] - h0["engine_busy_s"]) / (h1["num_steps"] - h0["num_steps"])
            return times, cpu, per_token_ms(times) - step_ms

        run_offline(), run_served()                           # warm both (kernels, caches, pages)
        rows = []
        print(f"{args.dtype}, {args.tokens} tokens a request; ms per output token", flush=True)
        for k in range(args.rounds):
            if k % 2:
                off = run_offline()
                srv, loop_cpu, between = run_served()
            else:
                srv, loop_cpu, between = run_served()
                off = run_offline()
            row = {"served_ms": per_token_ms(srv), "offline_ms": per_token_ms(off),
                   "event_loop_cpu_ms": loop_cpu, "between_steps_ms": between, "load_avg": os.getloadavg()[0]}
            rows.append(row)
            print(f"round {k}: served {row['served_ms']:.2f}  offline {row['offline_ms']:.2f}  overhead "
                  f"{row['served_ms'] - row['offline_ms']:+.2f}  (event loop CPU {loop_cpu:.2f}, between "
                  f"steps {between:.2f})", flush=True)
        s = summary(rows)
        print(f"median: served {s['served_ms']:.2f}, offline {s['offline_ms']:.2f}; the server's overhead "
              f"{s['overhead_ms']:+.2f} ms per token [{s['overhead_min_ms']:+.2f}, "
              f"{s['overhead_max_ms']:+.2f}]; event loop CPU {s['event_loop_cpu_ms']:.2f} ms per token; "
              f"between steps {s['between_steps_ms']:.2f} ms per token")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"cpu": cpu_header(), "dtype": args.dtype, "tokens": args.tokens, "rounds": rows,
                           "summary": s}, f, indent=1)
    finally:
        offline.stdin.close()
        offline.terminate()
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
