"""Prefix caching on a chat workload: hit rate, prefill tokens saved, tokens/s with caching on and off.

    python bench/prefix_cache.py              # 32 chat requests, 32 new tokens each (a few minutes here)
    python bench/prefix_cache.py --quick      # 8 requests
    python bench/prefix_cache.py --block-size 8   # the 24 shared tokens are 3 whole blocks

Every request goes through SmolLM2's chat template, so every prompt starts with the same system prompt
("You are a helpful AI assistant named SmolLM, trained by Hugging Face") and a short user message.
SmolLM2-135M-Instruct in float32, greedy, EOS ignored, the engine's defaults (16 slots, 512-token
budget, 16-token blocks unless ``--block-size``). Two arrival patterns, each run with
``enable_prefix_caching`` on and off:

* ``burst``: all requests at once (``LLM.generate``): those admitted in the first step cannot share
  (a block is cached only once the step that computed it is recorded), the later ones hit;
* ``staggered``: one new request every 2 engine steps (``add_request`` / ``step``), as a chat server
  sees them: every request after the first finds the system prompt cached.

Reported per run: prompt tokens, tokens served from the prefix cache and the hit rate
(``SchedulerStats.num_cached_prompt_tokens / num_prompt_tokens``), prefill tokens actually computed,
output tokens/s over wall time and over this process's CPU time (less sensitive to other
processes on a shared machine), medians of ``--repeats`` interleaved runs, mean time to first
token, and whether the generated tokens equal those of the caching-off run (float32 is not asserted
exact; the tests check float64).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM  # noqa: E402

MESSAGES = [
    "What is the capital of Italy?", "Name three fruits.", "How many legs does a spider have?",
    "Say hello in Spanish.", "What is 7 times 8?", "Give me a synonym for happy.",
    "What colour is the sky?", "Who wrote Hamlet?", "What is water made of?",
    "Name a planet.", "How do I boil an egg?", "What is the opposite of cold?",
    "Tell me a fun fact.", "What is the largest ocean?", "Suggest a name for a cat.",
    "What day comes after Monday?", "Translate 'thank you' to French.", "What is a noun?",
    "How many days are in a week?", "Name a musical instrument.", "What do bees make?",
    "Is a tomato a fruit?", "What is the freezing point of water?", "Recommend a book.",
    "What is the square root of 81?", "Name a famous painter.", "What language is spoken in Brazil?",
    "Why do leaves change colour?", "What is the speed of light?", "Write a short greeting.",
    "What is the tallest animal?", "How are you today?",
]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, staggered: bool) -> dict:
    eng = llm.engine
    st0 = _stats(eng)
    t0, c0 = time.perf_counter(), time.process_time()
    if staggered:
        outs, step, k = {}, 0, 0
        while k < len(prompts) or eng.has_unfinished_requests():
            if k < len(prompts) and step % 2 == 0:
                eng.add_request(f"s{k}", prompts[k], params)
                k += 1
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            step += 1
        outs = [outs[f"s{i}"] for i in range(len(prompts))]
    else:
        outs = llm.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = {k: v - st0[k] for k, v in _stats(eng).items()}
    n_out = sum(len(o.token_ids) for o in outs)
    fed_back = sum(len(o.token_ids) - 1 for o in outs)       # generated tokens computed as decodes
    return {
        "seconds": dt, "cpu_seconds": cpu, "tokens": [o.token_ids for o in outs], "output_tokens": n_out,
        "prompt_tokens": st["num_prompt_tokens"], "cached_tokens": st["num_cached_prompt_tokens"],
        "prefill_computed": st["num_batched_tokens"] - fed_back, "preemptions": st["num_preemptions"],
        "ttft": statistics.mean(o.first_token_time - o.arrival_time for o in outs),
    }


def _stats(eng) -> dict:
    s = eng.stats
    return {k: getattr(s, k) for k in ("num_prompt_tokens", "num_cached_prompt_tokens", "num_batched_tokens",
                                       "num_preemptions")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 requests instead of 32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size (the engine's default: 16)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    messages = MESSAGES[:8] if args.quick else MESSAGES
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)

    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine_description()}")
    base = LLM(dtype="float32", block_size=args.block_size)          # loads SmolLM2 once
    model, tok = base.engine.runner.model, base.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m)) for m in messages]
    lens = [len(p) for p in prompts]
    common = next(i for i in range(min(lens)) if len({p[i] for p in prompts}) > 1)
    print(f"workload: {len(prompts)} chat requests, prompts {min(lens)}-{max(lens)} tokens "
          f"(mean {statistics.mean(lens):.1f}, {common} shared by all), {args.new_tokens} new tokens each, "
          f"block_size {base.engine.config.block_size}")
    base.generate(prompts[:2], SamplingParams(max_tokens=2))          # warm-up (not measured)

    print()
    print(f"{'arrivals':<10}{'caching':<9}{'prompt':>7}{'cached':>8}{'hit rate':>9}{'prefill':>9}"
          f"{'tokens/s':>10}{'per CPU s':>10}{'TTFT ms':>9}{'same tokens':>13}")
    for staggered in (False, True):
        results = {True: [], False: []}
        for _ in range(args.repeats):
            for on in (True, False):          # interleaved, so that a change in load hits both alike
                # A fresh engine per run: the cache starts empty, so every run measures the same thing.
                llm = LLM(model, tokenizer=tok, enable_prefix_caching=on, block_size=args.block_size)
                results[on].append(run(llm, prompts, params, staggered))
        rows = {}
        for on, rs in results.items():
            r = rs[0]
            r["tps"] = statistics.median(x["output_tokens"] / x["seconds"] for x in rs)
            r["cpu_tps"] = statistics.median(x["output_tokens"] / x["cpu_seconds"] for x in rs)
            r["ttft"] = statistics.median(x["ttft"] for x in rs)
            rows[on] = r
        for on in (True, False):
            r = rows[on]
            same = sum(a == b for a, b in zip(r["tokens"], rows[False]["tokens"]))
            label = "staggered" if staggered else "burst"
            print(f"{label:<10}{'on' if on else 'off':<9}{r['prompt_tokens']:>7}"
                  f"{r['cached_tokens']:>8}{r['cached_tokens'] / r['prompt_tokens']:>9.1%}"
                  f"{r['prefill_computed']:>9}{r['tps']:>10.1f}{r['cpu_tps']:>10.1f}{1000 * r['ttft']:>9.0f}"
                  f"{f'{same}/{len(prompts)}':>13}")
        on, off = rows[True], rows[False]
        print(f"  -> {off['prefill_computed'] - on['prefill_computed']} prefill tokens saved "
              f"({1 - on['prefill_computed'] / off['prefill_computed']:.0%}), tokens/s on/off "
              f"{on['tps'] / off['tps']:.2f}x (per CPU second {on['cpu_tps'] / off['cpu_tps']:.2f}x), "
              f"preemptions {on['preemptions']}/{off['preemptions']}")


if __name__ == "__main__":
    main()
