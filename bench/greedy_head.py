"""The greedy head on W2 (``minicb.fastpaths.greedy_head``): how many panels it multiplies, what it
costs beside the whole LM head, and what W2 gains.

    python bench/greedy_head.py                   # panels and the replayed steps, 3 rounds
    python bench/greedy_head.py --e2e 6           # and W2 itself, head on and off alternating, 6 rounds

1. W2 (``bench/workloads.py``, bfloat16, ``LLM()``'s defaults, greedy, EOS ignored) runs once with the
   head on, keeping every all-greedy step's hidden rows (what the head is handed); it prints, over
   the rows, the 64-output panels each one needed multiplied exactly (of SmolLM2's 768): median,
   mean, 90th percentile, largest. Every step's tokens are checked against argmax of the whole LM
   head (the same tokens, or the script stops).
2. Those steps are replayed, each both ways in one process (the whole LM head, then the head, then
   the other order the next round): the summed seconds of each, per round, and their ratio.
3. ``--e2e N``: W2 end to end N rounds, the runner's head on and off alternating (the prefix cache
   emptied before each run): output tokens per second, the median of each, and their ratio.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cpu_header  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

from minicb import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the replayed steps")
    ap.add_argument("--e2e", type=int, default=0, help="rounds of W2 end to end, head on and off")
    args = ap.parse_args()
    print(f"{cpu_header()}; {torch.get_num_threads()} torch threads")
    wl = WORKLOADS["W2"]()
    llm = LLM(dtype="bfloat16")
    runner = llm.engine.runner
    head, lm_head = runner.greedy_head, runner.model.lm_head
    if head is None:
        sys.exit("no greedy head on this machine (it needs a bfloat16 model and AVX-512 VNNI)")
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in wl.output_lens]
    steps, per_row, tokens = [], [], head.tokens

    def keep(x):
        before = head.recomputed
        out = tokens(x)
        steps.append(x.clone())
        per_row.append((head.recomputed - before) / x.shape[0])
        if out != torch.max(lm_head(x).float(), dim=-1).indices.tolist():
            sys.exit(f"a step of {x.shape[0]} rows: the greedy head's tokens are not argmax's")
        return out

    head.tokens = keep
    llm.generate(wl.prompts, params, use_tqdm=False)
    head.tokens = tokens
    rows = sum(x.shape[0] for x in steps)
    weights = [x.shape[0] for x in steps]
    flat = sorted(p for p, w in zip(per_row, weights) for _ in range(w))
    print(f"W2: {len(steps)} all-greedy steps of 2 or more rows, {rows} rows; 64-output panels multiplied "
          f"exactly per row: median {statistics.median(flat):.0f}, mean {statistics.fmean(flat):.1f}, "
          f"90th percentile {flat[int(0.9 * len(flat))]:.0f}, largest {flat[-1]:.0f} (of "
          f"{-(-lm_head.out_features // 64)}); every step's tokens = argmax of the whole LM head")
    for rnd in range(args.rounds):
        spent = {}
        for name in (["whole", "greedy"] if rnd % 2 == 0 else ["greedy", "whole"]):
            fn = lm_head if name == "whole" else tokens
            t0 = time.perf_counter()
            for x in steps:
                fn(x)
            spent[name] = time.perf_counter() - t0
        print(f"  round {rnd + 1}: the steps' LM head {spent['whole']:.3f} s, the greedy head "
              f"{spent['greedy']:.3f} s: {spent['whole'] / spent['greedy']:.2f}x", flush=True)
    if args.e2e:
        rates = {"on": [], "off": []}
        for rnd in range(args.e2e):
            for name in (["on", "off"] if rnd % 2 == 0 else ["off", "on"]):
                runner.greedy_head = head if name == "on" else None
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                llm.generate(wl.prompts, params, use_tqdm=False)
                rates[name].append(wl.num_output_tokens / (time.perf_counter() - t0))
                print(f"  W2 round {rnd + 1} head {name}: {rates[name][-1]:.1f} output tokens/s", flush=True)
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        ratios = " ".join(f"{a / b:.3f}" for a, b in zip(rates["on"], rates["off"]))
        print(f"W2 end to end: head on {on:.1f}, off {off:.1f} tokens/s (medians of {args.e2e}): "
              f"{on / off:.3f}x; per round {ratios}")
        runner.greedy_head = head


if __name__ == "__main__":
    main()
