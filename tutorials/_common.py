"""Helpers shared by the tutorials: printing, the tiny random model and two small drivers.

Everything here calls minicb's real modules; nothing re-implements them. Two drivers:

* ``run_scheduler``: the scheduler alone with a *fake model* (the simulator's ``SimulatedEngine``:
  every sampled token is 5 and requests ignore EOS, so their lengths are exactly ``max_tokens``).
  Scheduling decisions do not depend on token values, so this shows the real schedule in
  milliseconds, with no torch at all.

Both feed requests through ``minicb.arrivals.drive``, the loop every tool of minicb uses.
* ``run_engine``: the real engine (model forward, paged KV cache, sampler) with a slot trace.
"""

from __future__ import annotations

import textwrap

from minicb.arrivals import Arrival, drive
from minicb.config import TINY_MODEL, SchedulerConfig
from minicb.measure.trace import TraceRecorder
from minicb.sampling_params import SamplingParams
from minicb.simulate.simulator import SimulatedEngine

WIDTH = 100
TINY = TINY_MODEL   # the package's one tiny random model (minicb.config)


def chapter(number: int, title: str) -> None:
    line = "=" * WIDTH
    print(f"{line}\nChapter {number:02d}: {title}\n{line}")


def section(title: str) -> None:
    print(f"\n--- {title} " + "-" * max(0, WIDTH - len(title) - 5))


def explain(text: str) -> None:
    """Print a paragraph of explanation (dedented, wrapped to the tutorial width)."""
    for para in textwrap.dedent(text).strip().split("\n\n"):
        print(textwrap.fill(" ".join(para.split()), WIDTH))
        print()


def tiny_model(seed: int = 0):
    """A 2-layer random LLaMA in float64: instant on a CPU, and exact enough to compare tokens."""
    import torch

    from minicb.model.llama import LlamaForCausalLM

    torch.set_num_threads(1)   # tiny matmuls: a second thread costs more in synchronisation than it adds
    return LlamaForCausalLM.random(TINY, seed=seed, dtype=torch.float64, std=0.3)


def prompt_ids(length: int, seed: int) -> list[int]:
    """``length`` reproducible token ids of the tiny vocabulary (4..63; 3 is EOS)."""
    return [4 + (seed * 7 + i * 13) % 60 for i in range(length)]


def run_scheduler(config: SchedulerConfig, requests, arrivals=None, on_plan=None, on_step=None):
    """Drive the scheduler with a fake model. ``requests``: (request_id, prompt_len, max_tokens).

    ``arrivals[i]``: the step at which request i is added (default: all at step 0). ``on_plan(event)``
    sees every step's ``PlanEvent`` (the plan and a snapshot of slots, blocks and queues), ``on_step`` its
    ``StepEvent`` (the state after the step is recorded). The engine
    here is the simulator's: the real ``Scheduler``, every step lasting 1 time unit, every sampled token
    5. Returns (engine, plans, finish_step).
    """
    engine = SimulatedEngine(config, lambda plan: 1.0, token=5)
    plans, finish_step = [], {}
    engine.listen(on_plan=lambda ev: plans.append(ev.plan))
    engine.listen(on_plan=on_plan, on_step=on_step)

    def finished(outs) -> None:
        for o in outs:
            finish_step[o.request_id] = engine.last_plan.step

    arrivals = arrivals or [0] * len(requests)
    drive(engine, [Arrival(arrivals[k], rid, prompt_ids(plen, k),
                           SamplingParams(max_tokens=out, ignore_eos=True))
                   for k, (rid, plen, out) in enumerate(requests)], on_step=finished)
    return engine, plans, finish_step


def run_engine(model, config: SchedulerConfig, prompts, max_tokens, arrivals=None, step_cost=None):
    """Run the real engine; request i (id ``r{i}``) arrives at step ``arrivals[i]``.

    The engine's clock is simulated: each step (an idle one too) lasts ``step_cost(plan)`` time units
    (default 1, so every latency is in steps). A step starts when it is planned and its tokens exist
    when it ends. Returns (outputs by request id, slot trace, engine).
    """
    from minicb.engine import LLMEngine

    now = [0.0]
    cost = step_cost or (lambda plan: 1.0)
    eng = LLMEngine(model, config, clock=lambda: now[0])

    def tick(event) -> None:            # between schedule() and update(): the step runs now
        now[0] += cost(event.plan)

    eng.listen(on_plan=tick)
    rec = TraceRecorder(config.max_num_seqs, config.policy).attach(eng)
    arrivals = arrivals or [0] * len(prompts)
    done = drive(eng, [Arrival(arrivals[k], f"r{k}", prompts[k],
                               SamplingParams(max_tokens=max_tokens[k], ignore_eos=True))
                       for k in range(len(prompts))])
    return {o.request_id: o for o in done}, rec.trace, eng
