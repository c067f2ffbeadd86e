"""Helpers shared by the tutorials: printing, the tiny random model and two small drivers.

Everything here calls minicb's real modules; nothing re-implements them. Two drivers:

* ``run_scheduler``: the scheduler alone with a *fake model* (every sampled token is 5 and requests
  ignore EOS, so their lengths are exactly ``max_tokens``). Scheduling decisions do not depend on token
  values, so this shows the real schedule in milliseconds, with no torch at all.
* ``run_engine``: the real engine (model forward, paged KV cache, sampler) with a slot trace.
"""

from __future__ import annotations

import textwrap

from minicb.config import ModelConfig, SchedulerConfig
from minicb.sampling_params import SamplingParams
from minicb.scheduler import Scheduler
from minicb.sequence import Sequence
from minicb.trace import TraceRecorder

WIDTH = 100
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=4096, eos_token_id=3)


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


def run_scheduler(config: SchedulerConfig, requests, arrivals=None, on_plan=None):
    """Drive ``Scheduler(config)`` with a fake model. ``requests``: (request_id, prompt_len, max_tokens).

    ``arrivals[i]``: the step at which request i is added (default: all at step 0). ``on_plan(plan,
    scheduler)`` is called after each ``schedule()``. Returns (scheduler, plans, finish_step).
    """
    sched = Scheduler(config)
    arrivals = arrivals or [0] * len(requests)
    plans, finish_step, step, k = [], {}, 0, 0
    while k < len(requests) or sched.has_unfinished():
        while k < len(requests) and arrivals[k] <= step:
            rid, plen, out = requests[k]
            sched.add(Sequence(rid, prompt_ids(plen, k), SamplingParams(max_tokens=out, ignore_eos=True)))
            k += 1
        if k == len(requests):
            sched.close_arrivals()
        plan = sched.schedule(float(step))
        if on_plan is not None:
            on_plan(plan, sched)
        plans.append(plan)
        done = sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample}, float(step))
        for seq in done:
            finish_step[seq.request_id] = step
        step += 1
    return sched, plans, finish_step


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

    def tick(plan) -> None:             # called between schedule() and update(): the step runs now
        now[0] += cost(plan)

    eng.on_plan = tick
    rec = TraceRecorder(config.max_num_seqs, config.policy).attach(eng)
    arrivals = arrivals or [0] * len(prompts)
    outs, k, step = {}, 0, 0
    while k < len(prompts) or eng.has_unfinished_requests():
        while k < len(prompts) and arrivals[k] <= step:
            eng.add_request(f"r{k}", prompts[k], SamplingParams(max_tokens=max_tokens[k], ignore_eos=True))
            k += 1
        if k == len(prompts):
            eng.scheduler.close_arrivals()
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
    return outs, rec.trace, eng
