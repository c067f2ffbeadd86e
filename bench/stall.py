"""Stall-free batching: does a long prompt freeze the streams that are running? (issue 47)

    python bench/stall.py                    # cap off and serve's (4 + 4 a sequence), 3 rounds, + W2
    python bench/stall.py --quick            # 1 round, no W2 (a few minutes)
    python bench/stall.py --saturation W2,LP # the price offline, where prompts are short and long
    python bench/stall.py --caps 0,4+4,12+4,12+0 --rounds 2    # C+R: C tokens + R a sequence held
    python bench/stall.py --threads 1        # one torch thread (default: torch's choice, as serve's)
    python bench/stall.py --threads 1 --clock cpu   # on a shared host: CPU seconds, not wall seconds

Every engine is built as ``minicb serve`` builds its own (``LLM()`` with serve's defaults: SmolLM2 in
float32 unless ``--dtype``, ``FAST_DEFAULTS``' 256 slots and 2,048-token step, the KV pool from memory,
prefix caching on, the CPU fast paths); only the stall-free cap differs: ``C+R`` is
``max_prefill_tokens_while_decoding=C, prefill_tokens_per_seq=R`` (a step with decodes takes at most
``C + R N`` prompt tokens, ``N`` the sequences held; ``C`` alone keeps ``LLM()``'s ``R``; 0: no cap,
``LLM()``'s own default and the behaviour before issue 47). The engine is stepped in this process, as
the server's engine thread steps it, and a token's time is when ``step()`` hands it out (the server
then only sends it).

**The stall.** A stream (a 32-token prompt, 640 tokens, EOS ignored) decodes; once it has 16 tokens, a
2,000-token prompt arrives (random ids, new each round: no prefix hit) asking for 16 tokens. Printed per
run: the stream's median gap between tokens, its largest gap and their ratio (the issue's bar: at most
5x), and the long prompt's time to first token (TTFT, from its arrival); in the summary also the median
step that carries a chunk of the prompt's last quarter (its tokens attend to the most keys: the
costliest chunks, and with a cap the steps that make the largest gaps). Then a cost model fitted over
all the steps of the runs, step time = a + b x tokens, and the cap that keeps a step within 5x the step
of the ``N`` sequences held by that model, ``(5 - 1) (a / b + N)`` prompt tokens, i.e. ``C+R = 4a/b +
4`` (``minicb.core.planner`` derives it): what the defaults were chosen from, ``C`` with a margin for the
late chunks, which cost more than ``b`` a token (here ``N = 2``: the stream and the long prompt, so a
cap ``C+4`` gives the prompt ``C + 8`` tokens a step).

**The price at saturation** (``--saturation``, W2 by default without ``--quick``): each workload
(``bench/workloads.py``: W2 64 short requests, LP 48 long prompts; EOS ignored) through ``llm.generate``
with each cap, the caps alternating round by round (the order reversed every other round), the prefix
cache emptied before every run; output tokens/s, median and range. Offline the cap is pure price,
which is why ``LLM()`` leaves it off and only ``minicb serve`` sets it.

Each cap gets its own engine, all loaded before the first run; rounds alternate the caps (A, B, A, B...)
so a slow spell of a shared host hits them alike. On a host shared with other jobs, ``--threads 1
--clock cpu`` times everything on the process's CPU time instead of the wall clock: with one compute
thread that is the time the work took, without the time spent waiting for a core (what a quiet host
would show, less the memory bandwidth the other jobs take).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cpu_header  # noqa: E402  (puts this checkout's src first on the path)
from workloads import lp, random_ids, w2  # noqa: E402

from minicb.core.sampling_params import SamplingParams  # noqa: E402
from minicb.entrypoints.llm import FAST_DEFAULTS, LLM, SERVE_STALL_CAP  # noqa: E402

RATIO_BAR = 5.0                 # the bar: the largest gap at most 5x the median
CLOCK = [time.perf_counter]     # --clock cpu: time.process_time (with --threads 1: the CPU time used)


def stall_run(llm: LLM, seed: int, long_len: int, stream_tokens: int, lead: int = 16) -> dict:
    """One stream, then a ``long_len``-token prompt after its ``lead``-th token: gaps, TTFT, steps."""
    eng, rng = llm.engine, np.random.default_rng(seed)
    stream = SamplingParams(max_tokens=stream_tokens, ignore_eos=True)
    eng.add_request(f"s{seed}", random_ids(rng, 32), stream)
    long_ids = random_ids(rng, long_len)
    times, steps, late, arrived, first = [], [], [], None, None
    total0 = eng.stats.num_batched_tokens
    plans = []
    stop_listening = eng.listen(on_step=lambda ev: plans.append(ev.plan))
    while eng.has_unfinished_requests():
        t0 = CLOCK[0]()
        outs = eng.step()
        now = CLOCK[0]()
        done = eng.stats.num_batched_tokens
        steps.append((done - total0, now - t0))                  # (tokens computed, seconds) of the step
        total0 = done
        # a chunk of the prompt's last quarter: each of its tokens attends to the most keys
        if any(s.request_id == f"L{seed}" and 3 * long_len <= 4 * s.start_pos < 4 * long_len
               for s in plans[-1].seqs):
            late.append(now - t0)
        for o in outs:
            if o.request_id.startswith("s") and o.new_token_ids:
                times.append(now)
            elif o.request_id.startswith("L") and o.new_token_ids and first is None:
                first = now
        if arrived is None and len(times) >= lead:
            eng.add_request(f"L{seed}", long_ids, SamplingParams(max_tokens=16, ignore_eos=True))
            arrived = CLOCK[0]()
    stop_listening()
    gaps = np.diff(times[lead - 1:])                              # from the token before the arrival on
    med = float(np.median(gaps))
    return {"median": med, "largest": float(gaps.max()), "ratio": float(gaps.max()) / med,
            "ttft": first - arrived, "steps": steps, "late": float(np.median(late)) if late else float("nan")}


def fit(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``seconds = a + b * tokens`` over the steps (a: fixed cost, b: per token)."""
    x = np.array([s[0] for s in steps], float)
    y = np.array([s[1] for s in steps], float)
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def saturation_run(llm: LLM, wl) -> float:
    llm.reset_prefix_cache()
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0 = CLOCK[0]()
    outs = llm.generate(wl.prompts, params)
    dt = CLOCK[0]() - t0
    assert sum(len(o.token_ids) for o in outs) == wl.num_output_tokens
    return wl.num_output_tokens / dt


