"""A step is a transaction: interrupts and exceptions anywhere in a step leave the engine consistent.

``LLMEngine._step`` has three phases (see its docstring): *plan* (``schedule`` + PlanEvent listeners)
rolls back to the scheduler's checkpoint, *compute* (the runner: swaps, pack, forward, sample) fails
the step's requests with the reason, *record* (``update`` + outputs) is all or nothing. Here a
``KeyboardInterrupt`` (or an exception) is injected at every instrumented point of a step — inside
``schedule`` (admission, allocation, the swap-out of a preemption), in listeners, in every part of the
runner, inside ``update`` and while outputs are made — in swap and recompute mode. After each run:
every request ended exactly once, every request that did not fail got exactly the padded baseline's
tokens, the tokens it streamed equal its final tokens, and every block and slot is free again.

The scheduler's ``checkpoint`` / ``restore`` are checked directly too: restoring and replaying gives
the very same plans as never having run the undone steps.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minicb.runtime.runner
from helpers import TINY, assert_drained, baseline_tokens, tiny_model
from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import Sequence
from minicb.core.slot_table import SlotTable
from minicb.engine.llm_engine import LLMEngine
from minicb.engine.outputs import OutputTracker
from minicb.model.kv_cache import KVCache
from minicb.runtime.runner import engine_for
from minicb.runtime.sampling import Sampler
from robust_helpers import random_workload

PROMPTS, PARAMS, _ = random_workload(10, seed=5, prompt_len=(2, 24), max_tokens=(2, 14), arrival_gap=0)


def config(mode: str) -> SchedulerConfig:
    """Small enough that preemption (and in swap mode, swapping) happens on most runs."""
    return SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=24, long_prefill_chunk=12, block_size=4,
                           num_blocks=14, num_host_blocks=12 if mode == "swap" else 0, preemption_mode=mode,
                           max_model_len=256)


_EXPECTED: list = []


def expected() -> list[list[int]]:
    if not _EXPECTED:
        _EXPECTED.extend(baseline_tokens(tiny_model(), PROMPTS, PARAMS, TINY.eos_token_id))
    return _EXPECTED


class Once:
    """Raise ``exc`` at the ``at``-th call (1-based) of whatever it wraps, and never again."""

    def __init__(self, at: int, exc: BaseException) -> None:
        self.at, self.exc, self.calls, self.fired = at, exc, 0, False

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.at and not self.fired:
            self.fired = True
            raise self.exc


def wrap(monkeypatch, owner, name: str, trigger: Once) -> None:
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        trigger()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


# Every instrumented point of a step: where the trigger is installed.
POINTS = {
    "schedule: entry": lambda mp, t, eng: wrap(mp, Scheduler, "schedule", t),
    "schedule: admission (slot assign)": lambda mp, t, eng: wrap(mp, SlotTable, "assign", t),
    "schedule: block allocation": lambda mp, t, eng: wrap(mp, BlockManager, "allocate", t),
    "schedule: preemption swap-out": lambda mp, t, eng: wrap(mp, BlockManager, "swap_out", t),
    "schedule: swap-in": lambda mp, t, eng: wrap(mp, BlockManager, "swap_in", t),
    "plan listener": lambda mp, t, eng: eng.listen(on_plan=lambda ev: t()),
    "runner: swap-out copy": lambda mp, t, eng: wrap(mp, KVCache, "swap_out", t),
    "runner: swap-in copy": lambda mp, t, eng: wrap(mp, KVCache, "swap_in", t),
    "runner: pack": lambda mp, t, eng: wrap(mp, minicb.runtime.runner, "pack", t),
    "runner: forward (a layer's K/V write)": lambda mp, t, eng: wrap(mp, KVCache, "write", t),
    "runner: sample": lambda mp, t, eng: wrap(mp, Sampler, "sample", t),
    "update: entry": lambda mp, t, eng: wrap(mp, Scheduler, "update", t),
    "update: a token appended": lambda mp, t, eng: wrap(mp, Sequence, "append_token", t),
    "update: prefix-cache offer": lambda mp, t, eng: wrap(mp, BlockManager, "cache_full_blocks", t),
    "record: an output made": lambda mp, t, eng: wrap(mp, OutputTracker, "output", t),
    "step listener": lambda mp, t, eng: eng.listen(on_step=lambda ev: t()),
}


def run_interrupted(eng: LLMEngine, trigger: Once, exc_type) -> dict:
    """Serve PROMPTS, catching the injected interrupt like a user who presses Ctrl-C and goes on."""
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(f"r{i}", p, sp)
    eng.close_arrivals()
    outs, streamed, steps = {}, {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "the engine does not drain after the interrupt"
        try:
            got = eng.step()
        except exc_type:
            eng.scheduler.check_integrity()           # consistent at the moment the interrupt lands
            continue
        for o in got:
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in outs, f"{o.request_id} ended twice"
                outs[o.request_id] = o
        eng.scheduler.check_integrity()
    assert set(outs) == {f"r{i}" for i in range(len(PROMPTS))}, "a request was lost"
    for rid, o in outs.items():
        assert streamed[rid] == o.token_ids, f"{rid}: streamed tokens != final tokens"
    assert_drained(eng)
    return outs


SWAP_ONLY = {"schedule: preemption swap-out", "schedule: swap-in", "runner: swap-out copy",
             "runner: swap-in copy"}                # points that only a swap-mode step passes through
CASES = [(point, mode) for point in sorted(POINTS) for mode in ("recompute", "swap")
         if mode == "swap" or point not in SWAP_ONLY]


@pytest.mark.slow
@pytest.mark.parametrize(("point", "mode"), CASES)
def test_an_interrupt_at_any_point_of_a_step_leaves_every_request_right_or_failed(monkeypatch, point, mode):
    want = expected()
    fired = 0
    for at in (1, 4, 9):
        trigger = Once(at, KeyboardInterrupt())
        with monkeypatch.context() as mp:
            eng = engine_for(tiny_model(), config(mode))
            POINTS[point](mp, trigger, eng)
            outs = run_interrupted(eng, trigger, KeyboardInterrupt)
        fired += trigger.fired
        for i in range(len(PROMPTS)):
            o = outs[f"r{i}"]
            if o.finish_reason == "error":
                assert o.error == "KeyboardInterrupt", o.error      # failed, with the reason
                assert not point.startswith(("schedule", "plan")), "the plan phase rolls back, never fails"
            else:
                assert o.finish_reason in ("stop", "length"), o.finish_reason
                assert o.token_ids == want[i], f"{point}, call {at}: r{i} got other tokens"
        if mode == "swap" and point == "schedule: preemption swap-out":
            assert eng.stats.num_swaps > 0
    assert fired, f"{point}: the interrupt never fired (the point is not on a step's path)"


@pytest.mark.parametrize("point", ["schedule: preemption swap-out", "update: a token appended",
                                   "runner: forward (a layer's K/V write)", "plan listener"])
def test_an_exception_at_a_point_is_contained_the_same_way(monkeypatch, point):
    """A plain exception: the plan phase re-raises it after rolling back; later phases fail only the
    step's requests and ``step()`` returns normally."""
    class Boom(RuntimeError):
        pass

    want = expected()
    trigger = Once(3, Boom("injected"))
    eng = engine_for(tiny_model(), config("swap"))
    POINTS[point](monkeypatch, trigger, eng)
    outs = run_interrupted(eng, trigger, Boom)
    assert trigger.fired
    for i in range(len(PROMPTS)):
        o = outs[f"r{i}"]
        assert o.token_ids == want[i] or (o.finish_reason == "error" and "Boom: injected" in o.error)


