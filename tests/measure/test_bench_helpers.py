"""The arithmetic of the benchmark scripts (bench/), which the figures in bench/RESULTS.md rest on."""

import importlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from helpers import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bench_modules(*names: str) -> list:
    """The named scripts of bench/, imported as modules (bench/ is on the path only meanwhile)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture(scope="module")
def bench():
    forward, throughput = bench_modules("forward", "throughput")
    return forward, throughput


@pytest.fixture(scope="module")
def breakdown():
    breakdown, workloads = bench_modules("breakdown", "workloads")
    return breakdown, workloads.Workload


def test_median_run_is_the_middle_run_and_keeps_every_run(bench):
    _, throughput = bench
    runs = [{"seconds": 3.0, "tokens": 30}, {"seconds": 1.0, "tokens": 30}, {"seconds": 2.0, "tokens": 30}]
    mid = throughput.median_run(runs)
    assert mid["seconds"] == 2.0  # load-independent: fixed numbers fed to the helper
    # load-independent: fixed numbers fed to the helper
    assert mid["runs_seconds"] == [3.0, 1.0, 2.0]                 # in the order they ran
    assert mid["runs_tokens_per_s"] == [10.0, 30.0, 15.0]  # load-independent: fixed numbers
    # load-independent: fixed numbers
    assert "runs_seconds" not in runs[2]                           # the inputs are left alone
    even = throughput.median_run([{"seconds": s, "tokens": 1} for s in (4.0, 1.0, 3.0, 2.0)])
    # load-independent: fixed numbers fed to the helper
    assert even["seconds"] == 2.0                                  # the lower middle of an even count
    # load-independent: fixed numbers fed to the helper
    assert throughput.median_run([{"seconds": 5.0, "tokens": 1}])["seconds"] == 5.0


def test_fit_line_recovers_a_line_and_measures_the_misfit(bench):
    forward, _ = bench
    a, b, worst = forward.fit_line({16: 0.04 + 16 * 0.002, 32: 0.04 + 32 * 0.002, 64: 0.04 + 64 * 0.002})
    assert a == pytest.approx(0.04) and b == pytest.approx(0.002) and worst == pytest.approx(0, abs=1e-12)
    a, b, worst = forward.fit_line({0: 1.0, 1: 3.0, 2: 3.0})     # least squares: y = 4/3 + x
    assert a == pytest.approx(4 / 3) and b == pytest.approx(1.0)
    assert worst == pytest.approx((4 / 3 - 1) / 1.0)              # the point at x = 0 is off by 1/3


def test_layer_matmul_sweep_counts_every_layer_weight(bench):
    forward, _ = bench
    model = tiny_model()
    sweep = forward.layer_matmul_sweep(model, rows=(2, 4, 8), repeats=1)
    cfg = model.config
    per_layer = sum(p.numel() for name, p in model.model.layers[0].named_parameters()
                    if "proj" in name)
    assert sweep["flops_per_row"] == 2.0 * per_layer * cfg.num_hidden_layers
    assert sweep["weight_bytes"] == per_layer * cfg.num_hidden_layers * model.dtype.itemsize
    # load-independent: measured times only asked to be > 0
    assert set(sweep["rows"]) == {"2", "4", "8"} and all(t > 0 for t in sweep["rows"].values())
    a, b = sweep["a_s"], sweep["b_s_per_row"]
    # load-independent: a least-squares identity
    assert sum(sweep["rows"].values()) == pytest.approx(sum(a + b * m for m in (2, 4, 8)))


@pytest.mark.parametrize("backend", ["reference", "cpu-paged"])
def test_breakdown_attributes_decode_attention_to_the_backend_that_did_it(breakdown, backend):
    """bench/breakdown.py's parts: the C kernel's time is found under ``kernel`` with cpu-paged, and
    the reference backend's decode attention under ``gather`` / ``attention`` (kernel 0)."""
    from minicb.fastpaths import cpu_paged
    from preconditions import unavailable

    if backend == "cpu-paged" and cpu_paged.unavailable_reason():
        unavailable(f"the cpu-paged kernel cannot be built here: {cpu_paged.unavailable_reason()}")
    profile_run, Workload = breakdown[0].profile_run, breakdown[1]
    wl = Workload("t", [[5, 6, 7, 8] * (1 + i % 3) for i in range(6)], [12] * 6)
    parts = profile_run(tiny_model(), wl, policy="continuous", max_num_seqs=4,
                                        max_num_batched_tokens=64, attn_backend=backend)
    # load-independent: measured times only asked to be > 0 (or never taken)
    assert (parts["kernel"] > 0) == (backend == "cpu-paged")
    assert parts["linear"] > 0 and parts["gather"] > 0 and parts["attention"] > 0   # prompts use SDPA
    # load-independent: the parts add up to their total
    assert sum(parts[p] for p in ("linear", "attention", "gather", "kernel", "rest")) == pytest.approx(
        parts["total"])



