"""The engine drives any runner (``minicb.engine.interface.Runner``): one loop for a model, a
tensor-parallel group and the simulator's clock.

A plain-Python runner (no torch) stands in for the model here: the engine must queue, step, stream,
abort, fail a step, refuse a broken runner and shut down with it exactly as with ``ModelRunner``.
"""

from __future__ import annotations

import pytest

from drain import drain, finals
from helpers import tiny_model
from minicb.core.config import SchedulerConfig
from minicb.core.errors import DistributedError, InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.engine.interface import Runner
from minicb.engine.llm_engine import LLMEngine
from minicb.runtime.runner import ModelRunner, engine_for
from minicb.simulate.simulator import SimRunner


class CountingRunner:
    """Samples ``100 + number of tokens the row's request has`` (so every token is predictable) and
    records every call the engine makes."""

    vocab_size = 50
    eos_token_id = None

    def __init__(self) -> None:
        self.failure: BaseException | None = None
        self.registered: list[str] = []
        self.released: list[str] = []
        self.plans = []
        self.closed = 0
        self.raise_next: BaseException | None = None
        self.break_next = False

    def register(self, request_id, params, prompt_token_ids=(), **kwargs) -> None:
        self.registered.append(request_id)

    def release(self, request_id) -> None:
        self.released.append(request_id)

    def run(self, plan, params):
        self.plans.append(plan)
        if self.break_next:
            self.failure = DistributedError("the group broke")
            raise self.failure
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            raise exc
        assert set(params) == {s.request_id for s in plan.seqs if s.sample}
        return {s.request_id: 100 + s.start_pos + s.num_tokens for s in plan.seqs if s.sample}

    def close(self) -> None:
        self.closed += 1


def cfg(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_seqs": 2, "max_num_batched_tokens": 16, "block_size": 4,
                              "num_blocks": 16, **kw})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_every_runner_has_the_interface():
    assert isinstance(CountingRunner(), Runner)
    assert isinstance(SimRunner(lambda plan: 1.0), Runner)
    runner = ModelRunner.for_config(tiny_model(), cfg(num_blocks=12, num_host_blocks=3))
    assert isinstance(runner, Runner)
    assert (runner.vocab_size, runner.failure) == (tiny_model().config.vocab_size, None)
    assert (runner.kv_cache.num_blocks, runner.kv_cache.block_size) == (12, 4)   # the pool config schedules
    assert runner.kv_cache.host.shape != runner.kv_cache.data.shape
    eng = engine_for(tiny_model(), cfg(num_blocks=12))
    assert isinstance(eng.runner, ModelRunner) and eng.runner.kv_cache.num_blocks == 12


def test_a_plain_python_runner_is_driven_like_the_model():
    runner = CountingRunner()
    eng = LLMEngine(runner, cfg())
    eng.add_request("a", [1, 2, 3], greedy(3))
    eng.add_request("b", [4, 5], greedy(2))
    outs = drain(eng)
    streamed = {rid: [t for o in outs if o.request_id == rid for t in o.new_token_ids] for rid in "ab"}
    final = finals(outs)
    # token k of a request of prompt length p is 100 + p + k (the row's context length)
    assert final["a"].token_ids == streamed["a"] == [103, 104, 105]
    assert final["b"].token_ids == streamed["b"] == [102, 103]
    assert runner.registered == ["a", "b"] and sorted(runner.released) == ["a", "b"]
    with pytest.raises(InvalidArgument, match=r"\[0, 49\]"):       # the runner's vocabulary
        eng.add_request("c", [50], greedy(1))


def test_a_runner_that_raises_fails_that_step_only_and_abort_works():
    runner = CountingRunner()
    eng = LLMEngine(runner, cfg(max_num_seqs=1))
    eng.add_request("a", [1, 2], greedy(4))
    eng.add_request("b", [3, 4], greedy(2))        # waits: one slot
    eng.step()
    runner.raise_next = RuntimeError("boom")
    outs = eng.step()
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [("a", "error", "RuntimeError: boom")]
    assert eng.abort_request("b").finish_reason == "abort"
    assert not eng.has_unfinished_requests()
    assert sorted(runner.released) == ["a", "b"]


def test_a_broken_runner_makes_every_later_step_raise():
    runner = CountingRunner()
    eng = LLMEngine(runner, cfg())
    eng.add_request("a", [1, 2], greedy(4))
    eng.step()
    runner.break_next = True
    with pytest.raises(DistributedError, match="the group broke"):
        eng.step()
    n = len(runner.plans)
    with pytest.raises(DistributedError, match="the group broke"):
        eng.step()
    assert len(runner.plans) == n                  # refused before planning: the runner is not called


def test_after_a_broken_runner_shutdown_hands_out_every_final_output_once():
    runner = CountingRunner()
    eng = LLMEngine(runner, cfg(max_num_seqs=1))
    eng.add_request("a", [1, 2], greedy(4))
    eng.add_request("b", [3], greedy(4))           # waits: one slot
    eng.step()
    runner.break_next = True
    with pytest.raises(DistributedError):
        eng.step()                                 # "a" was in the step: it ended with the error
    eng.shutdown()                                 # "b" never ran: aborted
    outs = eng.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "error"), ("b", "abort")]
    assert [o.token_ids for o in outs if o.request_id == "a"] == [[102]]
    assert not eng.has_unfinished_requests() and runner.closed == 1


def test_shutdown_ends_every_request_closes_the_runner_and_refuses_more():
    runner = CountingRunner()
    eng = LLMEngine(runner, cfg())
    eng.add_request("a", [1, 2], greedy(4))
    eng.step()
    eng.shutdown()
    assert runner.closed == 1
    outs = eng.step()                              # the outputs of the requests shutdown() ended
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in outs] == [("a", "abort", [102])]
    assert not eng.has_unfinished_requests()
    with pytest.raises(InvalidArgument, match="shut down"):
        eng.step()
    with pytest.raises(InvalidArgument, match="shut down"):
        eng.add_request("b", [1], greedy(1))
    eng.shutdown()                                 # idempotent
    assert runner.registered == ["a"] and runner.released == ["a"]
