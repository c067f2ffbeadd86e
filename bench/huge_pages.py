"""The skinny kernel's weights on 2 MiB pages against plain ones: read rate, decode steps, A/B in one run.

    python bench/huge_pages.py                                # float32 and bfloat16, 1/4/16 sequences
    python bench/huge_pages.py --dtypes bfloat16 --batches 1 --rounds 12

``fastpaths/host_memory.py`` puts the panels the skinny kernel streams through every step on memory advised
``MADV_HUGEPAGE``; ``MINICB_HUGE_PAGES=0`` leaves them on plain 4 KiB pages. This script measures what
that is worth on this machine, with the host's drift taken out as far as one process can: it loads
SmolLM2 twice per dtype, once each way, keeps both engines, and times decode steps of B sequences
(``decode_floor.decode_steps``: 64-token prompts, prefilled, then 20 decode steps, their median)
alternately on the two, for ``--rounds`` rounds, the order swapped every round. It prints the
medians and the median of the per-round ratios, and first one thread's read rate over 256 MB on each
kind of page (``torch.sum``, best of five). Each figure names the CPU (the header line).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_header, load_smollm2  # noqa: E402
from decode_floor import decode_steps, read_bandwidth  # noqa: E402

from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402
from minicb.fastpaths import host_memory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(cpu_header())
    os.environ.pop("MINICB_HUGE_PAGES", None)
    if not host_memory.huge_pages_enabled():
        raise SystemExit("huge pages are not available here (not Linux, or transparent huge pages 'never')")
    print(f"one thread's read rate over 256 MB: plain pages {read_bandwidth(plain=True):.1f} GB/s, "
          f"2 MiB pages {read_bandwidth():.1f} GB/s")
    batches = [int(b) for b in args.batches.split(",")]
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        engines = {}
        for kind, switch in (("plain", "0"), ("huge", "1")):
            os.environ["MINICB_HUGE_PAGES"] = switch          # read while the panels are made
            blocks: dict = {}                 # the GGUF's blocks, which LLM() hands the fast paths
            model = load_smollm2(dtype, blocks)
            cpu_fast_paths(model, "cpu", gguf_blocks=blocks)
            engines[kind] = (LLM(model, max_num_seqs=64, max_num_batched_tokens=2048, num_blocks=512,
                                 block_size=16), model.config.vocab_size)
        os.environ.pop("MINICB_HUGE_PAGES")
        ms = {(k, b): [] for k in engines for b in batches}
        for r in range(args.rounds):
            for b in batches:
                for kind in (("plain", "huge") if r % 2 == 0 else ("huge", "plain")):
                    llm, vocab = engines[kind]
                    ms[(kind, b)].append(statistics.median(decode_steps(llm, b, 20, vocab)[0]) * 1e3)
        for b in batches:
            plain, huge = ms[("plain", b)], ms[("huge", b)]
            ratios = [p / h for p, h in zip(plain, huge)]
            print(f"{dname:<9} {b:>3} sequences: a decode step {statistics.median(plain):6.2f} ms on plain "
                  f"pages, {statistics.median(huge):6.2f} on 2 MiB ones; plain / huge, per round: median "
                  f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}, "
                  f"{args.rounds} rounds)", flush=True)
        del engines


if __name__ == "__main__":
    main()
