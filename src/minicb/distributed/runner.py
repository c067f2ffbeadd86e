"""The tensor-parallel runners: rank 0's ``TPRunner`` and the other ranks' loop, ``serve``.

Rank 0 is an ordinary ``LLMEngine`` (the one step loop) whose runner is a ``TPRunner``: a
``ModelRunner`` over rank 0's shard that first sends each plan to the other ranks, then runs it::

    rank 0 (LLMEngine + TPRunner)                     ranks 1 .. N-1 (serve: a ModelRunner each)
    plan = scheduler.schedule()
    TPRunner.run(plan, params):
        tp.send_plan(plan)  ─── store + digest ───►   plan = tp.recv_plan()
        ModelRunner.run(plan, params) ◄─ all-reduces ─► runner.run(plan)      (the same method)
    scheduler.update(plan, sampled)

Every rank calls the same ``ModelRunner.run`` with the same plan, so every rank makes the same
collectives in the same order; the workers pass no sampling parameters (no LM head, no sampling).

A failure of the group is final. When a step breaks the group (``tp.failure``: a digest mismatch, a
peer that died or hung, an exception inside rank 0's forward) the step's requests end with
``finish_reason == "error"``, ``TPRunner.failure`` becomes a ``DistributedError`` that names every
rank's report, the workers are stopped, and the engine raises that error from this and every later
``step()``. ``close()`` (``LLMEngine.shutdown()`` / ``LLM.shutdown()``) stops the workers.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from minicb.core.config import SchedulerConfig
from minicb.core.errors import DistributedError
from minicb.distributed.group import CommStats, TPGroup
from minicb.distributed.sharding import ShardedLlama
from minicb.runtime.runner import ModelRunner


class TPRunner(ModelRunner):
    """Rank 0's runner: shares every plan with the other ranks (and checks they hold the same), then
    runs rank 0's shard. ``failure`` is set, and the workers stopped, once the group has broken."""

    def __init__(self, model: ShardedLlama, config: SchedulerConfig, tp: TPGroup, workers: Workers, *,
                 attn_backend: str = "auto", seed: int | None = None, tokenizer=None) -> None:
        # the tokenizer: rank 0 samples, so a structured output's grammar mask lives here only
        super().__init__(model, num_blocks=config.num_blocks, block_size=config.block_size,
                         num_host_blocks=config.num_host_blocks, attn_backend=attn_backend, seed=seed,
                         tokenizer=tokenizer)
        self.tp = tp
        self.workers = workers
        self.failure: DistributedError | None = None
        self._finalizer = weakref.finalize(self, workers.close, tp, False)

    @property
    def comm_stats(self) -> CommStats:
        return self.tp.stats

    def run(self, plan, params=None) -> dict[str, int]:
        """Send ``plan`` to ranks 1..N-1, then run it here (``ModelRunner.run``)."""
        if self.failure is not None:
            raise self.failure.with_traceback(None)
        try:
            plan = self.tp.send_plan(plan)
            return super().run(plan, params)
        finally:
            if self.tp.failure is not None and self.failure is None:
                self.failure = self._final_error(self.tp.failure)

    def _final_error(self, failure: BaseException) -> DistributedError:
        """Stop the workers and make the one error that describes the broken group."""
        self.workers.close(self.tp, abort=True)
        msg = str(failure) if isinstance(failure, DistributedError) else \
            f"tensor-parallel rank 0: the step failed inside the forward: {type(failure).__name__}: {failure}"
        reports = self.workers.describe()
        err = DistributedError(msg + (f"; {reports}" if reports else ""))
        err.__cause__ = failure
        return err

    def close(self) -> None:
        """Stop the other ranks and release the group (idempotent; also runs when the runner is freed)."""
        self._finalizer()


@dataclass(slots=True)
class Workers:
    """The ranks this process started (none under torchrun) and what they reported on exit."""

    processes: list = field(default_factory=list)    # index i: rank i + 1
    queue: object | None = None
    reports: dict[int, str] = field(default_factory=dict)
    closed: bool = False

    def close(self, tp: TPGroup, abort: bool) -> None:
        if self.closed:
            return
        self.closed = True
        tp.stop_workers()           # ranks waiting for a plan leave; ranks inside a collective fail
        for p in self.processes:
            p.join(timeout=3 if abort else 30)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        self._collect()
        for i, p in enumerate(self.processes):
            if p.exitcode and i + 1 not in self.reports:
                self.reports[i + 1] = f"exited with code {p.exitcode}"

    def _collect(self) -> None:
        while self.queue is not None and not self.queue.empty():
            rank, msg = self.queue.get()
            self.reports[rank] = msg

    def describe(self) -> str:
        return "; ".join(f"rank {r}: {m}" for r, m in sorted(self.reports.items()) if m != "ok")


def worker_runner(model: ShardedLlama, config: SchedulerConfig, attn_backend: str) -> ModelRunner:
    """A worker rank's runner: its shard, its own KV heads' cache, the same pool shape as rank 0."""
    return ModelRunner.for_config(model, config, attn_backend=attn_backend)


def serve(runner: ModelRunner, tp: TPGroup) -> None:
    """The loop of ranks 1..N-1: every plan rank 0 executes, executed here on this rank's shard by the
    same ``ModelRunner.run`` rank 0 calls (without sampling parameters: no LM head, no sampling), so
    every rank makes the same collectives in the same order."""
    while (plan := tp.recv_plan()) is not None:
        runner.run(plan)
