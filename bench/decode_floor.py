"""A decode step of 1, 4 and 16 sequences, part by part, beside its floor: reading the weights once.

    python bench/decode_floor.py                              # float32 and bfloat16, LLM()'s paths
    python bench/decode_floor.py --dtypes bfloat16 --batches 1,4,16,64 --steps 30
    MINICB_LINEAR=mkl python bench/decode_floor.py            # another linear path (cpu_linear.PATHS)
    python bench/decode_floor.py --thread-scaling             # one sequence: 1 thread against 2, alternating
    python bench/decode_floor.py --cold-calls --dtypes bfloat16  # small torch calls after a step's kernels
    python bench/decode_floor.py --dtypes bfloat16 --batches 1,3,5 --threads 2 --prompt-tokens 1000
    python bench/decode_floor.py --stack-builds "now=,fixed=-DFIXED_ATTN_ROWS" --batches 2,3,5,8 \
        --threads 2 --dtypes bfloat16 --prompt-tokens 1000     # two builds of layer_stack.c, alternating
    python bench/decode_floor.py --stack-builds "now=,fixed=-DFIXED_ATTN_ROWS" --workload LP \
        --threads 2 --dtypes bfloat16 --rounds 4                # the same, a whole workload a round
    python bench/decode_floor.py --prompt-builds "bf16-sum=,f32-sum=-DF32_WEIGHTED_SUM" --workload LP \
        --threads 2 --dtypes bfloat16 --rounds 4                # two builds of paged_prompt.c, the same way

A decode step at a small batch does little arithmetic: each weight is read from memory once and used
for a handful of rows. So its time cannot go below ``bytes of the weights the step reads / one core's
read bandwidth``. This script measures both on this machine and prints that floor:

* the bytes: every linear layer's weight in the dtype its product reads (packed bfloat16 weights are
  half the size of float32 ones; a bfloat16 model on the ``mkl`` path reads float32 copies), plus the
  LM head, which is most of SmolLM2's small matrices' total;
* the bandwidth: ``torch.sum`` over a 256 MB float32 tensor on one thread, best of five (a read-only
  pass: what streaming a weight costs), on the same kind of pages as the weights (huge pages where the
  OS allows them, ``fastpaths/host_memory.py``; they read ~25% faster on the Zen 4 VM of RESULTS.md).

The floor also counts the keys and values the step's attention reads (each sequence's context, every
layer): under 1% beside the weights at 64-token prompts, 43% more for 5 sequences of 1,000 tokens.

Then it starts ``B`` requests (``--prompt-tokens``, default 64; EOS ignored), steps the engine until
every prompt is in the cache, and times ``--steps`` decode steps twice: once untouched (``step``, its
wall time), once with timers around its parts (``time.perf_counter``, about a microsecond per call,
so the ``timed`` step is a little longer, and its parts add up to it): the linear products (q/k/v, o,
gate/up, down: ``linears``), the LM head, the decode kernel, all the layers of a step run in one C
call (``stack``, where ``layer_stack`` takes the step: then the products and the kernel inside it are
not counted apart), the rest of the forward (``fwd oth``: norms, rotary,
residual adds, the backend's glue, the Python of the layers), the runner's packing of the batch
(``pack``: ids, positions, metadata tensors), sampling, and the rest of the step (``sched+out``:
scheduling, the runner's glue, making outputs). The untouched step is a median over the steps, the
parts are means; the header names the CPU. On a shared machine read the ratios.

``--stack-builds NAME=FLAGS,...`` compares builds of ``layer_stack.c`` (compiled with the extra
FLAGS, e.g. ``-DFIXED_ATTN_ROWS``: the decode rows 4 to a work item whatever the step, as before the
rows were shared among the threads) in one process: for each ``--batches`` entry it starts the requests,
then steps them ``--steps`` steps on each build in turn, ``--rounds`` rounds, and prints the stack's
median ms per step per build [range of the rounds] and the ratio to the first build. With
``--workload W`` (``bench/workloads.py``'s W1, W2 or LP) each round runs the whole workload once on
each build instead (``LLM()``'s defaults, the prefix cache emptied, EOS ignored) and prints output
tokens/s: what the change is worth end to end. ``--prompt-builds NAME=FLAGS,...`` does the same for
builds of the prompt kernel, ``paged_prompt.c`` (``-DF32_WEIGHTED_SUM``: the weighted sum of the values
in float32 instead of on ``vdpbf16ps``), with a ``--workload``; ``--decode-builds`` the same for the decode
kernel, ``paged_decode.c`` (``-DDECODE_AVX512=0``: its AVX2 row where the CPU has AVX-512)::

    python bench/decode_floor.py --decode-builds "avx512=,avx2=-DDECODE_AVX512=0" --workload W2 \
        --dtypes bfloat16 --threads 2 --rounds 4

``--block-rows 0,8`` alternates the limit of the stack's steps that read a bfloat16 model's GGUF blocks
(``MINICB_BLOCK_ROWS``: 0, the bfloat16 panels for every step; 8, the blocks up to 8 rows) the same way,
on the default build, ``--batches`` for the row counts::

    python bench/decode_floor.py --block-rows 0,8 --batches 1,2,3,4,6,8 --threads 2 --dtypes bfloat16

``--beside BURN,SLEEP`` runs the ``--stack-builds`` beside another process, busy ``BURN`` ms then asleep
``SLEEP`` ms over and over: the machine a served step runs on, where the server's event loop and a
client take a core now and then. ``-DTEAM_BARRIERS`` builds the stack's parts as they were before its
work queue (``team_queue.h``): each thread its fixed share of a part, then a wait for all::

    python bench/decode_floor.py --stack-builds "queue=,barriers=-DTEAM_BARRIERS" --beside 1,2 \
        --batches 1,16,64 --threads 2 --dtypes bfloat16 --rounds 6 --steps 30

``--cold-calls`` times four small torch calls (a tensor from a list, a gather, ``isfinite``, ``any``:
what ``sampling.unscorable_rows`` did for a greedy row) inside a one-sequence decode step, right after
its C kernels have streamed the weights through the caches, and the same four on their own in a loop:
after the kernels each call starts cold (torch's dispatch code and data evicted), which is why the
step's Python keeps its torch calls few.

``--thread-scaling`` asks what a second thread gives a one-sequence decode (the ``--threads`` list,
default ``1,2``): one request decodes while the thread count alternates, ``--steps`` steps at each
count per round, ``--rounds`` rounds, so that a busy spell of a shared machine hits every count. It
prints, per dtype and thread count, the median ms per token over the rounds (a round's figure: the
median of its steps) with the range of the rounds, the layer stack's and the LM head's share of it,
and the ratio to the first count's median; and before each dtype the read bandwidth of each count
(``torch.sum``), the ceiling of a step that reads its weights from memory: on a shared machine it
moves with the neighbours' memory traffic, and the ratios move with it. ``chrt -f 10`` in front
(real-time priority, where allowed) keeps other processes off the cores while it runs, not off the
memory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cpu_header, load_smollm2  # noqa: E402
from step_parts import SECONDS, timed  # noqa: E402  (the same timers)

import minicb.fastpaths.cpu_linear as cl  # noqa: E402
import minicb.fastpaths.cpu_paged as cpu_paged  # noqa: E402
import minicb.fastpaths.layer_stack as layer_stack  # noqa: E402
import minicb.runtime.runner as runner_module  # noqa: E402
from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402
from minicb.fastpaths import host_memory  # noqa: E402
from minicb.model.llama import LlamaForCausalLM  # noqa: E402
from minicb.runtime.sampling import Sampler  # noqa: E402


def read_bandwidth(megabytes: int = 256, repeats: int = 5, plain: bool = False) -> float:
    """One thread's read bandwidth in GB/s: ``torch.sum`` over a float32 tensor, best of ``repeats``; the
    tensor on the pages the skinny kernel's weights get (``host_memory.on_huge_pages``: 2 MiB pages
    where the OS allows them, which read faster; ``MINICB_HUGE_PAGES=0``: plain ones), or on plain
    pages whatever they get (``plain``)."""
    x = torch.ones(megabytes * 2 ** 20 // 4)
    if not plain:
        x = host_memory.on_huge_pages(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.sum(x)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: LlamaForCausalLM, rows: int = 1) -> int:
    """The bytes of linear-layer weight one forward of ``rows`` rows reads, in the dtype each product
    reads them (a step of few enough rows for the skinny kernel reads its panels, in the model's dtype;
    of one row, in a bfloat16 model from a GGUF, the blocks' panels; with int8 products, theirs)."""
    cfg = model.config
    per_layer = cfg.hidden_size * ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
                                   + cfg.num_attention_heads * cfg.head_dim + 3 * cfg.intermediate_size)
    params = cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size      # the LM head too
    stack = getattr(model, "layer_stack", None)
    # the GGUF's blocks, as stored: skinny_gemm.pack_blocks for few rows, int8_gemm.pack for every step
    few = rows <= getattr(stack, "block_rows", 0)
    kind = "int8" if getattr(stack, "int8", False) else "blocks" if few else ""
    if kind:
        lm = model.lm_head
        head = lm.block_panels if rows <= lm.block_rows else lm.weight_panels
        return sum(t.nbytes for ts in stack.products[kind][0] for t in ts[1:3] + ts[4:]) + head.nbytes
    native = model.dtype == torch.bfloat16 and (cl.linear_path(model) in ("torch", "onednn-bf16")
                                                 or rows <= cl.skinny_rows_of(model))
    return params * (2 if native else 4)        # the other paths multiply float32 copies


