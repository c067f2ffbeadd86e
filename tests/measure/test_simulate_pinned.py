"""The simulator's results do not change when it is made faster (issue 47): a fixed small workload,
every policy, two presets and both preemption modes, against figures pinned from the code before the
speed-up (main at 345171c, by running ``fingerprint`` there: ``PYTHONPATH=<that checkout>/src python
tests/measure/test_simulate_pinned.py`` prints them).

A fingerprint is the request and step records' every field (floats exactly, via ``repr``) hashed, the
step count and a few summary figures written out, so a change shows what moved. The simulator is
deterministic and has no wall clock in it, so the figures do not depend on the machine's load.
"""

from __future__ import annotations

import hashlib

import pytest

from minicb.core.config import SchedulerConfig
from minicb.measure.workloads import make_requests
from minicb.simulate.simulator import preset, simulate

BASE = dict(max_num_seqs=16, max_num_batched_tokens=512, long_prefill_chunk=512, block_size=16,
            num_blocks=4096, max_model_len=4096)
TIGHT = dict(BASE, long_prefill_chunk=256, num_blocks=200, max_model_len=2048)     # it preempts
CASES = {
    "70b static": ("llama-3-70b", "static", BASE),
    "70b dynamic": ("llama-3-70b", "dynamic", BASE),
    "70b continuous": ("llama-3-70b", "continuous", BASE),
    "70b swap": ("llama-3-70b", "continuous", dict(TIGHT, preemption_mode="swap", num_host_blocks=400)),
    "70b recompute": ("llama-3-70b", "continuous", dict(TIGHT, preemption_mode="recompute")),
    "smollm2 static": ("smollm2-135m", "static", dict(BASE, max_num_seqs=8, max_num_batched_tokens=256,
                                                      long_prefill_chunk=128, num_blocks=1024)),
    "smollm2 continuous": ("smollm2-135m", "continuous", dict(BASE, max_num_seqs=8,
                                                              max_num_batched_tokens=256,
                                                              long_prefill_chunk=128, num_blocks=1024)),
}

# fingerprint(case) on main at 345171c, before the simulator's speed-up
PINNED = {
    '70b static': ('d4ed71d2c2534174', 2221, 0, '181.817252', '27.606488'),
    '70b dynamic': ('e974e3a2f083e38c', 2342, 0, '180.713214', '27.951508'),
    '70b continuous': ('34904103b70e895e', 1249, 0, '350.140605', '2.480766'),
    '70b swap': ('b60663bb0c04a759', 1553, 32, '284.131489', '6.263408'),
    '70b recompute': ('b1c070e836726a43', 1553, 39, '281.684282', '5.047938'),
    'smollm2 static': ('68517d4d3a02b36e', 2927, 0, '24.945599', '293.995409'),
    'smollm2 continuous': ('663f9336a07bd80a', 1662, 0, '46.180414', '155.570100'),
}

REQUEST_FIELDS = ("request_id", "arrival", "first_scheduled", "first_token", "token_times", "finish",
                  "num_prompt_tokens", "num_preemptions", "finish_reason")
STEP_FIELDS = ("step", "start", "end", "num_seqs", "num_tokens", "num_padding_tokens", "num_prefill_tokens",
               "num_decode_tokens", "num_slots_held", "num_blocks_used", "num_preempted", "flops")


def fingerprint(case: str) -> tuple[str, int, int, str, str]:
    """(hash of every record, steps, preemptions, output tok/s, TTFT P99 s) of one case."""
    name, policy, cfg = CASES[case]
    reqs = make_requests("sharegpt", 40, rate=4.0, seed=3, min_len=4, max_total=1024)
    res = simulate(reqs, SchedulerConfig(policy=policy, **cfg), preset(name))
    h = hashlib.sha256()
    for r in res.requests:
        h.update(repr([getattr(r, f) for f in REQUEST_FIELDS]).encode())
    for s in res.steps:
        h.update(repr([getattr(s, f) for f in STEP_FIELDS]).encode())
    h.update(repr(sorted(res.breakdown.items())).encode())
    s = res.summary
    return (h.hexdigest()[:16], len(res.steps), s.num_preemptions, f"{s.output_tokens_per_s:.6f}",
            f"{s.ttft_p99:.6f}")


@pytest.mark.parametrize("case", list(CASES))
def test_the_simulators_results_are_those_of_the_code_before_its_speed_up(case):
    assert fingerprint(case) == PINNED[case]


if __name__ == "__main__":
    for c in CASES:
        print(f"    {c!r}: {fingerprint(c)!r},")
