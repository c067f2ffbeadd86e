"""W2 through ``LLM()`` on each linear path (``cpu_linear.PATHS``), alternating round by round: the ratio.

    python bench/linear_paths.py                                     # float32: onednn-f32 vs mkl, 3 rounds
    python bench/linear_paths.py --dtype bfloat16 --paths onednn-bf16,onednn-f32,mkl --rounds 2
    python bench/linear_paths.py --workload W1

``mkl`` is what minicb did before every layer was packed: MKL's float32 ``F.linear`` for the layers and
the LM head alone packed for oneDNN; ``onednn-f32`` / ``onednn-bf16`` pack every layer. One model per
path stays loaded (built as ``LLM()`` builds it: ``cpu_fast_paths`` with ``MINICB_LINEAR`` set), and each
round runs W2 (``bench/workloads.py``, 64 requests, EOS ignored, ``LLM()``'s defaults, the prefix cache
emptied first) once on every path in turn, so a slow spell of the shared machine hits all paths alike.
Prints tokens/s per run, the median per path, each path's median ratio to the first one (ratios of
runs of the same round), and whether the paths' first 8 tokens agree request by request.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cpu_header, load_smollm2  # noqa: E402
from workloads import w1, w2  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402
from minicb.model.cpu_linear import linear_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--paths", default="onednn-f32,mkl", help="cpu_linear.PATHS, the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workload", default="W2", choices=["W1", "W2"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_header(), flush=True)
    wl = w2() if args.workload == "W2" else w1()
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    paths = args.paths.split(",")
    llms = {}
    for path in paths:
        os.environ["MINICB_LINEAR"] = path
        model = load_smollm2(getattr(torch, args.dtype))
        applied = cpu_fast_paths(model, "cpu")
        print(f"{path}: {linear_path(model)} ({', '.join(applied)})", flush=True)
        llms[path] = LLM(model)
    runs: dict[str, list[float]] = {p: [] for p in paths}
    first8: dict[str, list] = {}
    for rnd in range(args.rounds):
        for path in paths:
            llm = llms[path]
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(wl.prompts, params)
            dt = time.perf_counter() - t0
            runs[path].append(sum(len(o.token_ids) for o in outs) / dt)
            first8[path] = [o.token_ids[:8] for o in outs]
            print(f"  round {rnd + 1} {path:<12} {runs[path][-1]:7.1f} tokens/s  "
                  f"({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f})", flush=True)
    base = paths[0]
    print(f"\n{wl.name} {args.dtype}, {args.threads} thread(s), {args.rounds} rounds:")
    for path in paths:
        ratios = [b / a for a, b in zip(runs[path], runs[base])]
        same = sum(a == b for a, b in zip(first8[path], first8[base]))
        print(f"  {path:<12} median {statistics.median(runs[path]):7.1f} tokens/s; {base} / {path} per "
              f"round {', '.join(f'{r:.2f}x' for r in ratios)}; first 8 tokens as {base}'s in "
              f"{same}/{len(wl.prompts)}")


if __name__ == "__main__":
    main()
