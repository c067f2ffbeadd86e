"""Output tokens/s of minicb's policies against Hugging Face transformers, one process, one run.

    python bench/throughput.py                 # W1 and W2, all four systems (about 15-25 min here)
    python bench/throughput.py --quick         # a smaller version of both workloads
    python bench/throughput.py --repeats 3     # every system 3 times, interleaved; medians reported
    python bench/throughput.py --attn-backend cpu-paged   # minicb's decode attention by the C kernel

Systems, all SmolLM2-135M in float32, greedy, EOS ignored, the same prompts:

* ``minicb continuous``: iteration-level scheduling, chunked prefill, paged KV;
* ``minicb static``: the padded static policy of the same engine, batches of B = 16;
* ``hf generate_batch``: transformers' own continuous batching (the manager behind
  ``generate_batch``, fed each request's own ``max_new_tokens``);
* ``hf generate``: transformers' padded ``generate``, one left-padded batch at a time (batches of 32
  for W1, of 16 for W2; a batch runs to its longest member, so only the requested tokens count).

The bars the engine issue sets: on W2 minicb continuous >= 2x hf generate_batch and >= 2.5x minicb
static; on W1 minicb continuous >= hf generate. Results go to stdout and, with ``--json``, to a file.

Timing noise on a shared machine is 10-20% from one run to the next, more than the margin of some
bars. ``--repeats N`` runs every system N times, round-robin within a workload (continuous, static,
generate_batch, generate, continuous, ...), so a slow spell of the machine hits all of them alike; the
table gives each system's median run and the range of its tokens/s, the bars use the medians, and the
continuous / static ratio of every round is printed too.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import load_smollm2, machine_description  # noqa: E402
from workloads import Workload, w1, w2  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM  # noqa: E402
from minicb.measure.metrics import matmul_flops  # noqa: E402
from minicb.model.backends import NAMES, resolve_backend  # noqa: E402
from minicb.model.weights.loader import default_model_path  # noqa: E402


def run_minicb(model, wl: Workload, **config) -> dict:
    llm = LLM(model, **config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    assert n == wl.num_output_tokens
    st = llm.engine.stats
    computed = st.num_batched_tokens + st.num_padding_tokens
    return {"seconds": dt, "tokens": n, "steps": st.num_steps, "padding_tokens": st.num_padding_tokens,
            "preemptions": st.num_preemptions, "computed_tokens": computed,
            # every computed row (real or padding) goes through the layers; only sampled rows (one per
            # output token; padding rows are never sampled) through the LM head
            "matmul_gflop": matmul_flops(model.config, computed, n) / 1e9}


def load_hf():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return m.eval()


def run_hf_generate_batch(hf, wl: Workload) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=False, eos_token_id=None,
                          pad_token_id=2)
    # Left alone, transformers sizes its KV cache from the free memory of the device (here: all of the
    # host's RAM, which got the benchmark OOM-killed). Give it room for every request at once (its
    # pages hold 256 tokens) and minicb's step budget.
    pages = sum(-(-(len(p) + n) // 256) for p, n in zip(wl.prompts, wl.output_lens))
    cbc = ContinuousBatchingConfig(num_blocks=pages + 8, max_batch_tokens=512)
    t0 = time.perf_counter()
    with hf.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc,
                                                block=True, timeout=5) as mgr:
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        done: dict[str, int] = {}
        while len(done) < len(wl.prompts):
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = len(r.generated_tokens)
            elif r is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    dt = time.perf_counter() - t0
    return {"seconds": dt, "tokens": sum(done.values())}


@torch.inference_mode()
def run_hf_generate(hf, wl: Workload, batch: int) -> dict:
    t0 = time.perf_counter()
    n_tok = 0
    for s in range(0, len(wl.prompts), batch):
        prompts, outs = wl.prompts[s:s + batch], wl.output_lens[s:s + batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        new = max(outs)
        hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=2)
        n_tok += sum(outs)     # only the tokens each request asked for are useful output
    return {"seconds": time.perf_counter() - t0, "tokens": n_tok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 + 16 requests instead of 32 + 64")
    ap.add_argument("--json", help="write the results here as well")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for every system (default: torch's own choice)")
    ap.add_argument("--attn-backend", default="auto", choices=NAMES,
                    help="minicb's attention backend (default auto: cpu-paged on the CPU, the C decode "
                         "kernel, where it builds; reference = gather + SDPA)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every system this many times, interleaved, and report medians (default 1)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    wls = [w1(num=8), w2(num=16)] if args.quick else [w1(), w2()]
    model = load_smollm2()
    hf = None if args.skip_hf else load_hf()
    results: dict[str, dict[str, dict]] = {}
    backend = resolve_backend(args.attn_backend, "cpu", torch.float32, model.config.head_dim)
    print(f"minicb attention backend: {backend}")
    cont = dict(policy="continuous", max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=2048, attn_backend=backend)
    for wl in wls:
        print(f"{wl.name}: {len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, "
              f"{wl.num_output_tokens} output tokens", flush=True)
        systems = {"minicb continuous": lambda wl=wl: run_minicb(model, wl, **cont),
                   "minicb static": lambda wl=wl: run_minicb(model, wl, policy="static", max_num_seqs=16,
                                                             num_blocks=2048, attn_backend=backend)}
        if hf is not None:
            systems["hf generate_batch"] = lambda wl=wl: run_hf_generate_batch(hf, wl)
            batch = 32 if wl.name == "W1" else 16
            systems["hf generate"] = lambda wl=wl, batch=batch: run_hf_generate(hf, wl, batch=batch)
        runs: dict[str, list[dict]] = {name: [] for name in systems}
        for rnd in range(args.repeats):
            for name, run in systems.items():
                runs[name].append(run())
                label = name if args.repeats == 1 else f"{name} ({rnd + 1}/{args.repeats})"
                _report(wl.name, label, runs[name][-1])
        results[wl.name] = {name: median_run(rs) for name, rs in runs.items()}
    print()
    print(f"machine: {machine_description()}; minicb attention backend: {backend}")
    print(f"{'workload':<9}{'system':<20}{'seconds':>9}{'tokens':>8}{'tokens/s':>10}{'vs continuous':>15}"
          f"{'rows':>8}{'GFLOP':>8}{'GFLOP/s':>9}" + (f"{'tokens/s range':>18}" if args.repeats > 1 else ""))
    for name, r in results.items():
        base = r["minicb continuous"]["tokens"] / r["minicb continuous"]["seconds"]
        for sys_name, x in r.items():
            tps = x["tokens"] / x["seconds"]
            x["tokens_per_s"] = tps
            work = ""
            if "matmul_gflop" in x:
                g = x["matmul_gflop"]
                work = f"{x['computed_tokens']:>8}{g:>8.0f}{g / x['seconds']:>9.1f}"
            if args.repeats > 1:   # hf rows have no work columns: keep the range column aligned
                lo, hi = min(x["runs_tokens_per_s"]), max(x["runs_tokens_per_s"])
                work = f"{work or ' ' * 25}{lo:>11.1f} - {hi:<6.1f}"
            print(f"{name:<9}{sys_name:<20}{x['seconds']:>9.1f}{x['tokens']:>8}{tps:>10.1f}"
                  f"{base / tps:>14.2f}x{work}")
    print("(rows: token rows the minicb engine computed, padding included; GFLOP: their matmul work, "
          "LM head included;\n GFLOP/s: that work over the wall time)")
    _bars(results)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


def median_run(runs: list[dict]) -> dict:
    """The run with the median time (the lower middle one for an even count), with every run's
    seconds and tokens/s attached, so the spread is kept next to the figure that is reported."""
    ordered = sorted(runs, key=lambda x: x["seconds"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["runs_seconds"] = [x["seconds"] for x in runs]
    mid["runs_tokens_per_s"] = [x["tokens"] / x["seconds"] for x in runs]
    return mid


def _report(wl: str, name: str, x: dict) -> None:
    print(f"  {name:<26} {x['tokens'] / x['seconds']:8.1f} tokens/s  ({x['seconds']:.1f} s)", flush=True)


def _bars(results: dict) -> None:
    def tps(w, s):
        x = results.get(w, {}).get(s)
        return x["tokens"] / x["seconds"] if x else None

    checks = [("W2", "hf generate_batch", 2.0), ("W2", "minicb static", 2.5), ("W1", "hf generate", 1.0)]
    print()
    for w, other, bar in checks:
        a, b = tps(w, "minicb continuous"), tps(w, other)
        if a and b:
            ok = "PASS" if a / b >= bar else "FAIL"
            print(f"bar {w}: continuous / {other} = {a / b:.2f}x (needs >= {bar}x)  {ok}")
    for w, r in results.items():
        c, s = r.get("minicb continuous"), r.get("minicb static")
        if c and s and len(c["runs_seconds"]) > 1:
            per_round = [sc / cc for cc, sc in zip(c["runs_seconds"], s["runs_seconds"])]
            print(f"{w}: continuous / minicb static round by round: "
                  + ", ".join(f"{q:.2f}x" for q in per_round)
                  + f" (median {statistics.median(per_round):.2f}x)")
        if c and s:
            work = s["matmul_gflop"] / c["matmul_gflop"]
            speed = (c["matmul_gflop"] / c["seconds"]) / (s["matmul_gflop"] / s["seconds"])
            print(f"{w}: static computes {work:.2f}x the matmul work of continuous, and continuous gets "
                  f"{speed:.2f}x\n    as many GFLOP/s out of the machine: {work:.2f} x {speed:.2f} = "
                  f"{work * speed:.2f}x the throughput")


if __name__ == "__main__":
    main()
