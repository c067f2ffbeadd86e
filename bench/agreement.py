"""How close float32 and bfloat16 runs come to float64: measured on the real model, never asserted.

    python bench/agreement.py                      # float32 + bfloat16, reference and fast modes
    python bench/agreement.py --dtypes bfloat16 --modes fast --new-tokens 64
    python bench/agreement.py --modes fast --linear auto,mkl   # each linear path (MINICB_LINEAR)
    python bench/agreement.py --dtypes bfloat16 --modes fast,int8   # MINICB_INT8_PRODUCTS=1 beside

The 16 SmolLM2 check prompts (``minicb.measure.workloads.SMOLLM2_PROMPTS``, chat template applied) are
generated greedily, 32 new tokens each, by the engine with its defaults (continuous batching, chunked
prefill, paged KV) in each dtype and mode (``reference``: ``LLM(fast_paths=False)``, the model as
``minicb/model`` reads; ``fast``: the CPU fast paths ``LLM()`` installs, bfloat16 linears in float32
where the CPU has no bfloat16 matmul; ``int8``: the fast paths with ``MINICB_INT8_PRODUCTS=1``, the
layers' products on int8-rounded activations and the GGUF's Q4_1 blocks, bfloat16 only), and compared
with the reference mode in float64, the one the
test suite holds exact (and equal to the fast mode in float64: tests/model/test_reference_mode.py).
For every output that differs the
script prints where it first diverges and the float64 logit margin there: the gap between the two
candidate tokens' float64 logits after the common prefix. A small margin means a near-tie that any
rounding may flip (bfloat16 keeps 8 significant bits, so its logits move by ~0.1-1 on this model); a
large one would point at a bug. Low precision changes only which of two near-equal tokens wins at the
first divergence; after it, the two continuations are different texts and are not compared further.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import cpu_header  # noqa: E402
from gpu_check import first_divergence_margin  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import LLM, cpu_fast_paths  # noqa: E402
from minicb.fastpaths.cpu_linear import linear_path  # noqa: E402
from minicb.fastpaths.settings import Settings  # noqa: E402
from minicb.measure.workloads import SMOLLM2_PROMPTS, smollm2_prompt_ids  # noqa: E402
from minicb.model.llama import DTYPES, LlamaForCausalLM  # noqa: E402
from minicb.model.weights.loader import load_model  # noqa: E402


def generate(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int,
             mode: str) -> list[list[int]]:
    llm = LLM(model, fast_paths=mode == "fast")
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new_tokens))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="reference,fast",
                    help="reference (fast_paths=False), fast, int8 (bfloat16: MINICB_INT8_PRODUCTS=1)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--linear", default="auto", help="linear paths to compare (cpu_linear.PATHS or auto)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_header())
    loaded = load_model(None, dtype=torch.float64)
    prompts = smollm2_prompt_ids(loaded.tokenizer)
    assert len(prompts) == len(SMOLLM2_PROMPTS)
    model64 = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.float64)
    t0 = time.perf_counter()
    ref = generate(model64, prompts, args.new_tokens, "reference")
    print(f"float64 reference: {sum(map(len, ref))} tokens in {time.perf_counter() - t0:.0f} s "
          f"({len(prompts)} prompts, {args.new_tokens} new tokens each, greedy, EOS honoured)")
    print(f"{'dtype':<10}{'linear':<13}{'mode':<11}{'identical':>10}   "
          "first divergences (token index, float64 margin)")
    for dname in args.dtypes.split(","):
        for path in args.linear.split(","):
            os.environ["MINICB_LINEAR"] = path
            for mode in args.modes.split(","):
                if mode == "int8" and dname != "bfloat16":
                    continue
                model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, DTYPES[dname])
                if mode == "fast":
                    cpu_fast_paths(model, "cpu")   # what LLM() does for a model it loads itself
                elif mode == "int8":               # as LLM() does with MINICB_INT8_PRODUCTS=1: the blocks too
                    bf16 = load_model(None, dtype=torch.bfloat16)
                    model = LlamaForCausalLM.from_state_dict(bf16.config, bf16.state_dict, torch.bfloat16)
                    settings = Settings.from_env({**os.environ, "MINICB_INT8_PRODUCTS": "1"})
                    if "int8-products" not in cpu_fast_paths(model, "cpu", settings, bf16.gguf_blocks):
                        print(f"int8: not used here ({model.layer_stack.int8_why})")
                        continue
                runs = "reference" if mode == "reference" else "fast"       # int8: on the fast paths
                got = generate(model, prompts, args.new_tokens, runs)
                same = sum(a == b for a, b in zip(got, ref))
                margins = [m for p, a, b in zip(prompts, ref, got)
                           if (m := first_divergence_margin(model64, p, a, b)) is not None]
                where = ", ".join(f"({i}, {gap:.2f})"
                                  for i, gap in sorted(margins, key=lambda m: m[1])) or "-"
                print(f"{dname:<10}{linear_path(model):<13}{mode:<11}{same:>6}/{len(prompts):<3}"
                      f"   {where}", flush=True)


if __name__ == "__main__":
    main()
