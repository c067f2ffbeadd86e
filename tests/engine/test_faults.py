"""Faults inside a step: an exception raised in the middle of the model forward (after some layers have
already written K/V), in a swap copy or in the sampler leaves the engine consistent.

The contract (docs/errors.md, "Faults"): the requests of the failed step end with
``finish_reason == "error"`` and the exception in ``RequestOutput.error``; their slots and blocks are
freed at once (``Scheduler.fail_step``); sequences the step had preempted by swap lose their possibly
half-copied host blocks and recompute; every other request is unaffected, token for token; and the
engine keeps serving, new requests included. A ``KeyboardInterrupt`` does the same to the step's
requests, then propagates; their outputs come out of the next ``step()``.
"""

from __future__ import annotations

import pytest

from drain import drain, finals
from helpers import TINY, assert_drained, baseline_tokens, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.engine.llm_engine import LLMEngine
from minicb.runtime.runner import engine_for
from robust_helpers import drive, random_workload

PROMPTS, PARAMS, ARRIVALS = random_workload(24, seed=3, prompt_len=(1, 30), max_tokens=(1, 20),
                                            arrival_gap=1.5)


class Injected(RuntimeError):
    pass


def config(mode: str) -> SchedulerConfig:
    """A pool far too small for 24 requests: preemption (and, in swap mode, swapping) is certain."""
    return SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, long_prefill_chunk=16, block_size=4,
                           num_blocks=24, num_host_blocks=12 if mode == "swap" else 0, preemption_mode=mode,
                           max_model_len=512)


def expected():
    return baseline_tokens(tiny_model(), PROMPTS, PARAMS, TINY.eos_token_id)


class FaultyAttention:
    """Wraps the engine's attention backend: forward number ``fail_at`` raises at layer ``layer``,
    i.e. after the earlier layers have written this step's K/V into the paged cache."""

    def __init__(self, inner, fail_at: set[int], layer: int = 1, exc: BaseException | None = None):
        self.inner, self.fail_at, self.layer = inner, fail_at, layer
        self.exc = Injected("injected fault") if exc is None else exc
        self.forward = -1

    def prepare(self, meta):
        self.forward += 1
        return self.inner.prepare(meta)

    def attend(self, layer, q, k, v, state):
        if layer == self.layer and self.forward in self.fail_at:
            raise self.exc
        return self.inner.attend(layer, q, k, v, state)


def record_plans(eng: LLMEngine) -> list:
    plans: list = []
    eng.listen(on_plan=lambda ev: plans.append(ev.plan))
    return plans


def check_outcome(d, plans, failed_steps: set[int], want) -> set[str]:
    """The requests planned in a failed step end with "error"; everybody else is token-exact."""
    failed = {s.request_id for p in plans if p.step in failed_steps for s in p.seqs}
    errored = {rid for rid, o in d.outputs.items() if o.finish_reason == "error"}
    assert errored == failed, (sorted(errored), sorted(failed))
    for i, exp in enumerate(want):
        o = d.outputs[f"r{i}"]
        if o.request_id in failed:
            assert o.finished and o.error and "Injected: injected fault" in o.error
            assert o.token_ids == exp[:len(o.token_ids)], "tokens before the fault must be right"
        else:
            assert o.error is None and o.finish_reason in ("stop", "length")
            assert o.token_ids == exp, o.request_id
    return failed


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("fail_at, layer", [({0}, 0), ({5}, 1), ({9, 10, 30}, 1), ({38}, 0)])
def test_exception_inside_the_forward_fails_only_that_steps_requests(mode, fail_at, layer):
    eng = engine_for(tiny_model(), config(mode))
    eng.runner.backend = FaultyAttention(eng.runner.backend, fail_at, layer)
    plans = record_plans(eng)
    d = drive(eng, PROMPTS, PARAMS, ARRIVALS)
    # forwards are numbered over non-empty plans only
    busy = [p.step for p in plans if not p.is_empty]
    failed_steps = {busy[f] for f in fail_at}
    failed = check_outcome(d, plans, failed_steps, expected())
    assert failed and len(failed) < len(PROMPTS)
    assert max(ARRIVALS) > min(d.end_step[r] for r in failed), "requests arrive after the fault"
    assert eng.scheduler.stats.num_preemptions > 0
    assert_drained(eng)
    # the engine still serves new requests afterwards
    eng.runner.backend = eng.runner.backend.inner
    eng.add_request("late", PROMPTS[0], PARAMS[0])
    outs = [o for _ in range(100) for o in eng.step() if o.finished]
    assert [o.token_ids for o in outs] == [expected()[0]]
    assert_drained(eng)


