"""Helpers of the robustness tests (faults, liveness, soak): an engine driver that records when every
request arrived, was first scheduled and ended, can abort requests mid-flight, and checks that every
request ends exactly once; and an even tinier model than ``helpers.TINY`` for long runs."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from drain import drain
from minicb.core.config import ModelConfig
from minicb.core.sampling_params import SamplingParams
from minicb.engine.llm_engine import LLMEngine
from minicb.engine.outputs import RequestOutput

# One layer, hidden 16: a step costs little more than the Python around it (for the soak).
MICRO = ModelConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                    max_position_embeddings=4096, eos_token_id=3)


@dataclass
class Drive:
    outputs: dict[str, RequestOutput] = field(default_factory=dict)   # every request's final output
    arrival_step: dict[str, int] = field(default_factory=dict)
    end_step: dict[str, int] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    streamed: dict[str, list[int]] = field(default_factory=dict)      # new_token_ids, concatenated
    steps: int = 0


def drive(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], arrivals: list[int],
          abort: Callable[[int, list[str]], list[str]] | None = None, check_every: int = 1,
          max_steps: int = 1_000_000) -> Drive:
    """Request ``i`` (id ``r{i}``) is added before step ``arrivals[i]``; ``abort(step, live_ids)`` names
    requests to abort before that step. Asserts every request ends exactly once and the engine drains."""
    d = Drive()
    pending = deque(sorted(range(len(prompts)), key=lambda i: arrivals[i]))
    live: dict[str, None] = {}          # insertion-ordered set of unfinished request ids

    def one_step(eng: LLMEngine) -> None:
        while pending and arrivals[pending[0]] <= d.steps:
            i = pending.popleft()
            eng.add_request(f"r{i}", prompts[i], params[i])
            d.arrival_step[f"r{i}"] = d.steps
            live[f"r{i}"] = None
        if not pending:
            eng.scheduler.close_arrivals()
        if abort is not None and live:
            for rid in abort(d.steps, list(live)):
                out = eng.abort_request(rid)
                assert out is not None and out.finished and out.finish_reason == "abort", rid
                d.streamed.setdefault(rid, []).extend(out.new_token_ids)
                _end(d, live, out)
                d.aborted.add(rid)
        for out in eng.step():
            d.streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                _end(d, live, out)
        if check_every and d.steps % check_every == 0:
            eng.scheduler.check_integrity()
        d.steps += 1

    drain(eng, one_step, max_steps=max_steps, more=lambda: bool(pending))
    eng.scheduler.check_integrity()
    assert not live, f"requests never ended: {sorted(live)[:5]}"
    assert set(d.outputs) == {f"r{i}" for i in range(len(prompts))}, "a request was lost"
    for rid, out in d.outputs.items():
        assert d.streamed.get(rid, []) == out.token_ids, f"{rid}: streamed tokens != final tokens"
    return d


def _end(d: Drive, live: dict, out: RequestOutput) -> None:
    assert out.request_id not in d.outputs, f"{out.request_id} ended twice"
    assert out.request_id in live, f"{out.request_id} ended but was never live"
    del live[out.request_id]
    d.outputs[out.request_id] = out
    d.end_step[out.request_id] = d.steps


def random_workload(n: int, seed: int, prompt_len=(1, 40), max_tokens=(1, 24), vocab: int = 61,
                    arrival_gap: float = 1.0):
    """``n`` random prompts (ids 4..vocab-1), greedy params, Poisson-ish arrival steps."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(*max_tokens)) for _ in range(n)]
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0 / arrival_gap) if arrival_gap else 0.0
        arrivals.append(int(t))
    return prompts, params, arrivals


def finishes(fn: Callable[[], object], bound_s: float = 30.0):
    """Run ``fn()`` in a daemon thread; return what it returned or the exception it raised. Fails the
    test if it is still running after ``bound_s``: a hang, not slowness."""
    import threading

    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(bound_s)
    # load-independent: a hang bound (30 s default) far beyond any call it guards, not a speed check
    assert not t.is_alive(), f"still running after {bound_s} s: a hang"
    return box["error"] if "error" in box else box.get("value")
