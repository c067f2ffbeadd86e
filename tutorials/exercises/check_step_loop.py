"""Checker of exercise 10 (step_loop.py): the step loop.

    python -m pytest tutorials/exercises/check_step_loop.py \\
        --solution my_loop.py

Your ``generate`` drives a real scheduler and a real runner on a tiny model.
Both are watched (``Watched``, ``WatchedRunner``): requests added at their
step, every run followed by an update of that plan before the next plan,
each sampling row given its request's parameters. The tokens must equal a
padded batch's.
"""

import random

import _reference
import pytest
import torch
from _checking import pick

from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.baseline import generate_padded
from minicb.runtime.runner import ModelRunner

MAX_STEPS = 400
MODEL = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, eos_token_id=3)


@pytest.fixture
def generate(solution):
    return pick(solution, "generate", _reference.generate)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM.random(MODEL, seed=0, dtype=torch.float64, std=0.3)


class Watched(Scheduler):
    """The real scheduler, watching how the loop calls it."""

    def watch(self, requests):
        self.arrival = {r[0]: r[3] for r in requests}
        self.step, self.last, self.ran = 0, None, False
        return self

    def add(self, seq, forks=()):
        due = self.arrival[seq.request_id]
        if due > self.step:
            pytest.fail(
                f"{seq.request_id!r} was added before step {self.step} was "
                f"planned, but it arrives at step {due}: add each request at "
                "the start of its arrival step, not before")
        super().add(seq, forks)

    def schedule(self, now=0.0):
        if self.last is not None:
            pytest.fail(
                f"step {self.step} was planned before step {self.step - 1} "
                "was recorded: after every run, call scheduler.update(plan, "
                "tokens, now) with that plan, so that finished requests free "
                "their slots and blocks before the next plan")
        if self.step >= MAX_STEPS:
            pytest.fail(
                f"{MAX_STEPS} steps and {[s.request_id for s in self.waiting]}"
                " still wait: a static batch waits for max_num_seqs requests "
                "until it is told no more will come: call "
                "scheduler.close_arrivals() once the last request is added")
        late = [r for r, t in self.arrival.items() if t <= self.step
                and self.get(r) is None and r not in self.done]
        if late:
            pytest.fail(f"{late} arrived by step {self.step} but were not "
                        "added before it was planned")
        self.last, self.ran = super().schedule(now), False
        return self.last

    def update(self, plan, sampled, now):
        if plan is not self.last or not self.ran:
            pytest.fail("update the scheduler with the plan it just returned, "
                        "after the runner ran it")
        self.last = None
        self.step += 1
        finished = super().update(plan, sampled, now)
        self.done.update(s.request_id for s in finished)
        return finished


class WatchedRunner(ModelRunner):
    """The real runner, checking what it is asked to run."""

    def run(self, plan, params=None):
        sched = self.sched
        if plan is not sched.last:
            pytest.fail("run the plan scheduler.schedule() just returned")
        for s in plan.seqs:
            if s.sample and (params is None or s.request_id not in params):
                pytest.fail(
                    f"runner.run got no SamplingParams for {s.request_id!r},"
                    " whose row samples: pass {request_id: its params} for "
                    "every row with sample=True")
            if s.sample and params[s.request_id] is not sched.params[
                    s.request_id]:
                pytest.fail(f"{s.request_id!r}'s row must sample with its "
                            "own request's SamplingParams")
        sched.ran = True
        return super().run(plan, params)


def serve(generate, model, requests, **kw):
    """Run ``generate`` on a watched scheduler and runner; check the end."""
    cfg = SchedulerConfig(**{**dict(max_num_seqs=4, num_blocks=32,
                                    block_size=4, max_num_batched_tokens=16),
                             **kw})
    sched = Watched(cfg).watch(requests)
    sched.done, sched.params = set(), {r[0]: r[2] for r in requests}
    runner = WatchedRunner.for_config(model, cfg, attn_backend="reference")
    runner.sched = sched
    got = generate(sched, runner, requests)
    left = [r[0] for r in requests if r[0] not in sched.done]
    assert not left, (
        f"generate returned after {sched.step} steps with {left} unfinished "
        f"(waiting {[s.request_id for s in sched.waiting]}, running "
        f"{list(sched.running)}): loop while a request is still to arrive "
        "or the scheduler has unfinished ones, even when nothing runs now")
    want = generate_padded(model, [r[1] for r in requests],
                           [r[2] for r in requests]).token_ids    # no eos
    for (rid, *_), tokens in zip(requests, want):
        assert list(got.get(rid, [])) == tokens, (
            f"{rid}: generate returned {got.get(rid)}, a padded batch "
            f"generated {tokens}: return each finished request's "
            "output_token_ids")
    return sched


def workload(n, seed, spread=0, max_tokens=(3, 8)):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(4, 61) for _ in range(rng.randint(2, 12))],
             SamplingParams(max_tokens=rng.randint(*max_tokens)),
             rng.randint(0, spread)) for i in range(n)]


def test_one_request(generate, model):
    serve(generate, model, workload(1, 0))


def test_requests_join_at_their_arrival_step(generate, model):
    serve(generate, model, workload(8, 1, spread=12))


def test_everything_in_one_step_waits_its_turn(generate, model):
    requests = workload(6, 2, max_tokens=(4, 4))   # rows finish together
    serve(generate, model, requests, max_num_seqs=2)


def test_too_little_memory_preempts_and_still_gives_the_same_tokens(
        generate, model):
    for mode, host in (("recompute", 0), ("swap", 32)):
        sched = serve(generate, model, workload(8, 3, spread=4), num_blocks=8,
                      preemption_mode=mode, num_host_blocks=host)
        assert sched.stats.num_preemptions > 0, \
            "the run must preempt (the checker is wrong)"


def test_static_batching_is_told_when_no_more_requests_come(generate, model):
    serve(generate, model, workload(5, 4, spread=3), policy="static")