def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name: [0] the state (R running, S sleeping,
    T stopped), [2] the process group."""
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _group(pgid: int) -> list[int]:
    out = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[2]) == pgid:
                    out.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return sorted(out)


def _until(done) -> None:
    """Poll ``done`` (signals are delivered asynchronously); at most 2 s, then let the assert say."""
    for _ in range(200):
        if done():
            return
        time.sleep(0.01)


def _spinning_group() -> subprocess.Popen:
    """A process that spins, and a grandchild of it that spins too, in a process group of their own:
    the stand-in for an engine's tree (vLLM's front end, engine core and worker)."""
    spin = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']); "
            "print('up', flush=True)\nwhile True: pass")
    proc = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _states(pgid: int) -> list[str]:
    return [_stat(p)[0] for p in _group(pgid)]


def test_peer_vllm_pauses_the_whole_process_group_and_resumes_it():
    """Every process of a vLLM child's group is stopped while another engine is timed, and runs
    again after (a child that spins, and a grandchild of it, stand in for vLLM's tree)."""
    (peer,) = bench_modules("peer_vllm")
    proc = _spinning_group()
    try:
        group = _group(proc.pid)
        assert len(group) == 2 and proc.pid in group, group
        child = peer.VllmChild.__new__(peer.VllmChild)      # only its process: no vLLM started
        child.proc = proc
        child.pause(True)
        _until(lambda: all(_stat(p)[0] == "T" for p in group))
        assert [_stat(p)[0] for p in group] == ["T", "T"]
        child.pause(False)
        _until(lambda: all(_stat(p)[0] != "T" for p in group))
        assert all(_stat(p)[0] in "RS" for p in group), [_stat(p)[0] for p in group]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_peer_vllm_resuming_a_group_that_is_gone_is_not_an_error():
    """The resume in a ``finally`` must not replace the error that ended minicb's run (or vLLM's death)
    with its own; stopping a group that is gone is one."""
    (peer,) = bench_modules("peer_vllm")
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    child = peer.VllmChild.__new__(peer.VllmChild)
    child.proc = proc
    child.pause(False)
    with pytest.raises(ProcessLookupError):
        child.pause(True)


def test_serve_peers_stops_every_server_but_the_measured_one_and_resumes_them():
    """While one server is driven, every other server's whole group is stopped; all run again after,
    also when the turn ends in an error."""
    (sp,) = bench_modules("serve_peers")
    procs = [_spinning_group() for _ in range(3)]
    try:
        servers = []
        for proc in procs:
            server = sp.Server.__new__(sp.Server)      # only its process: nothing is served
            server.proc = proc
            servers.append(server)
        a, b, c = servers

        def stopped() -> list[list[bool]]:
            return [[st == "T" for st in _states(p.proc.pid)] for p in servers]

        def none_stopped() -> bool:
            return not any(any(row) for row in stopped())

        with sp.others_paused(b, servers) as others:
            assert others == [a, c]
            _until(lambda: stopped() == [[True] * 2, [False] * 2, [True] * 2])
            assert stopped() == [[True] * 2, [False] * 2, [True] * 2]
        _until(none_stopped)
        assert none_stopped(), stopped()
        with pytest.raises(RuntimeError, match="the turn failed"), sp.others_paused(a, servers):
            raise RuntimeError("the turn failed")
        _until(none_stopped)
        assert none_stopped(), stopped()
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_peers_variant_spec_and_the_medians_of_repeated_turns():
    (sp,) = bench_modules("serve_peers")
    assert sp.split_spec('CC="cc -DTEAM_SPIN_MIN=64" X=1 --max-num-seqs 8 --flag=a') == \
        ({"CC": "cc -DTEAM_SPIN_MIN=64", "X": "1"}, ["--max-num-seqs", "8", "--flag=a"])
    assert sp.split_spec("--max-num-seqs 0") == ({}, ["--max-num-seqs", "0"])
    assert sp.split_spec("") == ({}, [])
    rows = [{"system": n, "rate": label, "throughput": t} for n, label, t in [
        ("a", "sat", 100.0), ("b", "sat", 90.0), ("a", "1", 5.0), ("b", "1", 50.0),
        ("a", "sat#2", 300.0), ("b", "sat#2", 330.0), ("a", "sat#3", 200.0), ("b", "sat#3", 240.0)]]
    # medians of the sat turns only: a 200 (100, 200, 300), b 240 (90, 240, 330); rate 1 ran once: no line
    assert sp.turn_medians(rows, ["sat", "1", "sat", "sat"], ["a", "b"]) == \
        ["sat, median tok/s of 3 turns: a 200.0 (1.00x), b 240.0 (1.20x)"]
    # with --clients: each server/client against the first server through the same client
    rows = [{"system": n, "rate": label, "throughput": t} for n, label, t in [
        (f"{server}/{client}", label, t) for label in ("sat", "sat#2")
        for server, client, t in (("a", "openai", 100.0), ("a", "lean", 200.0), ("b", "openai", 150.0),
                                  ("b", "lean", 220.0))]]
    assert sp.turn_medians(rows, ["sat", "sat"], ["a/openai", "a/lean", "b/openai", "b/lean"]) == \
        ["sat, median tok/s of 2 turns: a/openai 100.0 (1.00x), a/lean 200.0 (1.00x), "
         "b/openai 150.0 (1.50x), b/lean 220.0 (1.10x)"]


def test_long_prompt_workload_is_48_arxiv_requests_scaled_by_a_quarter():
    """LP's shape from the trace file itself: its first draws of a seed-0 generator pick the rows, each
    length divided by 4 and rounded; every request is a scaled row of the trace (for any seed value),
    and the same seed gives the same prompts."""
    import csv

    import numpy as np

    (workloads,) = bench_modules("workloads")
    with open(ROOT / "bench" / "data" / "arxiv_summarization_lengths.csv") as f:
        rows = [(int(p), int(o)) for p, o in list(csv.reader(f))[1:]]
    assert len(rows) == 28257
    picked = [rows[i] for i in np.random.default_rng(0).integers(0, len(rows), size=48)]
    wl = workloads.lp()
    assert wl.name == "LP" and len(wl.prompts) == len(wl.output_lens) == 48
    assert sum(len(p) for p in wl.prompts) == sum(max(round(p / 4), 1) for p, _ in picked)
    assert wl.num_output_tokens == sum(max(round(o / 4), 1) for _, o in picked)
    assert (sum(len(p) for p in wl.prompts), wl.num_output_tokens) == (30617, 3662)   # the docstring's
    scaled = {(max(round(p / 4), 1), max(round(o / 4), 1)) for p, o in rows}
    other = workloads.lp(seed=1)
    for w in (wl, other):
        assert all((len(p), o) in scaled for p, o in zip(w.prompts, w.output_lens))
    assert other.prompts != wl.prompts and workloads.lp().prompts == wl.prompts


def test_vllm_placements_whole_machine_and_one_core(monkeypatch, tmp_path):
    """The vLLM engines the peer scripts start: its own placement ("auto": the variable unset, even when
    this shell sets it) and every CPU of this process a compute thread; or one core, whole tree pinned.
    Its bundled OpenMP is preloaded, and minicb's PYTHONPATH is not passed on."""
    (peer,) = bench_modules("peer_vllm")
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert peer.vllm_placements("default,all", False, 0) == {"vllm": (None, None), "vllm-all": (cpus, None)}
    assert peer.vllm_placements("all", False, 0) == {"vllm-all": (cpus, None)}
    assert peer.vllm_placements("default,all", True, 1) == {"vllm": ("1", 1)}
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    python = str(tmp_path / "bin" / "python")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    auto, bound = peer.vllm_env(python, None), peer.vllm_env(python, "0,1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in auto and bound["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert auto["LD_PRELOAD"] == bound["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    assert "PYTHONPATH" not in auto and "PYTHONPATH" not in bound


def test_peer_vllm_summary_per_wall_and_per_cpu_second():
    """The offline table's cells: medians and ranges over rounds of tokens per wall second and per CPU
    second of the engine's tree (fixed numbers fed to the helper)."""
    (peer,) = bench_modules("peer_vllm")
    runs = [{"tokens": 100, "seconds": s, "cpu_seconds": c} for s, c in ((2.0, 4.0), (1.0, 1.0), (4.0, 2.0))]
    assert peer.summary(runs, "tok/s") == (50.0, 25.0, 100.0)
    assert peer.summary(runs, "tok/cpu") == (50.0, 25.0, 100.0)
    assert peer.summary(runs, "seconds") == (2.0, 1.0, 4.0)


def test_roofline_step_cost_counts_products_head_attention_and_reads():
    """bench/roofline.py's floor of a step, against the arithmetic written out for a small config: a
    3-token chunk at position 5 (keys 6, 7, 8) that samples, and a decode row at position 9 (10 keys)."""
    from types import SimpleNamespace as NS

    (roofline,) = bench_modules("roofline")
    cfg = NS(hidden_size=8, num_hidden_layers=2, head_dim=4, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=16, vocab_size=100)
    chunk = NS(num_tokens=3, start_pos=5, sample=True, context_len=8)
    decode = NS(num_tokens=1, start_pos=9, sample=True, context_len=10)
    weights = 8 * (8 + 4 + 4) + 8 * 8 + 3 * 8 * 16          # q/k/v, o, gate/up/down of one layer: 576
    flops, nbytes = roofline.step_cost([chunk, decode], cfg, elem=2)
    products = 2 * (3 + 1) * weights * 2                    # 4 tokens, 2 layers
    head = 2 * 8 * 100 * 2                                  # two sampled rows
    attention = 4 * 8 * (6 + 7 + 8 + 10) * 2                # q_heads * head_dim = 8, keys, 2 layers
    assert flops == products + head + attention
    assert nbytes == (8 + 10) * 2 * 4 * 2 * 2 + (weights * 2 + 8 * 100) * 2
    assert roofline.kind_of([chunk, decode]) == "prompt-bearing"
    assert [roofline.kind_of([decode] * n) for n in (1, 7, 8, 31, 32)] == [
        "decode 1-7 rows", "decode 1-7 rows", "decode 8-31 rows", "decode 8-31 rows", "decode 32+ rows"]


def test_roofline_bar_is_the_peers_median_round_divided_by_the_bar():
    """bench/roofline.py --peer-json: the bar's time is the peer's median round (odd and even counts)
    over the bar; another engine's rounds in the same file do not count."""
    (roofline,) = bench_modules("roofline")
    peer = {"bfloat16": {"W2/vllm-all": [{"seconds": 12.0}, {"seconds": 9.0}, {"seconds": 30.0}],
                         "W2/minicb": [{"seconds": 1.0}],
                         "LP/vllm-all": [{"seconds": 40.0}, {"seconds": 20.0}]}}
    # load-independent: the "seconds" are numbers written into this dict, no clock is read
    assert roofline.bar_seconds(peer, "bfloat16", "W2", "vllm-all", 1.5) == (12.0, 8.0)
    # load-independent: as above
    assert roofline.bar_seconds(peer, "bfloat16", "LP", "vllm-all", 1.25) == (30.0, 24.0)
    with pytest.raises(KeyError):
        roofline.bar_seconds(peer, "float32", "W2", "vllm-all", 1.5)


def test_serve_overhead_measures_gaps_between_token_chunks_and_pairs_the_rounds():
    """bench/serve_overhead.py: only ``data: {`` lines are tokens; the time per token is the mean gap
    after the first; the summary's overhead is the median of the rounds' paired differences."""
    (so,) = bench_modules("serve_overhead")
    ticks = iter([1.0, 1.5, 2.5])
    lines = [b"data: {\"a\": 1}\n", b"\n", b"data: {\"b\": 2}\n", b": keep-alive\n", b"data: {\"c\": 3}\n",
             b"data: [DONE]\n"]
    times = so.sse_token_times(lines, clock=lambda: next(ticks))
    assert times == [1.0, 1.5, 2.5]
    assert so.per_token_ms(times) == pytest.approx(750.0)
    with pytest.raises(ValueError):
        so.per_token_ms([1.0])
    rows = [{"served_ms": s, "offline_ms": o, "event_loop_cpu_ms": c, "between_steps_ms": b}
            for s, o, c, b in ((11.0, 10.0, 0.4, 0.1), (12.0, 9.0, 0.5, 0.3), (10.5, 10.3, 0.3, 0.2))]
    s = so.summary(rows)
    assert (s["overhead_ms"], s["overhead_min_ms"], s["overhead_max_ms"]) == pytest.approx((1.0, 0.2, 3.0))
    assert (s["served_ms"], s["offline_ms"]) == (11.0, 10.0)
    assert (s["event_loop_cpu_ms"], s["between_steps_ms"]) == (0.4, 0.2)


def test_decode_floor_counts_the_keys_and_values_a_step_reads():
    """bench/decode_floor.py's floor adds each sequence's K and V, every layer: for SmolLM2 in bfloat16,
    2 x 3 kv heads x 64 x 2 bytes x 30 layers = 23,040 bytes a token of context."""
    from types import SimpleNamespace as NS

    import torch

    (decode_floor,) = bench_modules("decode_floor")
    model = NS(config=NS(num_key_value_heads=3, head_dim=64, num_hidden_layers=30), dtype=torch.bfloat16)
    assert decode_floor.kv_bytes(model, 1, 1) == 23040
    assert decode_floor.kv_bytes(model, 5, 1012) == 5 * 1012 * 23040
    # the docstring's "43% more for 5 sequences of 1,000 tokens" (a measured step's mean context:
    # the prompt, 2, and half of 20 steps) beside SmolLM2's 269 MB of bfloat16 weights, LM head included
    weights = 2 * (30 * 576 * (576 + 2 * 192 + 576 + 3 * 1536) + 49152 * 576)
    assert round(weights / 1e6) == 269
    assert round(100 * decode_floor.kv_bytes(model, 5, 1000 + 2 + 20 // 2) / weights) == 43


def test_serve_clients_record_the_same_stream():
    """bench/serve.py's two clients (the openai SDK and the lean one that reads bare ``data:`` lines)
    send the same body and record the same chunks, tokens and errors from one SSE server: a stream of
    three text chunks, an empty one (a held-back UTF-8 fragment), the usage chunk; a 400 is an error,
    not a stream; and an error object after a token ends the request as failed."""
    import http.server
    import json as _json
    import threading

    (serve,) = bench_modules("serve")
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "", "b", "c")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}})

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body["max_tokens"] > 100:
                self.send_response(400)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "too many", "type": "invalid_request_error"}}')
                return
            assert body["stream"] and body["prompt"] == [1, 2] and body["ignore_eos"]
            assert body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            failed = {"error": {"message": "the step failed", "type": "internal_error", "code": 500}}
            # max_tokens 7: a step failed mid-stream, after one token
            for c in chunks[:1] + [failed] if body["max_tokens"] == 7 else chunks:
                if "error" not in c:
                    c = {"id": "x", "object": "text_completion", "created": 0, "model": "m", **c}
                self.wfile.write(f"data: {_json.dumps(c)}\n\n".encode())
                if "error" in c:
                    return
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        seen = {}
        for client in ("openai", "lean"):
            recs = serve.run_load(url, "m", [[1, 2], [1, 2], [1, 2]], [3, 500, 7], [0.0, 0.0, 0.0], client)
            seen[client] = [(len(r.chunk_times), r.tokens, r.error is None) for r in recs]
            assert all(r.sent > 0 for r in recs)
    finally:
        srv.shutdown()
    assert seen["openai"] == seen["lean"] == [(3, 3, True), (0, 0, False), (1, 0, False)]