def cpu_kind() -> str:
    """``lscpu``'s family and model (AMD EPYC family 25 model 17 is Zen 4), from ``/proc/cpuinfo``."""
    try:
        first = open("/proc/cpuinfo").read().split("\n\n")[0]       # the first CPU's block
        fields = {k.strip(): v for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
        return f"family {fields['cpu family'].strip()} model {fields['model'].strip()}"
    except (OSError, KeyError):
        return "family/model unknown"


def parse_cap(text: str) -> dict:
    """``"32+4"``: the two ``LLM()`` arguments; ``"32"`` keeps ``LLM()``'s share a sequence; ``"0"``: off."""
    c, _, r = text.partition("+")
    per_seq = {"prefill_tokens_per_seq": int(r)} if r else {}
    return {"max_prefill_tokens_while_decoding": int(c), **per_seq}


def label(cap: str) -> str:
    return "cap off" if cap == "0" else f"cap {cap}"


def spread(xs: list[float], fmt: str) -> str:
    med = statistics.median(xs)
    return (f"{med:{fmt}}" if len(xs) == 1 else f"{med:{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = f"{SERVE_STALL_CAP}+{FAST_DEFAULTS['prefill_tokens_per_seq']}"
    ap.add_argument("--caps", default=f"0,{default}",
                    help=f"caps to compare, C or C+R (C prompt tokens + R a sequence held), 0 = no cap "
                         f"(default: 0,{default}, off and serve's)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each cap, alternating (default 3)")
    ap.add_argument("--long", type=int, default=2000, help="tokens of the long prompt (default 2000)")
    ap.add_argument("--stream-tokens", type=int, default=640,
                    help="tokens the stream asks for (default 640: most of its gaps are plain decode steps, "
                         "so its median is one even when a small cap spreads the prompt over 170 steps)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's choice)")
    ap.add_argument("--saturation", default=None, metavar="W2,LP",
                    help="workloads (bench/workloads.py) run at saturation per cap, offline as "
                         "LLM.generate runs them (default: W2; none with --quick)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall (default) or cpu: the process's CPU time (with --threads 1 on a shared host)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="serve's default float32, or bfloat16 (what bench/peer_vllm.py compares)")
    ap.add_argument("--quick", action="store_true", help="1 round, no saturation runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 1
    saturation = ("" if args.quick else "W2") if args.saturation is None else args.saturation
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            ap.error("--clock cpu needs --threads 1 (the CPU time of several threads is no clock)")
        CLOCK[0] = time.process_time
    caps = args.caps.split(",")
    print(f"{cpu_header()}; {cpu_kind()}")
    print(f"torch threads {torch.get_num_threads()}, {args.clock} clock; serve's defaults ({FAST_DEFAULTS}, "
          f"cap as given), {args.dtype}; "
          f"a {args.long}-token prompt arrives beside one stream; {args.rounds} round(s), caps alternating")
    llms = {c: LLM(dtype=args.dtype, **parse_cap(c)) for c in caps}
    for llm in llms.values():                                     # warm-up: first-call costs off the clock
        stall_run(llm, 10_000, 256, 24)
    res: dict[str, list[dict]] = {c: [] for c in caps}
    for r in range(args.rounds):
        for c in caps:
            out = stall_run(llms[c], r, args.long, args.stream_tokens)
            res[c].append(out)
            print(f"  round {r + 1} {label(c):8s} stream gap median {out['median'] * 1e3:6.1f} ms, largest "
                  f"{out['largest'] * 1e3:7.1f} ms ({out['ratio']:5.1f}x); "
                  f"long prompt TTFT {out['ttft']:5.2f} s",
                  flush=True)
    print(f"\nsummary, median (range) over {args.rounds} round(s):")
    for c in caps:
        rs = res[c]
        late = [x["late"] * 1e3 for x in rs if x["late"] == x["late"]]    # nan: no chunk in its last quarter
        print(f"  {label(c):8s} largest gap / median {spread([x['ratio'] for x in rs], '.1f')}x, "
              f"median gap {spread([x['median'] * 1e3 for x in rs], '.1f')} ms, "
              f"largest {spread([x['largest'] * 1e3 for x in rs], '.0f')} ms, "
              f"long-prompt TTFT {spread([x['ttft'] for x in rs], '.2f')} s, "
              "a step of its last quarter " + (f"{spread(late, '.0f')} ms" if late else "- (one chunk)"))
    a, b = fit([s for rs in res.values() for x in rs for s in x["steps"]])
    k = RATIO_BAR - 1
    print(f"\ncost model over every step: step = {a * 1e3:.1f} ms + {b * 1e3:.2f} ms x tokens (a / b = "
          f"{a / b:.1f} tokens); a step stays within {RATIO_BAR:g}x the step of the N sequences held up to "
          f"{k:g} (a / b + N) prompt tokens: C+R = {k * a / b:.0f}+{k:g}")
    for name in filter(None, saturation.split(",")):
        wl, tps = {"W2": w2, "LP": lp}[name](), {c: [] for c in caps}
        print(f"\n{name} at saturation ({len(wl.prompts)} requests, {wl.num_output_tokens} output tokens), "
              "caps alternating:")
        for r in range(args.rounds):
            for c in (caps if r % 2 == 0 else caps[::-1]):
                tps[c].append(saturation_run(llms[c], wl))
                print(f"  round {r + 1} {label(c):8s} {tps[c][-1]:6.1f} output tok/s", flush=True)
        base = statistics.median(tps[caps[0]])
        for c in caps:
            print(f"  {name} {label(c):8s} {spread(tps[c], '.1f')} tok/s, "
                  f"{statistics.median(tps[c]) / base:.2f}x {label(caps[0])}")
    for llm in llms.values():
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