def test_the_swap_interrupt_of_the_bug_report_no_longer_moves_tables_without_copies(monkeypatch):
    """Issue: a Ctrl-C inside ``schedule()`` on a step that swaps moved the block tables without the
    KV copy, and a later request silently got different tokens. Now the step is undone."""
    eng = engine_for(tiny_model(), config("swap"))
    swaps = []
    real = BlockManager.swap_out

    def swap_out(self, rid):
        mapping = real(self, rid)
        swaps.append(rid)
        if len(swaps) == 1:
            raise KeyboardInterrupt              # after the tables moved, before any copy
        return mapping

    monkeypatch.setattr(BlockManager, "swap_out", swap_out)
    outs = run_interrupted(eng, Once(0, KeyboardInterrupt()), KeyboardInterrupt)
    assert len(swaps) >= 2, "the step was planned again, swapping for real"
    for i, want in enumerate(expected()):
        assert outs[f"r{i}"].token_ids == want and outs[f"r{i}"].finish_reason != "error"


# --- checkpoint / restore of the scheduler alone ------------------------------------------------------
def _fake_step(sched: Scheduler, now: float):
    plan = sched.schedule(now)
    sched.update(plan, {s.request_id: 7 for s in plan.seqs if s.sample}, now + 1)
    return plan


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(["continuous", "dynamic", "static"]),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       k=st.integers(0, 12), m=st.integers(1, 6))
def test_restore_undoes_steps_exactly(seed, policy, mode, caching, k, m):
    """Run k steps, checkpoint, run m more, restore: the state equals the checkpointed one, and the
    plans that follow are the plans of a run that never took the m steps."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10, block_size=2, num_blocks=12,
                          num_host_blocks=8 if mode == "swap" else 0, preemption_mode=mode, policy=policy,
                          enable_prefix_caching=caching, max_model_len=64)
    shared = [rng.randrange(4, 50) for _ in range(4)]

    def fresh() -> Scheduler:
        sched = Scheduler(cfg)
        r = random.Random(seed)
        for i in range(7):
            own = [r.randrange(4, 50) for _ in range(r.randint(1, 8))]
            prompt = (shared if r.random() < 0.5 else []) + own
            params = SamplingParams(max_tokens=r.randint(1, 8), ignore_eos=True)
            sched.add(Sequence(f"s{i}", prompt, params))
        sched.close_arrivals()
        return sched

    def plans_after(sched: Scheduler, start: int) -> list:
        out, t = [], start
        while sched.has_unfinished() and t < 400:
            out.append(_fake_step(sched, float(t)).fingerprint())
            t += 1
        return out

    a = fresh()
    for t in range(k):
        _fake_step(a, float(t))
    state = a.snapshot()
    seqs = {rid: a.get(rid).checkpoint() for rid in state.waiting + state.running + state.swapped}
    cp = a.checkpoint()
    for t in range(k, k + m):
        _fake_step(a, float(t))
    a.restore(cp)
    a.check_integrity()
    assert a.snapshot() == state
    assert {rid: a.get(rid).checkpoint() for rid in seqs} == seqs
    b = fresh()
    for t in range(k):
        _fake_step(b, float(t))
    assert plans_after(a, k) == plans_after(b, k)
