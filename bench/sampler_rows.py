"""What the logits processors cost the sampler, per step, on SmolLM2's vocabulary (49,152 logits a row).

Three cases for a batch of ``rows`` rows (float32 logits, times are medians of interleaved repeats):

* ``argmax``: the bare ``torch.argmax(logits, -1).tolist()`` the all-greedy fast path was before
  processors existed;
* ``fast path``: ``Sampler.sample`` on all-greedy rows without processors (while other requests of
  the sampler do have some): must be the same as ``argmax`` (the ratio is printed);
* ``knobs``: every row greedy with penalties, ``logit_bias`` and ``min_tokens`` and 64 tokens of
  history, so its row goes through its processors one by one::

    python bench/sampler_rows.py [--rows 1 8 64] [--repeats 50]

``--bfloat16`` times the greedy choice on bfloat16 logits instead (what a bfloat16 model's LM head
gives): ``torch.argmax`` on them, ``argmax`` after widening them to float32, ``max(dim=-1).indices`` on
them (the same tokens: the first maximum, the first NaN), ``cpu_fused.argmax`` (minicb's one C pass,
where the fused ops build; "-" where they do not) and ``Sampler.sample`` on all-greedy rows (which
takes the C pass where it is built, else ``max``'s indices)::

    python bench/sampler_rows.py --bfloat16 --rows 1 16 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_model

from minicb.core.sampling_params import SamplingParams
from minicb.fastpaths import cpu_fused
from minicb.runtime.sampling import Sampler

VOCAB = 49152


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(rows: int, repeats: int) -> dict[str, float]:
    """Median microseconds of one ``sample`` call, per case (see the module docstring)."""
    logits = torch.randn(rows, VOCAB)
    s = Sampler(seed=0)
    plain = [SamplingParams(max_tokens=100)] * rows
    knob = SamplingParams(max_tokens=100, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                          logit_bias={i: 1.0 for i in range(16)}, min_tokens=50)
    prompt = torch.randint(0, VOCAB, (200,)).tolist()
    for i in range(rows):
        s.register(f"k{i}", knob, prompt, vocab_size=VOCAB, eos_token_id=2)
    s.register("other", knob, prompt, vocab_size=VOCAB, eos_token_id=2)    # some request has processors
    kids, pids = tuple(f"k{i}" for i in range(rows)), tuple(f"p{i}" for i in range(rows))
    for _ in range(64):                                                     # a history to penalise
        s.sample(logits, kids, [knob] * rows)
    cases = {"argmax": lambda: torch.argmax(logits, dim=-1).tolist(),
             "fast": lambda: s.sample(logits, pids, plain),
             "knobs": lambda: s.sample(logits, kids, [knob] * rows)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(5):                       # interleaved, so a busy machine slows all alike
        for k, fn in cases.items():
            times[k] += timed(fn, max(1, repeats // 5))
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def measure_bfloat16(rows: int, repeats: int) -> dict[str, float]:
    """Median microseconds of each greedy choice on ``rows`` rows of bfloat16 logits."""
    logits = torch.randn(rows, VOCAB).to(torch.bfloat16)
    s, plain = Sampler(seed=0), [SamplingParams(max_tokens=100)] * rows
    ids = tuple(f"p{i}" for i in range(rows))
    cases = {"argmax": lambda: torch.argmax(logits, dim=-1).tolist(),
             "widen+argmax": lambda: torch.argmax(logits.float(), dim=-1).tolist(),
             "max indices": lambda: torch.max(logits, dim=-1).indices.tolist(),
             "C argmax": lambda: cpu_fused.argmax(logits).tolist(),
             "sample": lambda: s.sample(logits, ids, plain)}
    if cpu_fused.unavailable_reason() is not None:
        del cases["C argmax"]
    assert len({tuple(fn()) for fn in cases.values()}) == 1, "the greedy choices disagree"
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(5):                       # interleaved, so a busy machine slows all alike
        for k, fn in cases.items():
            times[k] += timed(fn, max(1, repeats // 5))
    return {k: statistics.median(times[k]) * 1e6 if k in times else float("nan") for k in BF16_CASES}


BF16_CASES = ("argmax", "widen+argmax", "max indices", "C argmax", "sample")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a busy machine a [V]-sized op is slower when split)")
    ap.add_argument("--bfloat16", action="store_true", help="the greedy choice on bfloat16 logits")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; V = {VOCAB}")
    if args.bfloat16:
        print(f"{'rows':>5}" + "".join(f"{k + ' us':>16}" for k in BF16_CASES))
        for rows in args.rows:
            med = measure_bfloat16(rows, args.repeats)
            print(f"{rows:>5}" + "".join(f"{'-' if v != v else f'{v:.1f}':>16}" for v in med.values()))
        return
    print(f"{'rows':>5} {'argmax us':>10} {'fast path us':>13} {'ratio':>6} {'knobs us':>9} "
          f"{'per row us':>11}")
    for rows in args.rows:
        med = measure(rows, args.repeats)
        print(f"{rows:>5} {med['argmax']:>10.1f} {med['fast']:>13.1f} {med['fast'] / med['argmax']:>6.2f} "
              f"{med['knobs']:>9.1f} {med['knobs'] / rows:>11.1f}")


if __name__ == "__main__":
    main()
