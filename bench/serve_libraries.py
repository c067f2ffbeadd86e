"""Each hand-written piece of ``minicb serve`` beside the library way of doing its job, in one run.

    python bench/serve_libraries.py                   # all five
    python bench/serve_libraries.py --only stops host # some of them (pool, detok, host, head, stops)

pool   frontend.py's worker processes vs the same ``Preparer.prepare`` in threads (anyio's, as
       Starlette's ``run_in_threadpool``, ``--frontend-workers`` at once): an innocent stream's
       longest and median gap between chunks, in steps
       (each step given a real model's 20 ms, a GIL-free sleep; the time the server's threads waited
       for a CPU taken off each gap, as ``test_serve_hostile.py`` does), while another process keeps
       four clients sending a 20,000-message chat (``--messages``), a 200,000-character prompt and the
       hostile test's loads; the sides alternate (pool, thread, pool, ...) on the tiny GGUF of the
       tests; thread-any: anyio's default pool (40 threads: every request in the frontend runs at
       once); thread-si: threads with ``sys.setswitchinterval(0.0005)`` (the GIL handed over every
       0.5 ms, not 5).
detok  the tokenizer's ``IncrementalDecoder`` vs ``tokenizers.decoders.DecodeStream``: how many of a
       set of id sequences each turns into a text other than ``tokenizer.decode(ids)``.
host   guard.py's Host check vs Starlette's ``TrustedHostMiddleware``: each one's answer per Host.
head   server.py's ``_DeadlineH11`` vs plain uvicorn (``http="h11"``): of 4 slowloris connections
       (a byte of head every 0.25 s) and 4 silent ones, how many are closed after 3 s (deadline 1 s).
stops  stops.py's KMP matcher vs ``str.find`` over held + new text (the minimal hold-back found by
       trying the longest candidate suffixes; or vLLM's fixed hold-back of the longest stop less one
       character): chunks that differ over random chunkings, and the time on 4 stops of 30,000.

Timings are wall clock on whatever machine runs it: compare the two sides of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests/serve")]

from common import cpu_model  # noqa: E402

STEP_S = 0.02


def gguf() -> pathlib.Path:
    from tiny_files import write_gguf

    return write_gguf(pathlib.Path(tempfile.mkdtemp()) / "tiny.gguf")


# --- pool ---------------------------------------------------------------------------------------------
def one_pool_run(path, mode: str, loads_file: str, messages: int) -> tuple:
    import anyio
    import anyio.to_thread
    from test_serve_hostile import _kept_s, _sse_times  # the pinned test's reader and CPU-wait gauge

    from minicb.entrypoints.serve.limits import ServeLimits
    from serve_helpers import running_server

    steps: list[float] = []
    busy: list[int] = []                      # requests in the frontend at each step
    box: dict = {}

    def hook(engine):
        inner = engine.step

        def slow_step():
            t0 = time.perf_counter()
            time.sleep(STEP_S)
            out = inner()
            steps.append(time.perf_counter() - t0)
            busy.append(box["frontend"].queued if box else 0)
            return out
        engine.step = slow_step

    with running_server(path, engine_hook=hook, max_num_seqs=4, num_blocks=256, block_size=4,
                        max_num_batched_tokens=32, max_prefill_tokens_while_decoding=0,
                        limits=ServeLimits(max_messages=max(1024, messages), max_prompt_chars=400_000)
                        ) as (server, url):
        frontend = box["frontend"] = server.frontend
        if mode.startswith("thread"):         # the library way: the same work in anyio's threads (as
            frontend.local.warm()             # Starlette's run_in_threadpool), --frontend-workers at once
            limiter = None if mode == "thread-any" else anyio.CapacityLimiter(frontend.workers)

            async def prepare(kind, raw):
                frontend.queued += 1
                try:
                    return await anyio.to_thread.run_sync(frontend.local.prepare, kind, raw, limiter=limiter)
                finally:
                    frontend.queued -= 1
            frontend.prepare = prepare
        flood = subprocess.Popen([sys.executable, str(ROOT / "tests/flood_client.py"), url, loads_file, "4"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            flood.stdout.readline()
            while frontend.queued < 2:        # large requests are being prepared
                time.sleep(0.01)
            first = len(steps)
            tids = [server.engine_thread._thread.native_id, server._thread.native_id,
                    threading.get_native_id()]
            chunks = _sse_times(url, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 80, "stream": True,
                                      "temperature": 0, "ignore_eos": True}, tids)
            step = statistics.median(steps[first:])
        finally:
            flood.communicate("", timeout=300)
    raw = [b - a for (a, _), (b, _) in zip(chunks, chunks[1:])]
    gaps = [g - (_kept_s(wa, wb) or 0.0) for g, (_, wa), (_, wb) in zip(raw, chunks, chunks[1:])]
    return (max(gaps) / step, statistics.median(gaps) / step, max(raw) / step, statistics.mean(busy[first:]),
            step, max(gaps))


def pool(rounds: int, modes: list[str], messages: int) -> None:
    path = gguf()
    loads = [("/v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                                       "messages": [{"role": "user", "content": "hello there"}] * messages}),
             ("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": "word " * 40_000}),
             ("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": "word " * 60}),
             ("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": [7] * 300}),
             ("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": "word " * 480}),
             ("/v1/completions", {"model": "tiny", "max_tokens": 4, "prompt": [5],
                                  "stop": [f"{i:x}" * 256 for i in range(16)]})]
    loads_file = os.path.join(tempfile.mkdtemp(), "loads.json")
    pathlib.Path(loads_file).write_text(json.dumps(loads))
    got: dict[str, list] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes:
            if mode == "thread-si":           # a thread that holds the GIL is made to yield it every 0.5 ms
                sys.setswitchinterval(0.0005)
            try:
                longest, median, raw, busy, step, gap = one_pool_run(path, mode, loads_file, messages)
            finally:
                sys.setswitchinterval(0.005)
            got[mode].append((longest, median, step))
            print(f"  round {r + 1} {mode:10}: step {step * 1e3:5.1f} ms; longest gap {gap * 1e3:6.1f} ms "
                  f"= {longest:5.2f} steps, median {median:4.2f} (raw longest {raw:5.2f}; {busy:.1f} "
                  "requests in the frontend per step)", flush=True)
    for mode, runs in got.items():
        steps, longest = [z * 1e3 for *_, z in runs], [x for x, *_ in runs]
        print(f"pool: {mode:10} median step {statistics.median(steps):5.1f} ms (the engine's pace; 20 ms "
              f"of it the model's), longest gap {statistics.median(longest):.2f} steps "
              f"(range {min(longest):.2f}-{max(longest):.2f})")


# --- detok --------------------------------------------------------------------------------------------
def detok() -> None:
    from tokenizers.decoders import DecodeStream

    from minicb.model.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf())
    rng = random.Random(0)
    seqs = [tok.encode(t)[:cut] for t in ("héllo 😀 wörld \u0663 ok", "naïve café — 日本語 ✓")
            for cut in range(1, len(tok.encode(t)) + 1)]
    seqs += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(300)]
    ours = theirs = 0
    for ids in seqs:
        want = tok.decode(ids)
        ours += tok.incremental_decoder().push_many(ids, final=True) != want
        stream = DecodeStream(skip_special_tokens=True)
        try:
            theirs += "".join(x for t in ids if (x := stream.step(tok._tk, t)) is not None) != want
        except Exception:   # noqa: BLE001 - an id sequence it cannot decode differs too
            theirs += 1
    print(f"detok: of {len(seqs)} id sequences, text != decode(ids): IncrementalDecoder {ours}, "
          f"DecodeStream {theirs}")


# --- host ---------------------------------------------------------------------------------------------
async def _ask(app, host: str | None) -> str:
    scope = {"type": "http", "method": "GET", "path": "/", "raw_path": b"/", "query_string": b"",
             "headers": [] if host is None else [(b"host", host.encode())], "http_version": "1.1",
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1), "root_path": ""}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m):
        sent.append(m)
    await app(scope, receive, send)
    headers = dict(sent[0]["headers"])
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    where = headers.get(b"location", b"").decode()
    return f"{sent[0]['status']} {where or body[:48]}"


def host() -> None:
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import PlainTextResponse

    from minicb.entrypoints.serve import guard

    ok = PlainTextResponse("ok")
    names = ("127.0.0.1", "localhost", "::1", "www.example.com")
    ours = guard.wrap(ok, allowed_hosts=names, api_key=None)
    theirs = TrustedHostMiddleware(ok, allowed_hosts=[f"[{h}]" if ":" in h else h for h in names])
    print(f"host: allowed {', '.join(names)}")
    for h in ("127.0.0.1:8000", "LOCALHOST", "[::1]:8000", "evil.example", "example.com", None):
        mine, theirs_ = asyncio.run(_ask(ours, h)), asyncio.run(_ask(theirs, h))
        print(f"  Host {h!s:16} minicb: {mine:60} Starlette: {theirs_}")


# --- head ---------------------------------------------------------------------------------------------
def head() -> None:
    import uvicorn
    from starlette.responses import PlainTextResponse

    from minicb.entrypoints.serve.server import _DeadlineH11

    ours = type("H", (_DeadlineH11,), {"header_timeout": 1.0})
    for name, proto in (("uvicorn h11", "h11"), ("minicb _DeadlineH11", ours)):
        sock = socket.create_server(("127.0.0.1", 0))
        srv = uvicorn.Server(uvicorn.Config(PlainTextResponse("ok"), http=proto, lifespan="off",
                                            log_level="warning", timeout_keep_alive=1))
        t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
        t.start()
        while not srv.started:
            time.sleep(0.01)
        port = sock.getsockname()[1]
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        line = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100
        end = time.monotonic() + 3.0
        for i in range(len(line)):
            if time.monotonic() > end:
                break
            for s in slow:
                with contextlib.suppress(OSError):
                    s.send(line[i:i + 1])
            time.sleep(0.25)

        def closed(s) -> bool:
            if not select.select([s], [], [], 0.05)[0]:
                return False
            try:
                return s.recv(65536) == b""
            except OSError:
                return True
        print(f"head: {name:20} closed after 3 s: slowloris {sum(map(closed, slow))}/4, "
              f"silent {sum(map(closed, silent))}/4")
        for s in slow + silent:
            s.close()
        srv.should_exit = True
        t.join(10)


# --- stops --------------------------------------------------------------------------------------------
class FindStops:
    """The simplest alternative: ``str.find`` over held + new text. Hold-back ``minimal`` (the longest
    suffix that is a prefix of a stop, tried longest first) or
    vLLM's fixed one (the longest stop less one character)."""

    def __init__(self, stops, minimal: bool = True) -> None:
        self.stops, self.minimal = tuple(s for s in stops if s), minimal
        self.longest = max(map(len, self.stops), default=0)
        self.held, self.keep, self.stopped = "", 0, False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        base, buf = len(self.held), self.held + text
        spans = [(i, i + len(s)) for s in self.stops if (i := buf.find(s, max(0, base - len(s) + 1))) >= 0]
        if spans:
            self.stopped, self.held = True, ""
            return buf[:min(spans)[0]]
        if self.minimal:
            self.keep = max((next((k for k in range(min(len(buf), len(s) - 1), 0, -1)
                                   if buf.endswith(s[:k])), 0) for s in self.stops), default=0)
        else:
            self.keep = min(len(buf), max(0, self.longest - 1))
        self.held = buf[len(buf) - self.keep:]
        return buf[:len(buf) - self.keep]

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def _sent(m, chunks) -> list[str]:
    out = []
    for c in chunks:
        out.append(m.push(c))
        if m.stopped:
            return out
    return out + [m.flush()]