def test_the_failed_steps_slots_and_blocks_are_freed_at_once():
    eng = engine_for(tiny_model(), config("recompute"))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"a{i}", PROMPTS[i], params)
    eng.step()
    eng.step()
    sched = eng.scheduler
    held = sched.config.num_blocks - sched.block_manager.num_free_blocks
    assert held > 0 and sched.slot_table.num_free == sched.config.max_num_seqs - 3
    eng.runner.backend = FaultyAttention(eng.runner.backend, {0}, layer=1)          # the next forward fails
    outs = eng.step()
    assert sorted(o.request_id for o in outs) == ["a0", "a1", "a2"]
    for o in outs:
        assert o.finished and o.finish_reason == "error" and o.error == "Injected: injected fault"
        assert o.new_token_ids == [] and len(o.token_ids) == 2        # one per earlier step
        assert sched.get(o.request_id) is None
        assert sched.block_manager.block_table(o.request_id) == []
        assert sched.slot_table.slot_of(o.request_id) is None
    assert_drained(eng)


def test_a_fault_in_a_swap_copy_turns_the_steps_victims_into_recomputes():
    eng = engine_for(tiny_model(), config("swap"))
    plans = record_plans(eng)
    real_swap_out = eng.runner.kv_cache.swap_out
    failed_steps: set[int] = set()

    def swap_out(mapping):
        if mapping and not failed_steps:
            failed_steps.add(plans[-1].step)
            real_swap_out(mapping[: len(mapping) // 2])             # half copied, then the fault
            raise Injected("injected fault")
        return real_swap_out(mapping)

    eng.runner.kv_cache.swap_out = swap_out
    d = drive(eng, PROMPTS, PARAMS, ARRIVALS)
    assert failed_steps, "the workload never swapped"
    victims = {rid for p in plans if p.step in failed_steps for rid in p.preempted}
    failed = check_outcome(d, plans, failed_steps, expected())
    assert victims and not victims & failed, "the step's victims are not failed, they recompute"
    assert_drained(eng)


def test_a_fault_in_the_sampler_is_a_failed_step_too():
    eng = engine_for(tiny_model(), config("recompute"))
    plans = record_plans(eng)
    real = eng.runner.sampler.sample
    calls = {"n": 0}

    def sample(*a, **k):
        calls["n"] += 1
        if calls["n"] == 7:
            failed_steps.add(plans[-1].step)
            raise Injected("injected fault")
        return real(*a, **k)

    failed_steps: set[int] = set()
    eng.runner.sampler.sample = sample
    d = drive(eng, PROMPTS, PARAMS, ARRIVALS)
    check_outcome(d, plans, failed_steps, expected())
    assert_drained(eng)


def test_every_step_failing_ends_every_request_and_never_hangs():
    eng = engine_for(tiny_model(), config("swap"))
    eng.runner.backend = FaultyAttention(eng.runner.backend, set(range(10_000)), layer=0)
    d = drive(eng, PROMPTS, PARAMS, ARRIVALS, max_steps=500)
    assert {o.finish_reason for o in d.outputs.values()} == {"error"}
    assert all(o.token_ids == [] for o in d.outputs.values())
    assert_drained(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_keyboard_interrupt_in_the_forward_leaves_the_engine_consistent(mode):
    eng = engine_for(tiny_model(), config(mode))
    plans = record_plans(eng)
    for i in range(12):
        eng.add_request(f"r{i}", PROMPTS[i], PARAMS[i])
    eng.scheduler.close_arrivals()
    outs = {}
    for _ in range(6):
        outs |= {o.request_id: o for o in eng.step() if o.finished}
    eng.runner.backend = FaultyAttention(eng.runner.backend, {0}, layer=1, exc=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    eng.scheduler.check_integrity()
    interrupted = {s.request_id for s in plans[-1].seqs}
    assert interrupted and eng.has_unfinished_requests()
    eng.runner.backend = eng.runner.backend.inner
    first = eng.step()                                  # the interrupted step's outputs come first
    assert {o.request_id for o in first[:len(interrupted)]} == interrupted
    rest = finals(first + drain(eng))
    assert not set(rest) & set(outs), "a request finished twice"
    outs |= rest
    assert set(outs) == {f"r{i}" for i in range(12)}
    want = expected()
    for i in range(12):
        o = outs[f"r{i}"]
        if o.request_id in interrupted:
            assert o.finish_reason == "error" and o.error == "KeyboardInterrupt"
        else:
            assert o.finish_reason in ("stop", "length") and o.token_ids == want[i], o.request_id
    assert_drained(eng)
