"""``minicb serve`` as a command: a real process, its CPU time when idle, and its shutdown.

* An idle server sleeps: over 5 s its whole process (engine thread, event loop, torch's threads) uses
  next to no CPU time (read from ``/proc/<pid>/stat``).
* SIGTERM with requests in flight: new requests are refused, the running ones that can finish within
  ``--shutdown-timeout`` finish, the one that cannot is aborted (its stream ends with
  ``finish_reason: "abort"`` and ``[DONE]``), and the process exits 0. Ctrl-C (SIGINT) too.
* Mistakes on the command line are one line on stderr and exit code 2, before any model loads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from minicb.entrypoints.cli import EXIT_USAGE, main
from preconditions import unavailable
from serve_helpers import MODEL, client, http, wait_for
from tiny_files import write_gguf

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")

@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("serve-proc") / "tiny.gguf")


class ServeProcess:
    def __init__(self, gguf, *flags: str) -> None:
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minicb", "serve", "--model", str(gguf), "--served-model-name", MODEL,
             "--dtype", "float64", "--port", "0", "--threads", "1", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()             # "minicb serve: tiny on http://127.0.0.1:PORT ..."
        assert " on http://" in line, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.url = line.split(" on ", 1)[1].split()[0]
        self.lines: list[str] = []

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime

    def finish(self, timeout: float) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def serve(gguf):
    started = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(gguf, *flags))
        return started[-1]

    yield start
    for p in started:
        p.kill()


@pytest.mark.timing
@pytest.mark.slow
def test_an_idle_server_uses_no_cpu_and_ctrl_c_exits_0(serve):
    if not os.path.exists("/proc/self/stat"):
        unavailable("the idle-CPU check reads a process's CPU time from /proc (Linux)")
    p = serve()
    r = client(p.url).completions.create(model=MODEL, prompt=[5, 6], max_tokens=8)   # warm everything
    assert r.usage.completion_tokens >= 1
    time.sleep(1.0)
    t0, c0 = time.monotonic(), p.cpu_seconds()
    time.sleep(5.0)
    used, wall = p.cpu_seconds() - c0, time.monotonic() - t0
    print(f"idle server: {used:.3f} s of CPU in {wall:.1f} s")
    # load-independent: CPU seconds of an idle process, which load does not add to
    assert used <= 0.05, f"an idle server used {used:.3f} s of CPU in {wall:.1f} s"
    p.proc.send_signal(signal.SIGINT)
    rc, out, err = p.finish(timeout=60)      # a hang guard: an idle server stops in well under a second
    assert rc == 0, err
    assert "minicb serve: stopped" in out and "Traceback" not in err


@pytest.mark.timing
@pytest.mark.slow
def test_sigterm_finishes_running_requests_aborts_the_rest_and_exits_0(serve):
    p = serve("--shutdown-timeout", "2", "--max-num-seqs", "4")
    results: dict[str, dict] = {}
    # SIGTERM goes once the short ones are within a few tokens of their end (and the long one has
    # started): what they have left is then a handful of steps, which the 2 s window holds on however
    # busy a machine; 40 and 60 tokens from the start did not always fit it under load
    jobs = (("short1", 40, 37), ("short2", 60, 55), ("long", 4000, 1))
    ready = {k: threading.Event() for k, _, _ in jobs}

    def stream(key: str, max_tokens: int, ready_at: int) -> None:
        got = results[key] = {"chunks": 0, "reason": None}
        for chunk in client(p.url).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True}):
            got["chunks"] += 1
            got["reason"] = chunk.choices[0].finish_reason or got["reason"]
            if got["chunks"] >= ready_at:
                ready[key].set()
        ready[key].set()

    threads = [threading.Thread(target=stream, args=job) for job in jobs]
    for t in threads:
        t.start()
    for e in ready.values():
        assert e.wait(60)  # load-independent: a hang guard; 60 tokens of the tiny model take a second
    t0 = time.monotonic()
    chunks_at_sigterm = results["long"]["chunks"]
    p.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _refused(p.url), timeout=30, what="new requests refused")
    for t in threads:
        t.join(timeout=30)
    rc, out, err = p.finish(timeout=30)
    took = time.monotonic() - t0
    assert rc == 0, err
    assert results["short1"]["reason"] == results["short2"]["reason"] == "length"
    assert results["long"]["reason"] == "abort" and results["long"]["chunks"] < 4000
    # The long one ran until the 2 s shutdown timeout and was then cut: it streamed after SIGTERM, it
    # did not reach its 4000 tokens, and the server took at least the timeout to stop (a lower bound:
    # a busy machine can only make it longer; no upper bound on wall time, which is the machine's).
    assert results["long"]["chunks"] > chunks_at_sigterm
    assert took >= 1.5, took  # load-independent: a lower bound on a wait (load only lengthens it)
    assert "Traceback" not in err


def _refused(url: str) -> bool:
    """A 503, or the listening socket closed. No answer within the probe's hang guard is not a refusal
    (a busy machine can be slow to answer): it is asked again."""
    try:
        status, _, _ = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "x"}, timeout=30)
    except OSError as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            return False                              # no answer yet: slow, not refused
        return True                                   # the listening socket is closed
    return status == 503


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["serve", "--max-waiting", "-1"], "--max-waiting must be in [0, inf], got -1"),
    (["serve", "--shutdown-timeout", "-2"], "--shutdown-timeout must be >= 0 seconds"),
    (["serve", "--threads", "-1"], "--threads must be in [0, inf]"),
    (["serve", "--kv-cache-memory", "-1"], "--kv-cache-memory must be a positive number of GiB"),
    (["serve", "--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid:8000"),
    (["serve", "--max-json-depth", "0"], "--max-json-depth must be in [1, 256], got 0"),
    (["serve", "--max-header-bytes", "10"], "--max-header-bytes must be in [1024, inf], got 10"),
    (["serve", "--max-frontend-queue", "0"], "--max-frontend-queue must be in [1, inf], got 0"),
    (["serve", "--body-linger", "-1"], "--body-linger must be"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("minicb: error: ") and needle in err, err


@pytest.mark.timing
def test_a_port_in_use_is_one_line_and_exit_2_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/nonexistent.gguf"]) == EXIT_USAGE
    err = capsys.readouterr().err
    # before the model loads: the model does not exist, so loading it first would have said so instead
    assert err == f"minicb: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def _sse_ends(url: str, body: dict, out: list, go) -> None:
    """Read one stream to its end: append (last data event, saw [DONE])."""
    import http.client
    import json

    host, port = url.removeprefix("http://").rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    last, done = None, False
    try:
        for line in r:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                last = json.loads(line[6:])
                go.set()
    except OSError:
        pass
    out.append((last, done))


@pytest.mark.slow
def test_a_second_ctrl_c_ends_every_stream_with_a_final_chunk_and_exits_130(serve):
    """Ctrl-C twice while three streams and one non-stream request run: the second aborts them all
    at once, yet every stream still ends with a final chunk (finish_reason "abort") and [DONE], the
    non-stream client gets OpenAI's error object (503), no traceback, exit code 130, and the process
    is gone right after it says "stopped" (no interpreter teardown)."""
    p = serve("--shutdown-timeout", "30")
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    ends: list = []
    started = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=_sse_ends, args=(p.url, body, ends, e)) for e in started]
    whole: list = []
    threads.append(threading.Thread(target=lambda: whole.append(http(
        "POST", p.url + "/v1/completions", {**body, "stream": False}, timeout=60))))
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30)  # load-independent: a hang guard; a stream's first chunk takes milliseconds
    p.proc.send_signal(signal.SIGINT)
    wait_for(lambda: _refused(p.url), what="the drain begun")
    p.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(30)
    rc, out, err = p.finish(timeout=30)
    assert rc == 130, (rc, err)
    assert "minicb serve: stopped (interrupted again" in out and "Traceback" not in err, (out, err)
    assert len(ends) == 3 and all(done for _, done in ends), ends
    assert all(last["choices"][0]["finish_reason"] == "abort" for last, _ in ends), ends
    status, _, got = whole[0]
    assert status == 503 and got["error"]["code"] == "server_shutting_down", got


@pytest.mark.slow
def test_an_abuse_replay_leaves_the_server_small_and_responsive(serve):
    """The issue's probes replayed against a real process (loopback, a few seconds): 4 stop strings
    of 30,000 characters, a 100 MB body, 2M token ids, JSON 100,000 deep, 100K messages, silent and
    slowloris connections. Each is refused; the server's RSS (/proc/<pid>/status) grows by less than
    64 MiB (the stop strings alone took 1.6 GB before), and it still answers exactly afterwards."""
    import json

    if not os.path.exists("/proc/self/status"):
        unavailable("the RSS check reads /proc/<pid>/status (Linux)")
    # 5 s for a request's head and body: the silent and slowloris connections below are closed after
    # them; the probes' bodies (at most 100 MB, refused on their Content-Length; the largest read, a few
    # MB) cross loopback in milliseconds, so a busy machine leaves them far inside it (with 1 s, a
    # probe's body could be cut off by the timeout on a loaded machine and answered 408)
    p = serve("--header-timeout", "5", "--body-timeout", "5")

    def rss() -> int:
        with open(f"/proc/{p.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024

    first = client(p.url).completions.create(model=MODEL, prompt=[5, 6], max_tokens=4, temperature=0)
    before = rss()
    probes = [
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "stop": ["ab" * 15_000] * 4}).encode(),
         400),
        ("/v1/completions", b'{"prompt": "' + b"a" * 100_000_000 + b'"}', 413),
        ("/v1/completions", json.dumps({"prompt": [1] * 2_000_000}).encode(), 413),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}] * 100_000})
         .encode(), 413),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}] * 5_000})
         .encode(), 400),
    ]
    for path, raw, want in probes:
        try:
            status, _, got = http("POST", p.url + path, raw=raw, timeout=60)
        except OSError:                     # the server closed while a huge body was still being sent
            status, got = 413, {"error": {"message": "(closed)"}}
        assert status == want, (path, status, got)
    conns = [socket.create_connection(p.url.removeprefix("http://").rsplit(":", 1)) for _ in range(20)]
    for s in conns[10:]:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 999\r\n\r\n{")
    for s in conns:
        s.settimeout(60)                     # a hang guard: the server closes them after its 5 s timeouts
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        s.close()                            # each closed by the server (a timeout here would raise)
    grew = rss() - before
    assert grew < 64 * 2**20, f"RSS grew by {grew / 2**20:.0f} MiB"
    again = client(p.url).completions.create(model=MODEL, prompt=[5, 6], max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    p.proc.send_signal(signal.SIGTERM)
    rc, out, err = p.finish(timeout=30)
    assert rc == 0 and "Traceback" not in err, err


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (``/proc/<pid>/task/*/children``, Linux)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:                           # it has exited
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _tree(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    found, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            found.append(c)
            todo.append(c)
    return found


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_real_engine_failure_ends_every_request_with_a_503_and_exits_1(serve):
    """A real internal failure, nothing injected: the server runs the model on two tensor-parallel
    ranks (``--tp 2``) and rank 1's process is killed (SIGKILL) while a stream and a non-stream
    request run. Rank 0's next all-reduce fails, the step raises ``DistributedError``, the engine is
    dead: the stream ends with OpenAI's error object (``engine_dead``, the reason) and ``[DONE]``, the
    non-stream client gets that error object with a 503, ``/health`` answers 503 (or nothing, once the
    server has stopped listening), and the process exits with code 1 saying why."""
    if not os.path.exists("/proc/self/task"):
        unavailable("finding the rank's process reads /proc (Linux)")
    p = serve("--tp", "2", "--frontend-workers", "1", "--shutdown-timeout", "30")
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    ends: list = []
    go = threading.Event()
    threads = [threading.Thread(target=_sse_ends, args=(p.url, body, ends, go))]
    whole: list = []
    threads.append(threading.Thread(target=lambda: whole.append(http(
        "POST", p.url + "/v1/completions", {**body, "stream": False}, timeout=60))))
    for t in threads:
        t.start()
    assert go.wait(60)  # load-independent: a hang guard; a stream's first chunk takes milliseconds
    wait_for(lambda: http("GET", p.url + "/health")[2].get("num_requests_running") == 2, timeout=30,
             what="both requests running")
    # rank 1 is a process forked by multiprocessing's fork server, as the frontend's workers are;
    # those run at nice +10 (frontend.WORKER_NICE), the rank at the server's own priority
    ranks = [c for c in _tree(p.proc.pid) if _nice(c) == _nice(p.proc.pid)
             and "forkserver" in open(f"/proc/{c}/cmdline").read() and c not in _children(p.proc.pid)]
    assert len(ranks) == 1, [(c, _nice(c)) for c in _tree(p.proc.pid)]
    health: list = []

    def poll() -> None:                       # /health, as often as it answers, until it does not
        while True:
            try:
                status, _, got = http("GET", p.url + "/health", timeout=30)   # a hang guard
            except OSError as e:
                health.append((None, e))      # no answer: the server stopped listening
                return
            health.append((status, got))
            if status != 200:
                return

    poller = threading.Thread(target=poll)
    poller.start()
    family = _tree(p.proc.pid)                # the fork server, its children, multiprocessing's tracker
    os.kill(ranks[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
    poller.join(60)
    rc, out, err = p.finish(timeout=60)
    assert rc == 1, (rc, err[-2000:])
    assert "minicb serve: the engine failed: DistributedError" in err
    assert "minicb serve: stopped (the engine died)" in out, out
    (last, done), = ends
    assert done and last["error"]["code"] == "engine_dead", last
    assert "DistributedError" in last["error"]["message"], last
    status, _, got = whole[0]
    assert status == 503 and got["error"]["code"] == "engine_dead" and "DistributedError" in \
        got["error"]["message"], (status, got)
    # /health: 200 until the engine's death, then a 503 saying so, or no answer at all once uvicorn has
    # stopped listening. A 503 can be seen only until uvicorn's next tick (0.1 s) closes the listening
    # socket, and a busy machine can keep the poller from asking in that window, so either end is
    # accepted here; test_serve_hostile's dead-engine test keeps the server up and asserts the 503.
    *before, (status, got) = health
    # an "ok" counts both requests as running: never a dead engine's empty counts (test_serve_hostile's
    # test_health_asked_while_the_fatal_step_runs_says_503_not_the_dead_engines_counts pins that race)
    assert all(s == 200 and g["num_requests_running"] == 2 for s, g in before), health[-3:]
    assert status in (503, None), health[-3:]
    if status == 503:
        assert "engine" in got["error"]["message"] and "DistributedError" in got["error"]["message"], got
    wait_for(lambda: not any(_alive(c) for c in family), what="no process left behind")


@pytest.mark.slow
def test_the_frontend_workers_end_with_the_server_even_when_it_is_killed(serve):
    """The worker processes that parse and tokenize requests: gone when the server stops (SIGTERM),
    and gone by themselves when the server's process is killed (SIGKILL: nobody shut them down)."""
    if not os.path.exists("/proc/self/task"):
        unavailable("finding the worker processes reads /proc (Linux)")
    for how in (signal.SIGTERM, signal.SIGKILL):
        p = serve("--frontend-workers", "2")
        r = client(p.url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
        assert r.usage.completion_tokens >= 1
        workers = [c for c in _tree(p.proc.pid) if _nice(c) > _nice(p.proc.pid)]
        assert len(workers) == 2, [(c, _nice(c)) for c in _tree(p.proc.pid)]
        p.proc.send_signal(how)
        p.proc.wait(30)
        wait_for(lambda ws=workers: not any(_alive(w) for w in ws), what=f"the workers gone ({how!r})")
        p.finish(timeout=30)
