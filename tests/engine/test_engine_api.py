"""The engine's API for everything outside it: step events, ``generate`` beside streaming, aborts at any
moment, request ids, priorities, ``close_arrivals``, ``drive``, and a tensor-parallel engine after
``shutdown``. Each test states the behaviour a user relies on; several were bugs (issue 17, items 3,
4, 5, 18, 20, 22)."""

from __future__ import annotations

import pytest

from drain import drain
from helpers import TINY, baseline_tokens, greedy, tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.engine.arrivals import Arrival, NoProgress, drive
from minicb.engine.events import PlanEvent, StepEvent
from minicb.entrypoints.llm import LLM
from minicb.runtime.runner import engine_for

PROMPTS = [[5, 9, 11, 4], [7, 7, 8], [12, 30, 41, 5, 6, 7], [9]]


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64, max_model_len=256)
    return SchedulerConfig(**{**base, **kw})


def want(prompts, params):
    return baseline_tokens(tiny_model(), prompts, params, TINY.eos_token_id)


# --- events -----------------------------------------------------------------------------------------
def test_step_events_carry_the_plan_and_immutable_snapshots():
    eng = engine_for(tiny_model(), cfg(max_num_seqs=2))
    plans, steps = [], []
    remove = eng.listen(on_plan=plans.append, on_step=steps.append)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", p, greedy(3, ignore_eos=True))
    eng.run()
    assert plans and len(plans) == len(steps)
    assert all(isinstance(e, PlanEvent) for e in plans) and all(isinstance(e, StepEvent) for e in steps)
    first = steps[0]
    assert first.state.slots == ("r0", "r1") and first.state.waiting == ("r2",)   # two slots, r2 waits
    assert dict(first.state.block_tables)["r0"] == plans[0].plan.seqs[0].block_table
    assert first.end >= first.start and first.plan is plans[0].plan
    with pytest.raises(AttributeError):
        first.state.slots = ()                    # frozen: listeners may keep it
    last = steps[-1]
    assert last.after.slots == (None, None) and last.after.num_free_blocks == 64
    assert {o.request_id for e in steps for o in e.outputs if o.finished} == {"r0", "r1", "r2"}
    remove()
    eng.add_request("x", PROMPTS[3], greedy(2, ignore_eos=True))
    eng.run()
    assert len(plans) == len(steps) and plans[-1].plan.seqs[0].request_id != "x"   # removed: not called


def test_no_snapshot_is_made_when_nobody_listens(monkeypatch):
    from minicb.core.scheduler import Scheduler

    calls = []
    real = Scheduler.snapshot
    monkeypatch.setattr(Scheduler, "snapshot", lambda self: calls.append(1) or real(self))
    eng = engine_for(tiny_model(), cfg())
    eng.add_request("a", PROMPTS[0], greedy(4, ignore_eos=True))
    eng.run()
    assert calls == []