def stops() -> None:
    from minicb.entrypoints.serve.stops import StopMatcher

    rng = random.Random(0)
    runs, chunk_diff, text_diff = 3000, {True: 0, False: 0}, {True: 0, False: 0}
    for _ in range(runs):
        ss = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        chunks = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 5)))
                  for _ in range(rng.randint(0, 12))]
        want = _sent(StopMatcher(tuple(ss)), chunks)
        for minimal in (True, False):
            got = _sent(FindStops(ss, minimal), chunks)
            chunk_diff[minimal] += got != want
            text_diff[minimal] += "".join(got) != "".join(want)
    print(f"stops: {runs} random chunkings, chunks sent != KMP's (final text !=): find minimal "
          f"{chunk_diff[True]} ({text_diff[True]}), find fixed hold-back {chunk_diff[False]} "
          f"({text_diff[False]})")
    long_stops = tuple(("ab" * 15_000)[:-1] + c for c in "abcd")
    feed = ["ab" * 50] * 200 + ["x"] + ["ab" * 50] * 50       # 20,000 held, dropped, held again
    for name, make in (("KMP", lambda: StopMatcher(long_stops)),
                       ("find minimal", lambda: FindStops(long_stops)),
                       ("find fixed", lambda: FindStops(long_stops, False))):
        m, worst, t0 = make(), 0.0, time.perf_counter()
        for c in feed:
            t = time.perf_counter()
            m.push(c)
            worst = max(worst, time.perf_counter() - t)
        print(f"  4 stops x 30,000: {name:13} {len(feed)} pushes {(time.perf_counter() - t0) * 1e3:8.1f} ms, "
              f"worst push {worst * 1e3:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=["detok", "host", "stops", "head", "pool"])
    ap.add_argument("--rounds", type=int, default=3, help="pool: runs of each side, alternating")
    ap.add_argument("--messages", type=int, default=20_000,
                    help="pool: messages of the flood's chat (default: the hostile test's)")
    ap.add_argument("--modes", nargs="*", default=["pool", "thread", "thread-any", "thread-si"],
                    help="pool: the sides to compare (see above)")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores (timings: wall clock, the machine as it is)")
    for name in args.only:
        pool(args.rounds, args.modes, args.messages) if name == "pool" else globals()[name]()


if __name__ == "__main__":
    main()
