"""Helpers shared by the chapters: flags, the tiny random model, two drivers.

Everything here calls minicb's real modules; nothing re-implements them. Two
drivers, both feeding requests through ``minicb.engine.arrivals.drive``, the
loop every tool of minicb uses:

* ``run_scheduler``: the scheduler alone with a *fake model* (the simulator's
  ``SimulatedEngine``: every sampled token is 5 and requests ignore EOS, so
  their lengths are exactly ``max_tokens``). Scheduling decisions do not depend
  on token values, so this shows the real schedule in milliseconds, no torch.
* ``run_engine``: the real engine (model forward, paged KV cache, sampler) with
  a slot trace.

Width: a chapter's page shows its code and output in the documentation's content
column, which holds ``WIDTH`` = 80 monospace characters
(tests/docs/test_chapters.py says how that was measured). Chapters print within
it, and their source lines stay within it too (``tutorials/ruff.toml``).
"""

import argparse
import contextlib
import sys
from dataclasses import dataclass

from minicb.core.config import TINY_MODEL, SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.engine.arrivals import Arrival, drive
from minicb.measure.trace import TraceRecorder
from minicb.simulate.simulator import SimulatedEngine

WIDTH = 80
TINY = TINY_MODEL   # the package's one tiny random model (minicb.core.config)


def _heartbeat() -> None:
    """A chapter that runs longer than a few seconds (loading SmolLM2, a
    benchmark, starting ranks) says so on stderr every 5 s, and how long it
    took at the end, so a piped or quiet run never looks stuck. Output stays
    on stdout, untouched; ``MINICB_PROGRESS=0`` turns this off."""
    import atexit
    import multiprocessing
    import os

    from minicb.measure.progress import Progress

    script = getattr(sys.modules.get("__main__"), "__file__", None)
    rank = multiprocessing.parent_process() is not None   # a TP rank: quiet
    here = os.path.dirname(os.path.abspath(__file__))
    chapter = script and os.path.dirname(os.path.abspath(script)) == here
    if not chapter or rank or "ipykernel" in sys.modules:
        return              # only a chapter run as a script (not pytest's)
    name = f"tutorials/{os.path.basename(script)}"
    beat = Progress(name, after=5.0, every=5.0, tty=False)
    beat.update(info="still running")
    atexit.register(beat.start().stop)


_heartbeat()


@dataclass(slots=True, frozen=True)
class Exercise:
    """A "try it" change at the end of a chapter: run the script with
    ``flags`` and answer ``question``.

    ``answer`` is a regular expression: the lines of the run's output it
    matches are the answer the page shows (the generator runs the flags to get
    them; tests/docs/test_tutorials.py checks them against an independent
    computation). ``why`` explains the answer without quoting its numbers.
    """

    flags: str
    question: str
    answer: str
    why: str = ""


def flags(doc: str, **options) -> argparse.Namespace:
    """The chapter's command-line flags: ``flags(__doc__, budget=(8, "tokens
    per step"))`` accepts ``--budget N``; a flag's type is its default's. Under
    Jupyter no flag is read."""
    p = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
    for name, (default, help_) in options.items():
        opt = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(opt, action="store_true", help=help_)
        else:
            p.add_argument(opt, type=type(default), default=default,
                           metavar="N" if isinstance(default, int) else "X",
                           help=f"{help_} (default {default})")
    return p.parse_args([] if "ipykernel" in sys.modules else sys.argv[1:])


def tiny_model(seed: int = 0):
    """A 2-layer random LLaMA in float64: instant on a CPU, and exact enough
    to compare tokens."""
    import torch

    from minicb.model.llama import LlamaForCausalLM

    torch.set_num_threads(1)   # tiny matmuls: a 2nd thread costs, not helps
    return LlamaForCausalLM.random(TINY, seed=seed, dtype=torch.float64,
                                   std=0.3)


def prompt_ids(length: int, seed: int) -> list[int]:
    """``length`` reproducible token ids of the tiny vocabulary (4..63)."""
    return [4 + (seed * 7 + i * 13) % 60 for i in range(length)]