def kv_bytes(model: LlamaForCausalLM, rows: int, context: int) -> int:
    """The bytes of keys and values a decode step of ``rows`` sequences of ``context`` tokens reads."""
    cfg = model.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize * cfg.num_hidden_layers
    return rows * context * per_token


def install_timers(model: LlamaForCausalLM, llm: LLM) -> None:
    for cls in (cl.PackedLinear, cl.PackedProjections, cl.Float32ComputeLinear, torch.nn.Linear):
        cls.forward = timed("linears", cls.forward)
    model.lm_head.forward = timed("lm head", model.lm_head.forward)     # counted apart from "linears"
    cpu_paged.decode_into = timed("decode kernel", cpu_paged.decode_into)
    runner_module.pack = timed("pack", runner_module.pack)
    Sampler.sample = timed("sample", Sampler.sample)
    model.forward = timed("forward", model.forward)
    layer_stack.LayerStack.run = timed("stack", layer_stack.LayerStack.run)
    llm.engine.step = timed("step", llm.engine.step)


def start_decoding(eng, batch: int, vocab: int, prompt_tokens: int, max_tokens: int) -> set[str]:
    """Start ``batch`` requests of random ``prompt_tokens``-token prompts (seeded by ``batch``) and step
    until every prompt is in the cache and all of them decode; their ids."""
    g = torch.Generator().manual_seed(batch)
    ids = {f"r{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)}
    for rid in sorted(ids):
        eng.add_request(rid, torch.randint(10, vocab, (prompt_tokens,), generator=g).tolist(),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    started: set[str] = set()
    while started != ids:                              # until every prompt is in the cache
        started |= {o.request_id for o in eng.step() if o.token_ids}
    eng.step()
    return ids


def decode_steps(llm: LLM, batch: int, steps: int, vocab: int,
                 prompt_tokens: int = 64) -> tuple[list[float], dict[str, float]]:
    """Start ``batch`` requests and prefill them; then the wall time of each of ``steps`` decode steps and
    the seconds the timers (if installed) counted in them."""
    eng = llm.engine
    start_decoding(eng, batch, vocab, prompt_tokens, steps + 8)
    before, times = collections.Counter(SECONDS), []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    parts = {k: SECONDS[k] - before[k] for k in SECONDS}
    while eng.has_unfinished_requests():
        eng.step()
    return times, parts


def cold_calls(dname: str, steps: int) -> None:
    """Four small torch calls (those ``sampling.unscorable_rows`` made on a greedy row: a tensor from a
    list, a gather, isfinite, any) timed inside a one-sequence decode step, right after its kernels
    streamed the weights through the caches, and the same four in a loop on their own (module
    docstring, ``--cold-calls``)."""
    def four(logits, tokens):
        top = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        return bool((~torch.isfinite(top)).any())

    inside: list[float] = []
    llm = LLM(dtype=dname)
    sampler = llm.engine.runner.sampler
    argmax = sampler.argmax

    def timed_argmax(logits):
        found = argmax(logits)
        t = time.perf_counter()
        four(logits, found[0])
        inside.append(time.perf_counter() - t)
        return found
    sampler.argmax = timed_argmax
    ids = start_decoding(llm.engine, 1, llm.engine.runner.vocab_size, 64, steps + 8)
    inside.clear()
    for _ in range(steps):
        llm.engine.step()
    sampler.argmax = argmax
    logits = torch.randn(1, llm.engine.runner.vocab_size).to(getattr(torch, dname))
    alone = []
    for _ in range(steps):
        t = time.perf_counter()
        four(logits, [0])
        alone.append(time.perf_counter() - t)
    for rid in ids:
        llm.engine.abort_request(rid)
    print(f"{cpu_header()}\n{dname}: four small torch calls (tensor, gather, isfinite, any) inside a "
          f"one-sequence decode step, after its kernels: median {statistics.median(inside) * 1e6:.0f} us "
          f"[{min(inside) * 1e6:.0f}-{max(inside) * 1e6:.0f}] over {steps} steps; the same four in a loop "
          f"on their own: {statistics.median(alone) * 1e6:.0f} us [{min(alone) * 1e6:.0f}-"
          f"{max(alone) * 1e6:.0f}]")


def thread_scaling(dtypes: list[str], threads: list[int], steps: int, rounds: int) -> None:
    """One sequence's decode, ms per token at each thread count, alternating (module docstring)."""
    print(f"{cpu_header()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    print(f"one sequence decoding (64-token prompt); {rounds} rounds of {steps} steps at each of "
          f"{threads} threads, alternating; ms per token: median [range of the rounds]")
    for dname in dtypes:
        dtype = getattr(torch, dname)
        bandwidth = []
        for t in threads:                      # what the memory gives each count now: a step's ceiling
            torch.set_num_threads(t)
            bandwidth.append(f"{t} thread(s) {read_bandwidth():.1f}")
        blocks: dict = {}
        model = load_smollm2(dtype, blocks)
        applied = cpu_fast_paths(model, "cpu", gguf_blocks=blocks)
        llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=2048, num_blocks=512, block_size=16)
        eng = llm.engine
        eng.add_request(f"scaling-{dname}", torch.randint(10, model.config.vocab_size, (64,)).tolist(),
                        SamplingParams(max_tokens=(rounds + 1) * steps * len(threads) + 8, ignore_eos=True))
        eng.step()                                       # the prompt
        model.lm_head.forward = timed("lm head", model.lm_head.forward)
        run = layer_stack.LayerStack.run
        layer_stack.LayerStack.run = timed("stack", run)
        per = {t: collections.defaultdict(list) for t in threads}
        for rnd in range(rounds + 1):                    # round 0 warms every count up, uncounted
            for t in threads:
                torch.set_num_threads(t)
                before, times = collections.Counter(SECONDS), []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    eng.step()
                    times.append(time.perf_counter() - t0)
                if rnd:
                    per[t]["step"].append(statistics.median(times) * 1e3)
                    for k in ("stack", "lm head"):
                        per[t][k].append((SECONDS[k] - before[k]) / steps * 1e3)
        layer_stack.LayerStack.run = run
        print(f"\n{dname} ({', '.join(applied)}); read bandwidth before it (torch.sum over 256 MB, best of "
              f"5, GB/s): {', '.join(bandwidth)}")
        base = statistics.median(per[threads[0]]["step"])
        for t in threads:
            step = per[t]["step"]
            med = statistics.median(step)
            print(f"  {t} thread(s): {med:6.2f} ms/token [{min(step):.2f}-{max(step):.2f}]  "
                  f"stack {statistics.median(per[t]['stack']):5.2f}  lm head "
                  f"{statistics.median(per[t]['lm head']):5.2f}  ratio to {threads[0]}: {med / base:.2f}x")
        eng.abort_request(f"scaling-{dname}")
        torch.set_num_threads(threads[0])


def workload_builds(dname: str, libs: dict, name: str, rounds: int, kernel: str = "") -> None:
    """A workload's output tokens/s on each build of layer_stack.c (``kernel`` "prompt" or "decode": of
    paged_prompt.c or paged_decode.c), alternating (module docstring)."""
    from workloads import WORKLOADS

    wl = WORKLOADS[name]()
    llm = LLM(dtype=dname)
    stack = llm.engine.runner.model.layer_stack
    loader = f"load_{kernel}" if kernel == "prompt" else "load"
    load_kernel = getattr(cpu_paged, loader)
    fn = cpu_paged.kernel_name(getattr(torch, dname), prompt=kernel == "prompt")
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0) for o in wl.output_lens]
    llm.generate(wl.prompts[:2], params[:2], use_tqdm=False)               # warm up
    rates = {name: [] for name in libs}
    for rnd in range(rounds):
        for build, lib in list(libs.items())[::1 if rnd % 2 == 0 else -1]:     # the order alternates
            if kernel:      # the stack's pointer, and the backend's for a step the stack does not take
                setattr(stack.kernels, kernel, layer_stack._address(getattr(lib, fn)))
                setattr(cpu_paged, loader, lambda *flags, lib=lib: lib)
            else:
                stack.lib = lib
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate(wl.prompts, params, use_tqdm=False)
            rates[build].append(wl.num_output_tokens / (time.perf_counter() - t0))
            print(f"  round {rnd + 1} {build}: {rates[build][-1]:.1f} output tokens/s", flush=True)
    first = next(iter(rates.values()))
    for build, v in rates.items():
        ratios = " ".join(f"{a / b:.2f}" for a, b in zip(v, first))
        print(f"{name} {dname} {build}: median {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}] "
              f"tokens/s; per round x the first build: {ratios}")
    stack.lib = layer_stack.load()
    setattr(cpu_paged, loader, load_kernel)


