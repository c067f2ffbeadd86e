"""Where the time of minicb continuous and minicb static goes on W2, and what that bounds.

    python bench/breakdown.py --threads 1          # W2 (about 3 min here)
    python bench/breakdown.py --threads 1 --quick  # 16 requests
    python bench/breakdown.py --threads 1 --attn-backend cpu-paged   # decode attention by the C kernel

Both policies run the W2 workload of ``bench/throughput.py`` (SmolLM2 float32, greedy, EOS ignored) under
``cProfile``, and the wall time is split by the torch calls it went to:

* ``linear``: the matmuls (Q/K/V/O, MLP, LM head): the work both policies must do per computed row;
* ``attention``: ``scaled_dot_product_attention`` calls of the reference backend;
* ``gather``: ``index_select`` calls (K/V read from the paged cache through block tables, query rows);
* ``kernel``: ``cpu_paged.paged_decode``, the C decode kernel of the ``cpu-paged`` backend (0 with the
  reference backend, which does that work in ``gather`` and ``attention``);
* ``rest``: everything else (norms, RoPE, SiLU, cache writes, scheduling, packing, sampling, Python).

The time ratio static/continuous is a weighted mean of the per-part ratios, so it lies between the
smallest and the largest of them. An optimisation that speeds a part up by the same factor in both
policies (a faster kernel, less Python) keeps that part's ratio and only shifts the weights, so no such
change can lift the overall ratio above the largest part ratio; the last line prints that ceiling.
cProfile adds a few per cent of Python overhead to both runs.
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import load_smollm2, machine_description  # noqa: E402
from workloads import w2  # noqa: E402

from minicb.llm import LLM  # noqa: E402
from minicb.model.backends import NAMES, resolve_backend  # noqa: E402
from minicb.sampling_params import SamplingParams  # noqa: E402

PARTS = {"linear": "linear", "attention": "scaled_dot_product_attention", "gather": "index_select",
         "kernel": "paged_decode"}


def profile_run(model, wl, **config) -> dict[str, float]:
    """Seconds per part (see the module docstring) of one ``LLM.generate`` over ``wl``."""
    llm = LLM(model, **config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(llm.generate, wl.prompts, params)
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats      # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    out = {part: 0.0 for part in PARTS}
    # builtins are named like "<built-in method torch._C._nn.linear>" or "<method 'index_select' of ...>"
    for (_, _, name), (_, _, tottime, _, _) in stats.items():
        for part, fn in PARTS.items():
            if name.endswith(f".{fn}>") or f"'{fn}'" in name or name == fn:
                out[part] += tottime
    out["rest"] = wall - sum(out.values())
    out["total"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--attn-backend", default="auto", choices=NAMES, help="minicb's attention backend")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = w2(num=16) if args.quick else w2()
    model = load_smollm2()
    backend = resolve_backend(args.attn_backend, "cpu", torch.float32, model.config.head_dim)
    cont = profile_run(model, wl, policy="continuous", max_num_seqs=64, max_num_batched_tokens=1024,
                       num_blocks=2048, attn_backend=backend)
    stat = profile_run(model, wl, policy="static", max_num_seqs=16, num_blocks=2048, attn_backend=backend)
    print(f"machine: {machine_description()}; minicb attention backend: {backend}")
    print(f"W2 ({len(wl.prompts)} requests), seconds under cProfile")
    print(f"{'part':<11}{'continuous':>11}{'static':>9}{'static/continuous':>19}")
    parts = [p for p in PARTS if cont[p] > 0] + ["rest"]          # the kernel only where it ran
    for part in [*parts, "total"]:
        print(f"{part:<11}{cont[part]:>11.1f}{stat[part]:>9.1f}{stat[part] / cont[part]:>18.2f}x")
    best = max(parts, key=lambda p: stat[p] / cont[p])
    print(f"ceiling: speeding a part up by the same factor in both policies cannot lift static/continuous "
          f"above {stat[best] / cont[best]:.2f}x ({best})")


if __name__ == "__main__":
    main()