def run_scheduler(config: SchedulerConfig, requests, arrivals=None,
                  on_plan=None, on_step=None, prompts=None):
    """Drive the scheduler with a fake model. ``requests``: (request_id,
    prompt_len, max_tokens) triples.

    ``arrivals[i]``: the step at which request i is added (default: all at
    step 0). ``prompts[i]``: request i's token ids (default ``prompt_ids(
    prompt_len, i)``). ``on_plan(event)`` sees every step's ``PlanEvent`` (the
    plan and a snapshot of slots, blocks and queues), ``on_step`` its
    ``StepEvent`` (``after``: the state once the step is recorded). Every step
    lasts 1 time unit and every sampled token is 5. Returns (engine, plans,
    finish step by request id).
    """
    engine = SimulatedEngine(config, lambda plan: 1.0, token=5)
    plans, finish_step = [], {}
    engine.listen(on_plan=lambda ev: plans.append(ev.plan))
    engine.listen(on_plan=on_plan, on_step=on_step)

    def finished(outs) -> None:
        for o in outs:
            if o.finished:
                finish_step[o.request_id] = engine.last_plan.step

    arrivals = arrivals or [0] * len(requests)
    drive(engine, [Arrival(arrivals[k], rid,
                           prompts[k] if prompts else prompt_ids(plen, k),
                           SamplingParams(max_tokens=out, ignore_eos=True))
                   for k, (rid, plen, out) in enumerate(requests)],
          on_step=finished)
    return engine, plans, finish_step


def run_engine(model, config: SchedulerConfig, prompts, max_tokens,
               arrivals=None, step_cost=None):
    """Run the real engine; request i (id ``r{i}``) arrives at step
    ``arrivals[i]``.

    The engine's clock is simulated: each step (an idle one too) lasts
    ``step_cost(plan)`` time units (default 1, so every latency is in steps).
    The slot trace keeps idle steps: one column per engine step. Returns
    (outputs by request id, slot trace, engine).
    """
    from minicb.runtime.runner import engine_for

    now = [0.0]
    cost = step_cost or (lambda plan: 1.0)
    eng = engine_for(model, config, clock=lambda: now[0])

    def tick(event) -> None:   # between schedule() and update(): the step runs
        now[0] += cost(event.plan)

    eng.listen(on_plan=tick)
    rec = TraceRecorder(config.max_num_seqs, config.policy, skip_empty=False)
    rec.attach(eng)
    arrivals = arrivals or [0] * len(prompts)
    done = drive(eng, [
        Arrival(arrivals[k], f"r{k}", prompts[k],
                SamplingParams(max_tokens=max_tokens[k], ignore_eos=True))
        for k in range(len(prompts))])
    return {o.request_id: o for o in done}, rec.trace, eng


@contextlib.contextmanager
def ranks_skip_this_script():
    """Use while tensor-parallel ranks start. A process started by
    ``multiprocessing`` (spawn or forkserver) first imports the parent's main
    script, to find the functions it may need; a chapter runs top to bottom
    with no ``main()`` guard, so each rank would run the whole chapter again.
    Hiding the script's path for that moment makes the ranks skip it."""
    main = sys.modules["__main__"]
    path = main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


def rule(title: str) -> str:
    """A section line of the output, ``WIDTH`` wide: ``--- title -----``."""
    return f"--- {title} " + "-" * max(0, WIDTH - len(title) - 5)


def noise(runs: dict[int, list[float]], limit: float) -> list[str]:
    """Why a timing run is too noisy to read (empty when it is not).

    ``runs`` maps a batch size to the times of its repeated runs. A run is
    noisy when the repeats of a batch size spread more than ``limit``
    (``max / min - 1``) or when a larger batch took clearly less time than
    batch 1 (a step cannot get cheaper by doing more work: the machine was
    busier while batch 1 ran). The rule reads the numbers only; nothing is
    asserted about time."""
    out = []
    for b, times in runs.items():
        spread = max(times) / min(times) - 1
        if spread > limit:
            out.append(f"batch {b}'s {len(times)} runs spread {spread:.0%} "
                       f"(over {limit:.0%})")
    first = min(runs, default=None)
    for b, times in runs.items():
        ratio = median(times) / median(runs[first])
        if b > first and ratio < 1 - limit:
            out.append(f"batch {b} took {ratio:.2f}x batch {first}'s time")
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
