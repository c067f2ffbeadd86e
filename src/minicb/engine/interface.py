"""What the engine needs from the tensor half of a step: the ``Runner`` interface.

A step is two halves. The engine does the bookkeeping (schedule, record, outputs) in plain Python;
a *runner* does the work a plan describes and says which token each finishing row sampled::

    plan    = scheduler.schedule()          # engine: who runs, which tokens, which blocks
    sampled = runner.run(plan, params)      # runner: {request_id: token} for rows with sample=True
    scheduler.update(plan, sampled)         # engine: append tokens, finish, free

The engine never looks inside a runner, so one loop drives three of them:

====================================  ===========================================================
``minicb.runtime.runner.ModelRunner``  swap, pack, forward, sample on one model (torch)
``minicb.distributed.runner.TPRunner`` rank 0 of a tensor-parallel group: sends the plan to the
                                       other ranks, then runs its own shard like ``ModelRunner``
``minicb.simulate.simulator.SimRunner`` no model: a cost model says how long the plan takes, a
                                       simulated clock jumps by that much, every row samples a
                                       dummy token
====================================  ===========================================================

A runner also keeps what is per request and lives outside the scheduler: a seeded sampler's
generator (``register`` when a request is queued, ``release`` when it ends), and it says what a
prompt may contain (``vocab_size``) and which token ends a request when no tokenizer says so
(``eos_token_id``). ``failure`` is ``None`` while the runner can run steps; once it cannot (a
tensor-parallel group whose rank died), it is the exception to report, and the engine refuses
every further step with it. ``close()`` releases what the runner holds (other processes, for TP).

This module imports nothing but the core's types: ``Runner`` is a ``typing.Protocol``, so a runner
needs no base class, only these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from minicb.core.plan import StepPlan
from minicb.core.sampling_params import SamplingParams

__all__ = ["Runner"]


@runtime_checkable
class Runner(Protocol):
    """The tensor half of a step, as the engine sees it (see the module docstring)."""

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold are ``0 .. vocab_size - 1``."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a request when the engine has no tokenizer (None: none does)."""
        ...

    @property
    def failure(self) -> BaseException | None:
        """None while the runner works; the exception that ended it for good otherwise."""
        ...

    def register(self, request_id: str, params: SamplingParams) -> None:
        """A request is being queued: keep what sampling it needs (its seeded generator, its logits
        processors such as a structured output's grammar). Called before the scheduler holds the
        request, so an ``InvalidArgument`` here (a grammar that cannot be built) refuses it cleanly."""
        ...

    def release(self, request_id: str) -> None:
        """A request ended (any reason): forget it."""
        ...

    def run(self, plan: StepPlan, params: Mapping[str, SamplingParams]) -> dict[str, int]:
        """Execute ``plan`` (swaps, then the forward over every scheduled token) and return the
        sampled token of every row with ``sample=True``, keyed by request id. ``params`` holds the
        sampling parameters of those rows. Raising fails this step's requests (``finish_reason ==
        "error"``); the engine serves on unless ``failure`` is set afterwards."""
        ...

    def close(self) -> None:
        """Release what the runner holds (idempotent); no ``run`` follows."""
        ...