BUSY_LOOP = """
import sys, time
burn, sleep = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < burn:
        pass
    time.sleep(sleep)
"""


@contextlib.contextmanager
def beside(spec: str | None):
    """``--beside BURN,SLEEP``: another process on the machine while the builds run, busy ``BURN`` ms
    then asleep ``SLEEP`` ms over and over (1,2: a third of a core in 1 ms bursts, as a server's event
    loop and its client take one while the engine steps); stopped after."""
    if not spec:
        yield
        return
    burn, sleep = spec.split(",")
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, burn, sleep])
    print(f"beside: a process busy {burn} ms, then asleep {sleep} ms, over and over")
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def stack_builds(dname: str, builds: dict[str, tuple[str, ...]], batches: list[int], threads: int,
                 prompt_tokens: int, steps: int, rounds: int, workload: str | None = None,
                 block_rows: list[int] | None = None) -> None:
    """The stack's ms per step on each build of layer_stack.c, alternating (module docstring);
    ``block_rows``: on the default build, each of these limits of the GGUF blocks' steps instead."""
    torch.set_num_threads(threads)
    print(f"{cpu_header()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
    libs = {name: layer_stack.load(flags) for name, flags in builds.items()}
    limits = dict.fromkeys(libs, None)
    if block_rows:
        libs = {f"blocks<={n}": layer_stack.load() for n in block_rows}
        limits = {f"blocks<={n}": n for n in block_rows}
    if workload:
        workload_builds(dname, libs, workload, rounds)
        return
    gguf_blocks: dict = {}
    model = load_smollm2(getattr(torch, dname), gguf_blocks)
    cpu_fast_paths(model, "cpu", gguf_blocks=gguf_blocks)
    stack = model.layer_stack
    blocks = max(batches) * (prompt_tokens + (rounds + 1) * steps * len(libs) + 8) // 16 + 64
    llm = LLM(model, max_num_seqs=max(batches), max_num_batched_tokens=2048, num_blocks=blocks, block_size=16)
    eng = llm.engine
    run = layer_stack.LayerStack.run
    layer_stack.LayerStack.run = timed("stack", run)
    print(f"{dname}, {threads} threads, {prompt_tokens}-token prompts; the stack's ms per step: median "
          f"[range of {rounds} rounds of {steps} steps]")
    for b in batches:
        max_tokens = (rounds + 1) * steps * len(libs) + 4
        ids = start_decoding(eng, b, model.config.vocab_size, prompt_tokens, max_tokens)
        per = {name: [] for name in libs}
        for rnd in range(rounds + 1):                     # round 0 warms each build up, uncounted
            for name, lib in list(libs.items())[::1 if rnd % 2 else -1]:     # the order alternates
                stack.lib = lib
                if limits[name] is not None:
                    stack.block_rows = limits[name]
                before = SECONDS["stack"]
                for _ in range(steps):
                    eng.step()
                if rnd:
                    per[name].append((SECONDS["stack"] - before) / steps * 1e3)
        first = statistics.median(next(iter(per.values())))
        print(f"  {b:>3} seqs: " + "   ".join(
            f"{name} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] "
            f"{statistics.median(v) / first:.2f}x" for name, v in per.items()), flush=True)
        for rid in ids:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    stack.lib = layer_stack.load()
    layer_stack.LayerStack.run = run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", default="1",
                    help="torch threads (with --thread-scaling: the counts to alternate, default 1,2)")
    ap.add_argument("--thread-scaling", action="store_true",
                    help="one sequence's ms per token at each --threads count, alternating")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="each sequence's prompt (its context)")
    ap.add_argument("--stack-builds", help="NAME=FLAGS,...: builds of layer_stack.c to alternate")
    ap.add_argument("--block-rows", help="A,B,...: like --stack-builds, the default build with each limit "
                    "of the steps that read the GGUF's blocks (MINICB_BLOCK_ROWS) in turn")
    ap.add_argument("--workload", help="with --stack-builds: run this workload (W1, W2, LP) instead")
    ap.add_argument("--prompt-builds", help="NAME=FLAGS,...: builds of paged_prompt.c to alternate on "
                    "--workload")
    ap.add_argument("--decode-builds", help="NAME=FLAGS,...: builds of paged_decode.c to alternate on "
                    "--workload")
    ap.add_argument("--beside", metavar="BURN,SLEEP",
                    help="with --stack-builds: a process beside, busy BURN ms, asleep SLEEP ms, on and on")
    ap.add_argument("--cold-calls", action="store_true",
                    help="four small torch calls inside a decode step, after its kernels, and on their own")
    args = ap.parse_args()
    if args.cold_calls:
        torch.set_num_threads(int(args.threads))
        for dname in args.dtypes.split(","):
            cold_calls(dname, args.steps)
        return
    for kernel in ("prompt", "decode"):
        if not getattr(args, f"{kernel}_builds"):
            continue
        if not args.workload:
            ap.error(f"--{kernel}-builds takes a --workload")
        torch.set_num_threads(int(args.threads))
        print(f"{cpu_header()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")
        load_kernel = cpu_paged.load_prompt if kernel == "prompt" else cpu_paged.load
        for dname in args.dtypes.split(","):
            builds = (item.split("=", 1) for item in getattr(args, f"{kernel}_builds").split(","))
            workload_builds(dname, {name: load_kernel(tuple(flags.split())) for name, flags in builds},
                            args.workload, args.rounds, kernel)
        return
    if args.block_rows and (args.workload or args.stack_builds):
        ap.error("--block-rows alternates on the default build, without --workload or --stack-builds")
    if args.stack_builds or args.block_rows:
        builds = {name: tuple(flags.split()) for name, flags in
                  (item.split("=", 1) for item in (args.stack_builds or "default=").split(","))}
        with beside(args.beside):
            for dname in args.dtypes.split(","):
                stack_builds(dname, builds, [int(b) for b in args.batches.split(",")], int(args.threads),
                             args.prompt_tokens, args.steps, args.rounds, args.workload,
                             [int(n) for n in args.block_rows.split(",")] if args.block_rows else None)
        return
    if args.thread_scaling:
        threads = [int(t) for t in (args.threads if args.threads != "1" else "1,2").split(",")]
        thread_scaling(args.dtypes.split(","), threads, args.steps, args.rounds)
        return
    args.threads = int(args.threads)
    torch.set_num_threads(args.threads)
    print(cpu_header())
    bw = read_bandwidth()
    pages = "2 MiB pages" if host_memory.huge_pages_enabled() else "plain pages"
    print(f"one thread's read bandwidth (torch.sum over 256 MB on {pages}, best of 5): {bw:.1f} GB/s")
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        blocks: dict = {}
        model = load_smollm2(dtype, blocks)
        applied = cpu_fast_paths(model, "cpu", gguf_blocks=blocks)
        batches = [int(b) for b in args.batches.split(",")]
        context = args.prompt_tokens + 2 + args.steps // 2        # a measured step's mean context
        nbytes = {b: weight_bytes(model, b) + kv_bytes(model, b, context) for b in batches}
        reads = ", ".join(f"{n / 1e6:.0f} MB -> floor {n / bw / 1e6:.2f} ms"
                          + (f" (steps of {', '.join(str(b) for b in batches if nbytes[b] == n)} rows)"
                             if len(set(nbytes.values())) > 1 else "")
                          for n in sorted(set(nbytes.values())))
        print(f"\n{dname}: linear path {cl.linear_path(model)} ({', '.join(applied)}); weights and K/V "
              f"({args.prompt_tokens}-token prompts) read per step {reads} at {bw:.1f} GB/s")
        blocks = max(512, max(batches) * (context + args.steps) // 16 + 64)       # no preemption
        llm = LLM(model, max_num_seqs=64, max_num_batched_tokens=2048, num_blocks=blocks, block_size=16)
        clean = {b: statistics.median(decode_steps(llm, b, args.steps, model.config.vocab_size,
                                                   args.prompt_tokens)[0]) for b in batches}
        install_timers(model, llm)
        print(f"  {'seqs':>5} {'step':>7} {'floor':>6} {'x floor':>7} | {'timed':>7} {'linears':>7} "
              f"{'lm head':>7} {'kernel':>7} {'stack':>7} {'fwd oth':>7} {'pack':>6} {'sample':>6} "
              f"{'sched+out':>9}"
              "   (ms per step)")
        for b in batches:
            floor = nbytes[b] / (bw * 1e9) * 1e3         # ms
            _, parts = decode_steps(llm, b, args.steps, model.config.vocab_size, args.prompt_tokens)
            s = collections.defaultdict(float, {k: v / args.steps * 1e3 for k, v in parts.items()})
            s["linears"] -= s["lm head"]                  # its class's timer counted the head too
            other = s["forward"] - s["linears"] - s["lm head"] - s["decode kernel"] - s["stack"]
            # the rest of the (timed) step: the runner's swaps and glue, scheduling, making outputs
            rest = s["step"] - s["forward"] - s["pack"] - s["sample"]
            print(f"  {b:>5} {clean[b] * 1e3:7.2f} {floor:6.2f} {clean[b] * 1e3 / floor:7.2f} | "
                  f"{s['step']:7.2f} {s['linears']:7.2f} {s['lm head']:7.2f} {s['decode kernel']:7.2f} "
                  f"{s['stack']:7.2f} "
                  f"{other:7.2f} {s['pack']:6.2f} {s['sample']:6.2f} {rest:9.2f}")
        for cls in (cl.PackedLinear, cl.PackedProjections, cl.Float32ComputeLinear, torch.nn.Linear):
            cls.forward = cls.forward.__wrapped__
        cpu_paged.decode_into = cpu_paged.decode_into.__wrapped__
        runner_module.pack = runner_module.pack.__wrapped__
        Sampler.sample = Sampler.sample.__wrapped__
        layer_stack.LayerStack.run = layer_stack.LayerStack.run.__wrapped__


if __name__ == "__main__":
    main()
