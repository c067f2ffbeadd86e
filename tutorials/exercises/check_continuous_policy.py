"""Checker of exercise 7 (continuous_policy.py): the continuous policy.

    python -m pytest tutorials/exercises/check_continuous_policy.py \\
        --solution my_policy.py

Your class runs inside a real ``Scheduler``. Every step it plans is watched
(``watch``: the budget, the victims, the order of the rows, admission without
overtaking) and followed by the scheduler's own ``check_integrity()``; the
last tests compare your plans with minicb's step by step on random workloads
with too little memory, and your tokens on a tiny model with a padded batch's.
"""

import random

import _reference
import pytest
from _checking import pick

from minicb.core.config import SchedulerConfig
from minicb.core.policy import StepWork
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import Sequence


@pytest.fixture
def Policy(solution):
    return pick(solution, "ContinuousPolicy", _reference.ContinuousPolicy)


# --- the harness ------------------------------------------------------------
def config(**kw) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=64, block_size=4, num_blocks=64,
                enable_prefix_caching=False)
    base["max_num_seqs"] = min(8, kw.get("num_blocks", 64))  # a block a slot
    return SchedulerConfig(**{**base, **kw})


def use(sched: Scheduler, Policy) -> Scheduler:
    """Put ``Policy`` in charge of ``sched`` from the next step on, watched."""
    policy = Policy(sched)
    inner = policy.schedule
    policy.schedule = lambda: watch(policy, inner)
    sched.policy = policy
    return sched


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 6,
        first: int = 5) -> None:
    prompt = [first + (i % 7) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sched.add(Sequence(rid, prompt, params))


def step(sched: Scheduler, token: int = 9):
    """Plan a step, let the model sample ``token`` in every sampling row,
    record it, check the scheduler's invariants."""
    plan = sched.schedule()
    sampled = {s.request_id: token for s in plan.seqs if s.sample}
    sched.update(plan, sampled, 0.0)
    try:
        sched.check_integrity()
    except AssertionError as e:
        pytest.fail(f"after step {plan.step} the scheduler's invariants "
                    f"broke: {e}")
    return plan


def rows(plan) -> dict:
    return {s.request_id: len(s.token_ids) for s in plan.seqs}


def watch(policy, inner) -> StepWork:
    """Run your ``schedule`` and check what it did against the rules."""
    sched, c = policy.sched, policy.sched.config
    running = list(sched.running)                  # admission order
    waiting = [s.request_id for s in sched.waiting]
    swapped = [s.request_id for s in sched.swapped]
    left = {rid: s.num_uncomputed_tokens for rid, s in sched.running.items()}
    try:
        sched.check_integrity()
    except AssertionError as e:
        pytest.fail(f"after the last step the scheduler's invariants broke: "
                    f"{e}")
    work = inner()
    if not isinstance(work, StepWork):
        pytest.fail(f"schedule() returned {work!r}: return a StepWork")
    for i, victim in enumerate(work.preempted):
        due = running[-1 - i] if i < len(running) else None
        if victim != due:
            most = " the most important running request (admitted first);" \
                if running and victim == running[0] else ""
            pytest.fail(
                f"you preempted {victim!r},{most} preempt the least "
                f"important instead: under fcfs the newest admission, here "
                f"{due!r} (running, oldest first: {running})")
    for rid, n in work.scheduled.items():
        if rid in work.preempted:
            pytest.fail(
                f"{rid!r} was preempted in this step but is still in "
                f"work.scheduled with {n} tokens: a victim computes "
                "nothing, so its grant must be dropped (and given back to "
                "the budget)")
        if rid not in sched.running:
            pytest.fail(f"{rid!r} is in work.scheduled but is not running")
    total = sum(work.scheduled.values())
    if total > c.max_num_batched_tokens:
        pytest.fail(
            f"the step's grants {dict(work.scheduled)} sum to {total} "
            f"tokens, over the budget of {c.max_num_batched_tokens} "
            "(max_num_batched_tokens)")
    if len(work.scheduled) > c.max_num_seqs:
        pytest.fail(f"{len(work.scheduled)} rows in one step, over "
                    f"max_num_seqs = {c.max_num_seqs}")
    cap = c.long_prefill_chunk or c.max_num_batched_tokens
    for rid, n in work.scheduled.items():
        need = sched.running[rid].num_uncomputed_tokens
        if not 1 <= n <= min(need, cap):
            pytest.fail(
                f"{rid!r} was granted {n} tokens: a grant is at least 1 "
                f"and at most its {need} uncomputed tokens and the chunk "
                f"cap {cap}")
    old = [rid for rid in work.scheduled if rid in left]
    kinds = ["decode" if left[rid] == 1 else "prefill" for rid in old]
    if "prefill" in kinds and "decode" in kinds[kinds.index("prefill"):]:
        p = old[kinds.index("prefill")]
        d = old[len(kinds) - 1 - kinds[::-1].index("decode")]
        pytest.fail(
            f"the decode of {d!r} comes after the prefill chunk of {p!r} "
            f"(rows {old}): decodes go first, so that a long prompt never "
            "takes their budget")
    for kind in ("decode", "prefill"):
        these = [rid for rid, k in zip(old, kinds) if k == kind]
        if these != sorted(these, key=running.index):
            pytest.fail(
                f"the {kind} rows {these} are not in admission order "
                f"{running}: under fcfs the most important (the oldest "
                "admission) asks first")
    admitted = [rid for rid in waiting if rid in sched.running]
    resumed = [rid for rid in swapped if rid in sched.running]
    if resumed and work.preempted:
        pytest.fail(
            f"{resumed[0]!r} was swapped back in during a step that "
            f"preempted {work.preempted}: swap in only when nothing was "
            "preempted in the step")
    if resumed != swapped[:len(resumed)]:
        pytest.fail(f"{resumed} came back ahead of {swapped[0]!r}: swapped "
                    "requests come back in order, front first")
    if admitted and work.preempted:
        pytest.fail(
            f"{admitted[0]!r} was admitted in a step that preempted "
            f"{work.preempted}: when the pool is that short, nothing new "
            "comes in this step")
    if admitted and sched.swapped:
        pytest.fail(
            f"{admitted[0]!r} was admitted while "
            f"{sched.swapped[0].request_id!r} was still swapped out: "
            "swapped requests come back before any new request")
    if admitted != waiting[:len(admitted)]:
        skipped = next(w for w, a in zip(waiting, admitted + [None] * 99)
                       if w != a)
        ahead = waiting[:waiting.index(skipped)]
        past = next(a for a in admitted if a not in ahead)
        pytest.fail(
            f"{past!r} was admitted past {skipped!r}, a waiting request "
            "ahead of it that did not fit: admission must stop at the "
            "first that does not fit (no overtaking)")
    return work


# --- the rules, one scenario each -------------------------------------------
def test_a_lone_request_runs_to_its_end(Policy):
    sched = use(Scheduler(config()), Policy)
    add(sched, "r0", 6, max_tokens=3)
    plans = [rows(step(sched)) for _ in range(4) if sched.has_unfinished()]
    assert plans == [{"r0": 6}, {"r0": 1}, {"r0": 1}], (
        f"one request (prompt 6, max_tokens 3) was planned {plans}: the "
        "whole prompt in the first step (it samples token 1), then one "
        "token a step")


def test_decodes_go_first_then_a_prefill_chunk_takes_the_rest(Policy):
    sched = Scheduler(config(max_num_batched_tokens=8))
    for rid in ("r0", "r1", "r2"):
        add(sched, rid, 2)
    step(sched)                         # minicb's policy prefills the three
    add(sched, "r3", 20)
    use(sched, Policy)
    got = rows(step(sched))
    assert got == {"r0": 1, "r1": 1, "r2": 1, "r3": 5}, (
        f"three requests decoding and a new 20-token prompt, budget 8: you "
        f"planned {got}; each decode takes 1 token, the new prompt a chunk "
        "of the 5 left (its rest comes in the next steps)")


def test_admission_stops_at_the_first_that_does_not_fit(Policy):
    sched = Scheduler(config(num_blocks=4))
    add(sched, "r0", 4)
    step(sched)                         # r0 holds 1 block, decodes into a 2nd
    add(sched, "r1", 12, max_tokens=2)  # needs 3 blocks: 2 are free
    add(sched, "r2", 3)                 # needs 1: it would fit
    use(sched, Policy)
    got = rows(step(sched))
    assert got == {"r0": 1}, (
        f"you planned {got}: r0 decodes into its 2nd block, then r1 needs 3 "
        "of the 1 left, so nothing is admitted")


def test_the_victim_is_the_least_important(Policy):
    sched = Scheduler(config(num_blocks=3))
    add(sched, "r0", 4)
    add(sched, "r1", 4)
    step(sched)                         # both hold 1 block, need a 2nd: 1 free
    use(sched, Policy)
    plan = step(sched)
    assert list(plan.preempted) == ["r1"] and rows(plan) == {"r0": 1}, (
        f"r0 takes the last free block; r1 needs one and is the newest "
        f"admission, so it preempts itself. You planned {rows(plan)}, "
        f"preempting {list(plan.preempted)}")


def test_a_victims_grant_goes_back_to_the_budget(Policy):
    kw = dict(num_blocks=4, long_prefill_chunk=4)
    sched = Scheduler(config(max_num_batched_tokens=12, **kw))
    add(sched, "A", 12, max_tokens=2)
    add(sched, "B", 12, max_tokens=2)
    add(sched, "V", 4, max_tokens=4)
    step(sched)                         # A 4, B 4, V 4 (V samples); 1 free
    sched.config = config(max_num_batched_tokens=8, **kw)
    use(sched, Policy)
    plan = step(sched)
    got = rows(plan)
    assert list(plan.preempted) == ["V"], \
        f"preempted {list(plan.preempted)}; expected ['V']"
    assert got == {"A": 4, "B": 4}, (
        f"budget 8: V's decode was granted 1 token, then A needed a block "
        f"and V (the newest) was preempted. You planned {got}: after "
        "preempting a victim its grant must be given back to the budget, "
        "so B gets the 8 - 4 = 4 tokens left")


def test_swapped_requests_come_back_before_new_ones(Policy):
    sched = Scheduler(config(num_blocks=3, num_host_blocks=8,
                             preemption_mode="swap"))
    add(sched, "r0", 4)
    add(sched, "r1", 4)
    step(sched)
    use(sched, Policy)
    step(sched)                         # r1 is swapped out
    assert [s.request_id for s in sched.swapped] == ["r1"], \
        "r1 should be swapped out here"
    add(sched, "r2", 2, max_tokens=2)
    for _ in range(40):                 # watch fails if r2 overtakes r1
        if sched.has_unfinished():
            step(sched)
    assert not sched.has_unfinished(), (
        f"not done after 40 steps: waiting "
        f"{[s.request_id for s in sched.waiting]}, swapped "
        f"{[s.request_id for s in sched.swapped]}; a swapped request comes "
        "back when the blocks allow (blocks.can_swap_in, sched.resume)")
    assert sched.stats.num_swap_ins == 1, "r1 was never swapped back in"


def test_a_cached_prefix_is_shared_not_recomputed(Policy):
    sched = use(Scheduler(config(enable_prefix_caching=True)), Policy)
    add(sched, "r0", 9, max_tokens=1)
    step(sched)                         # r0's 2 full blocks enter the cache
    add(sched, "r1", 11, max_tokens=1)  # the same first 9 tokens, 2 more
    got = rows(step(sched))
    assert got == {"r1": 3}, (
        f"r1's first 8 tokens are cached (r0's 2 full blocks): it computes "
        f"the other 3 only, you planned {got}. At admission ask "
        "self.blocks.computed_blocks(seq.all_token_ids) and admit with "
        "those blocks at the head of its table")


# --- sweeps: minicb's plans, and a real model's tokens ----------------------
def lockstep(Policy, cfg: SchedulerConfig, seed: int) -> int:
    """A random workload through minicb's policy and yours side by side: the
    plans must agree step by step. Returns the number of preemptions."""
    rng = random.Random(seed)
    n = 12
    arrivals = sorted(rng.randrange(0, 20) for _ in range(n))
    jobs = [(f"r{i}", rng.randint(1, 14), rng.randint(1, 10))
            for i in range(n)]
    ref, you = Scheduler(cfg), use(Scheduler(cfg), Policy)
    for k in range(2000):
        for (rid, p, m), t in zip(jobs, arrivals):
            if t == k:
                for s in (ref, you):
                    add(s, rid, p, max_tokens=m, first=4 + int(rid[1:]))
        if k > max(arrivals) and not ref.has_unfinished():
            break
        state = (f"running {list(you.running)}, waiting "
                 f"{[s.request_id for s in you.waiting]}, swapped "
                 f"{[s.request_id for s in you.swapped]}")
        want, got = step(ref), step(you)
        if (rows(want), want.preempted) != (rows(got), got.preempted):
            pytest.fail(
                f"random workload {seed} ({cfg.preemption_mode}, "
                f"{cfg.num_blocks} blocks of {cfg.block_size}, budget "
                f"{cfg.max_num_batched_tokens}, chunk cap "
                f"{cfg.long_prefill_chunk}), step {k}, with {state}: minicb "
                f"plans {rows(want)} preempting {list(want.preempted)}, you "
                f"plan {rows(got)} preempting {list(got.preempted)}")
    assert not you.has_unfinished(), "your scheduler left requests unfinished"
    return ref.stats.num_preemptions


def test_the_same_plans_as_minicb_on_random_workloads(Policy):
    preemptions = 0
    for seed in range(12):
        mode = "swap" if seed % 2 else "recompute"
        cfg = config(num_blocks=8, max_num_seqs=4,
                     max_num_batched_tokens=10 + seed % 3 * 6,
                     long_prefill_chunk=(None, 4, 6)[seed % 3],
                     preemption_mode=mode,
                     num_host_blocks=16 if mode == "swap" else 0)
        preemptions += lockstep(Policy, cfg, seed)
    assert preemptions > 0, "the sweep must preempt (the checker is wrong)"


def test_tokens_equal_a_padded_batch_on_a_tiny_model(Policy):
    import torch

    from minicb.core.config import ModelConfig
    from minicb.model.llama import LlamaForCausalLM
    from minicb.runtime.baseline import generate_padded
    from minicb.runtime.runner import ModelRunner

    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)
    model = LlamaForCausalLM.random(cfg, seed=0, dtype=torch.float64, std=0.3)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 61) for _ in range(rng.randint(2, 14))]
               for _ in range(8)]
    params = SamplingParams(max_tokens=8)
    sc = config(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=12,
                long_prefill_chunk=5, enable_prefix_caching=True)
    sched = use(Scheduler(sc), Policy)
    runner = ModelRunner.for_config(model, sc, attn_backend="reference")
    requests = [(f"r{i}", p, params, 0) for i, p in enumerate(prompts)]
    done = _reference.generate(sched, runner, requests)   # the step loop
    step(sched)                                 # checks the last step too
    want = generate_padded(model, prompts, params).token_ids
    assert sched.stats.num_preemptions > 0, \
        "the run must preempt (the checker is wrong)"
    for i in range(len(prompts)):
        assert done.get(f"r{i}") == want[i], (
            f"request r{i}: a tiny model scheduled by your policy generated "
            f"{done.get(f'r{i}')}, a padded batch {want[i]}: a row's "
            "tokens, start or blocks are wrong")