def test_cpu_ceilings_probes_run_where_the_cpu_has_their_instructions():
    """bench/cpu_ceilings.c: each register probe runs (a positive time) exactly where the CPU has its
    instruction set, and says -1 where the build lacks it (the script then prints no such line)."""
    from minicb.fastpaths import ckernels
    from preconditions import unavailable

    (ceilings,) = bench_modules("cpu_ceilings")
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        unavailable("no /proc/cpuinfo flags line here (Linux x86 only)")
    if ckernels.why_not(ceilings.probe):
        unavailable(f"bench/cpu_ceilings.c is not built here: {ckernels.why_not(ceilings.probe)}")
    lib = ceilings.probe()
    for fn, flag in ((lib.fma_seconds, "fma"), (lib.dot_bf16_seconds, "avx512_bf16"),
                     (lib.dot_u8s8_seconds, "avx512_vnni")):
        t = fn(1000)
        assert (t > 0) if flag in flags else (t == -1.0), (fn.__name__, t)
    assert lib.fma_lanes() == (16 if "avx512f" in flags else 8 if "fma" in flags else 0)


def test_int8_product_times_the_products_it_checked():
    """bench/int8_product.py, whose ratios RESULTS.md quotes: each row is the int8 product checked against
    float64 (within one bfloat16 rounding) and both products timed; a wrong int8 product would show as
    an error of order 1, not as a speed."""
    (int8,) = bench_modules("int8_product")
    for rows, in_f, out_f in ((1, 64, 64), (5, 96, 130)):
        for flags in ((), ("-mno-avx512f",)):
            r = int8.compare(rows, in_f, out_f, repeats=1, flags=flags)
            assert (r["rows"], r["in"], r["out"]) == (rows, in_f, out_f)
            assert 0 <= r["err"] <= 2.0 ** -8 and r["int8_s"] > 0 and r["bf16_s"] > 0, r
