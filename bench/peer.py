"""The peer run: minicb continuous beside Hugging Face transformers' continuous batching
(``generate_batch``'s manager) on the very requests of a ``minicb bench`` run, arriving at the same
times, one process, wall clock.

    python bench/peer.py bench/results/cpu-smollm2/bench.json --json bench/results/peer.json

Both systems get the same prompts (the random token ids ``minicb bench`` made from its seed), the same
output lengths (EOS ignored) and the same Poisson arrival times; both run SmolLM2-135M in float32 with
the same number of torch threads (1 by default), greedy. transformers' manager records per-token
timestamps (``record_timestamps=True``), so TTFT and inter-token latency are measured for both the same
way; its queueing delay is ``lifespan[0] - arrival`` (when the request stopped pending). Padding waste
and compute utilisation are minicb-only columns (no step records from transformers).

The two systems run one after the other, so on a shared machine the load of other processes can differ
between them: the script runs them alternately ``--rounds`` times and reports each round.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from throughput import load_hf  # noqa: E402

from minicb.measure.bench_cli import build_model, machine_description, make_prompts, run_policy  # noqa: E402
from minicb.measure.metrics import RequestRecord, format_table, summarize  # noqa: E402
from minicb.measure.workloads import Request  # noqa: E402


def run_hf(hf, requests: list[Request], prompts: dict[str, list[int]]) -> list[RequestRecord]:
    """Feed ``requests`` to transformers' continuous batching manager at their arrival times."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max(r.output_len for r in requests), do_sample=False,
                          eos_token_id=None, pad_token_id=2)
    order = sorted(requests, key=lambda r: r.arrival)
    arrival = {}
    done: dict[str, object] = {}
    with hf.continuous_batching_context_manager(generation_config=gc, block=True, timeout=5) as mgr:
        t0 = time.perf_counter() + 0.01
        k = 0
        while len(done) < len(order):
            now = time.perf_counter()
            while k < len(order) and t0 + order[k].arrival <= now:
                r = order[k]
                arrival[r.request_id] = t0 + r.arrival
                mgr.add_request(prompts[r.request_id], request_id=r.request_id, max_new_tokens=r.output_len,
                                record_timestamps=True)
                k += 1
            wait = (t0 + order[k].arrival - now) if k < len(order) else 0.5
            out = mgr.get_result(timeout=max(0.001, min(wait, 0.5)))
            if out is not None and out.is_finished():
                done[out.request_id] = out
            elif out is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    recs = []
    for rid, out in done.items():
        stamps = list(out.timestamps or [])
        recs.append(RequestRecord(rid, arrival[rid], out.lifespan[0], stamps[0] if stamps else None, stamps,
                                  out.lifespan[1], len(out.prompt_ids),
                                  finish_reason="length" if out.error is None else "error"))
        assert len(out.generated_tokens) == next(r.output_len for r in requests if r.request_id == rid)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench_json", help="a minicb bench output: its requests, prompts seed and limits")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="write the summaries here")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="minicb's token budget (default: the bench run's); transformers picks its own")
    ap.add_argument("--long-prefill-chunk", type=int, default=None, help="minicb's chunk cap (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    meta = json.loads(pathlib.Path(args.bench_json).read_text())["meta"]
    requests = [Request(r["id"], r["prompt_len"], r["output_len"], r["arrival"]) for r in meta["workload"]]
    model, _ = build_model("default", "float32")
    prompts = make_prompts(requests, model.config.vocab_size, meta["args"]["seed"])
    hf = load_hf()
    print(f"machine: {machine_description()}")
    print(f"{len(requests)} requests from {args.bench_json}, wall clock, {args.threads} torch thread(s)")
    rows, blob = [], {"machine": machine_description(), "date": time.strftime("%Y-%m-%d"),
                      "source": args.bench_json, "rounds": []}
    sc = dict(meta["scheduler"])
    if args.max_num_batched_tokens:
        sc["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.long_prefill_chunk is not None:
        sc["long_prefill_chunk"] = args.long_prefill_chunk or None
    blob["minicb_scheduler"] = sc
    for rnd in range(args.rounds):
        reqs, steps, stats, _ = run_policy(model, "continuous", requests, prompts, sc)
        ours = summarize(reqs, steps, label=f"minicb continuous (round {rnd + 1})",
                         num_slots=sc["max_num_seqs"], num_blocks=sc["num_blocks"],
                         peak_flops=meta["peak_gflops"] * 1e9, num_preemptions=stats.num_preemptions)
        theirs = summarize(run_hf(hf, requests, prompts), label=f"hf generate_batch (round {rnd + 1})")
        rows += [ours, theirs]
        blob["rounds"].append({"minicb": ours.to_dict(), "hf": theirs.to_dict()})
        print(format_table([ours, theirs]), flush=True)
    print()
    print(format_table(rows))
    print(format_table(rows, markdown=True))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(blob, indent=1))


if __name__ == "__main__":
    main()