# --- generate and streaming share an engine (item 3) --------------------------------------------------
def test_generate_returns_only_its_own_requests_and_leaves_streams_to_step():
    llm = LLM(tiny_model(), **{f: getattr(cfg(), f) for f in ("max_num_seqs", "block_size", "num_blocks")})
    eng = llm.engine
    eng.add_request("s", PROMPTS[2], greedy(12, ignore_eos=True))     # a streaming request
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], greedy(3, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == [PROMPTS[0], PROMPTS[1]]
    assert all(o.finished for o in outs)
    rest = drain(eng)                             # "s" is still the streaming caller's
    assert {o.request_id for o in rest} == {"s"}
    streamed, final = [t for o in rest for t in o.new_token_ids], rest[-1]
    assert final.finished and final.token_ids == want([PROMPTS[2]], greedy(12, ignore_eos=True))[0]
    assert streamed == final.token_ids            # nothing of "s" was swallowed by generate


def test_generate_or_step_from_a_listener_is_a_clear_error_and_fails_only_that_step():
    llm = LLM(tiny_model(), max_num_seqs=4, block_size=4, num_blocks=64)
    eng = llm.engine
    errors = []

    def reenter(event) -> None:
        try:
            llm.generate([PROMPTS[1]], greedy(2))
        except InvalidArgument as e:
            errors.append(str(e))
            raise

    remove = eng.listen(on_plan=reenter)
    eng.add_request("a", PROMPTS[0], greedy(3, ignore_eos=True))
    with pytest.raises(InvalidArgument, match="inside a step"):
        eng.step()
    assert errors and "inside a step" in errors[0]
    eng.scheduler.check_integrity()
    remove()
    (failed,) = eng.step()                        # the failed step's output comes out of the next one
    assert failed.request_id == "a" and failed.finish_reason == "error" and "inside a step" in failed.error
    assert eng.dead is None and not eng.has_unfinished_requests()
    eng.add_request("b", PROMPTS[0], greedy(3, ignore_eos=True))
    (out,) = eng.run(["b"])
    assert out.token_ids == want([PROMPTS[0]], greedy(3, ignore_eos=True))[0]


# --- aborts at any moment (item 4) ---------------------------------------------------------------------
def test_abort_from_a_plan_listener_ends_only_that_request():
    eng = engine_for(tiny_model(), cfg())
    params = greedy(6, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, params)
    aborted = []

    def abort_r1(event) -> None:
        if event.plan.step == 2:
            aborted.append(eng.abort_request("r1"))   # between schedule and execute

    eng.listen(on_plan=abort_r1)
    finals = {o.request_id: o for o in eng.run()}
    assert aborted == [None]                          # applied when the step ends
    assert finals["r1"].finish_reason == "abort" and len(finals["r1"].token_ids) == 3
    expected = want(PROMPTS, params)
    for i in (0, 2, 3):
        assert finals[f"r{i}"].token_ids == expected[i] and finals[f"r{i}"].finish_reason == "length"
    eng.scheduler.check_integrity()


def test_abort_request_checks_its_argument():
    eng = engine_for(tiny_model(), cfg())
    with pytest.raises(InvalidArgument, match="request_id must be a str"):
        eng.abort_request(["a"])
    assert eng.abort_request("never-added") is None


# --- an interrupted generate (item 5) ---------------------------------------------------------------
def test_an_interrupted_generate_aborts_its_own_requests(monkeypatch):
    llm = LLM(tiny_model(), max_num_seqs=4, block_size=4, num_blocks=64)
    eng = llm.engine
    calls = {"n": 0}
    real = eng.step

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(eng, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(200, ignore_eos=True))
    monkeypatch.setattr(eng, "step", real)
    assert not eng.has_unfinished_requests()          # nothing of the interrupted call is left queued
    before = eng.stats.num_steps
    (out,) = llm.generate([PROMPTS[3]], greedy(2, ignore_eos=True))
    assert eng.stats.num_steps - before == 2 and len(out.token_ids) == 2


# --- ids (item 20) -----------------------------------------------------------------------------------
def test_generated_ids_never_collide_with_user_ids():
    llm = LLM(tiny_model(), max_num_seqs=4, block_size=4, num_blocks=64)
    eng = llm.engine
    eng.add_request("0", PROMPTS[0], greedy(30, ignore_eos=True))    # a user id that looks generated
    eng.add_request("1", PROMPTS[1], greedy(30, ignore_eos=True))
    rid = eng.add_request(None, PROMPTS[2], greedy(2))
    assert rid not in ("0", "1")
    outs = llm.generate([PROMPTS[3], PROMPTS[3]], greedy(2, ignore_eos=True))
    assert len(outs) == 2 and len({o.request_id for o in outs} | {"0", "1", rid}) == 5


# --- priority (item 18) --------------------------------------------------------------------------------
def _first_token_step(policy: str, aging: int = 32) -> dict[str, int]:
    eng = engine_for(tiny_model(), cfg(max_num_seqs=4, scheduling_policy=policy, priority_aging=aging))
    for i in range(40):
        eng.add_request(f"low{i}", [4 + i % 50, 5], greedy(4, ignore_eos=True), priority=5)
    eng.add_request("urgent", [6, 7], greedy(4, ignore_eos=True), priority=0)
    first, steps = {}, [0]

    def one_step(eng) -> None:
        for o in eng.step():
            first.setdefault(o.request_id, steps[0])
        steps[0] += 1

    drain(eng, one_step)
    return first


def test_priority_lower_value_first_and_fcfs_ignores_it():
    prio, fcfs = _first_token_step("priority"), _first_token_step("fcfs")
    assert prio["urgent"] == 0                        # admitted at the first step with a free slot
    assert fcfs["urgent"] > 30                        # fcfs: behind all 40
    assert fcfs["urgent"] == max(fcfs.values())


def test_priority_aging_prevents_starvation():
    """One priority-9 request, then a flood of priority-0 requests that never lets up. With strict
    priority it never gets a slot; with aging (one level per 4 later arrivals) it overtakes every
    request that arrived more than 9 x 4 = 36 after it, so it is served after a bounded delay."""
    def run(aging: int) -> tuple[int, list[int]]:
        eng = engine_for(tiny_model(), cfg(max_num_seqs=2, scheduling_policy="priority",
                                           priority_aging=aging))
        eng.add_request("patient", [8, 9], greedy(2, ignore_eos=True), priority=9)
        arrivals, served_before = 0, []
        for step in range(150):
            for _ in range(2):                        # two important arrivals per step: a flood
                eng.add_request(f"hot{arrivals}", [5, 6, 7], greedy(3, ignore_eos=True), priority=0)
                arrivals += 1
            outs = eng.step()
            if any(o.request_id == "patient" for o in outs):
                return step, served_before
            served_before += [int(o.request_id[3:]) for o in outs if o.request_id.startswith("hot")
                              and len(o.token_ids) == 1]
        return -1, served_before

    step, before = run(aging=4)
    assert step >= 0 and before, "it was served, after some of the flood"
    assert max(before) <= 36, "only requests that arrived at most 9 x aging after it went first"
    assert run(aging=0)[0] == -1                      # strict priority: starved for all 150 steps


# --- drive, close_arrivals ----------------------------------------------------------------------------
def test_drive_adds_requests_at_their_step_and_closes_arrivals():
    eng = engine_for(tiny_model(), cfg(policy="static", max_num_seqs=4))
    params = greedy(2, ignore_eos=True)
    seen = []
    eng.listen(on_plan=lambda ev: seen.append((ev.plan.step, ev.state.waiting, ev.state.arrivals_open)))
    done = drive(eng, [Arrival(0, "a", PROMPTS[0], params), Arrival(3, "b", PROMPTS[1], params)])
    assert {o.request_id for o in done} == {"a", "b"}
    assert seen[0][1] == ("a",) and seen[0][2] is True        # static waits for a full batch ...
    assert all(w == () for _, w, _ in seen[4:])              # ... until arrivals close after b (step 3)
    assert seen[3][2] is False


def test_drive_on_a_clock_waits_for_arrivals_and_rejects_bad_times():
    now = [0.0]
    eng = engine_for(tiny_model(), cfg(), clock=lambda: now[0])
    waits = []

    def wait(until: float) -> None:
        waits.append(until)
        now[0] = until

    eng.listen(on_plan=lambda ev: now.__setitem__(0, now[0] + 0.5))
    done = drive(eng, [Arrival(10.0, "late", PROMPTS[0], greedy(2, ignore_eos=True))], now=lambda: now[0],
                 wait=wait)
    # load-independent: a fake clock and wait
    assert waits == [10.0] and done[0].arrival_time == 10.0 and done[0].first_token_time >= 10.0
    with pytest.raises(InvalidArgument, match="arrival time"):
        Arrival(float("nan"), "x", PROMPTS[0], greedy(1))
    with pytest.raises(InvalidArgument, match="wait"):
        drive(eng, [], now=lambda: 0.0)


def test_drive_raises_instead_of_spinning_when_nothing_can_progress(monkeypatch):
    from minicb.core.continuous import ContinuousPolicy

    eng = engine_for(tiny_model(), cfg())
    monkeypatch.setattr(ContinuousPolicy, "_schedule_waiting", lambda self, work, budget: None)  # no one in
    with pytest.raises(NoProgress):
        drive(eng, [Arrival(0, "a", PROMPTS[0], greedy(2))])


# --- tensor parallelism after shutdown (item 22) ----------------------------------------------------------
@pytest.mark.slow
def test_a_tensor_parallel_engine_after_shutdown_says_so_and_keeps_nothing_queued():
    from minicb.distributed import launch

    eng = launch(tiny_model(), cfg(), tensor_parallel_size=2)
    eng.add_request("a", PROMPTS[0], greedy(3, ignore_eos=True))
    eng.step()
    eng.shutdown()
    outs = eng.step()                                 # the request ended by shutdown, handed out once
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert not eng.has_unfinished_requests()
    with pytest.raises(InvalidArgument, match="shut down"):
        eng.add_request("b", PROMPTS[1], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match="shut down"):
        eng.step()
    eng.shutdown()                                    # idempotent
