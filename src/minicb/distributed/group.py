"""One rank's membership of a tensor-parallel group: how plans travel and how collectives fail.

All ranks must run the *same* step on the *same* flat batch, or their all-reduces pair up wrongly
(a hang, an error far from the cause, or silently summed unrelated numbers). ``TPGroup`` is the
protocol that prevents it::

    rank 0:   store.set("plan/k", plan)  ──►  ranks 1..N-1:  plan = store.get("plan/k")   (wait while idle)
    all ranks: all_gather(plan_digest(plan, k))   differ?  ->  DistributedError on every rank

The key-value store every ``torch.distributed`` job already has (a ``TCPStore``) carries plan number
``k``: a worker may wait for it as long as the driver idles, while the driver never blocks on a worker
that is not listening. Then the ranks all-gather an 8-byte digest of ``(k, plan.fingerprint())`` and
compare before any forward, so they never enter all-reduces of different shapes. Every collective has
a deadline (``timeout_s``): a peer that dies or hangs makes the others' collective fail, and the
first failure is kept in ``failure`` (the group cannot be used after it). ``Fault`` lets tests make
one rank diverge, die or hang at a chosen plan; ``CommStats`` counts where the time outside compute went.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from minicb.core.errors import DistributedError, InvalidArgument
from minicb.core.plan import StepPlan

DEFAULT_TIMEOUT_S = 60.0          # deadline of every collective once the group is up
IDLE_TIMEOUT = timedelta(days=7)  # how long a worker waits for the next plan of an idle driver
_STOP = b"stop"                   # the plan that ends a worker's loop


@dataclass(slots=True, frozen=True)
class Fault:
    """Test hook: at its ``at``-th executed plan (0-based), rank ``rank`` ``diverge``s (runs an altered
    plan: its last sequence dropped, or its block table changed), ``exit``s (``os._exit(1)``) or
    ``hang``s (sleeps)."""

    rank: int
    at: int
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in ("diverge", "exit", "hang"):
            raise InvalidArgument(f"Fault.kind must be 'diverge', 'exit' or 'hang', got {self.kind!r}")


@dataclass(slots=True)
class CommStats:
    """Where a rank's step time went outside its own compute (seconds, summed over the run)."""

    all_reduce_calls: int = 0
    all_reduce_s: float = 0.0
    plan_sync_s: float = 0.0       # sending / receiving the plan and comparing digests
    plans: int = 0


def plan_digest(plan: StepPlan, k: int) -> int:
    """8 bytes of a hash of ``(k, plan.fingerprint())`` as an int64 (``hash()`` differs per process)."""
    raw = hashlib.blake2b(repr((k, plan.fingerprint())).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


class TPGroup:
    """One rank's membership: the store that carries plans, the process group that carries all-reduces
    (and, on CUDA, a gloo group for the digests), the count of plans executed, and the first failure."""

    def __init__(self, store, rank: int, world: int, device: torch.device, timeout_s: float,
                 fault: Fault | None = None) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.fault = fault if fault is not None and fault.rank == rank else None
        timeout = timedelta(seconds=timeout_s)
        self.cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world, timeout)
        self.group = self.cpu_group if device.type == "cpu" else _nccl_group(store, rank, world, timeout)
        self.k = 0                                   # plans executed so far (the next plan's number)
        self.failure: BaseException | None = None
        self.stats = CommStats()

    # -- the per-layer collective --
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t, group=self.group)
        except Exception as exc:     # noqa: BLE001 - a peer died or the deadline passed
            raise self._broken("an all-reduce", exc) from exc
        self.stats.all_reduce_s += time.perf_counter() - t0
        self.stats.all_reduce_calls += 1
        return t

    # -- the per-step plan --
    def send_plan(self, plan: StepPlan) -> StepPlan:
        """Rank 0: publish plan ``k``, then check that every rank holds the same one."""
        t0 = time.perf_counter()
        try:
            self.store.set(f"plan/{self.k}", pickle.dumps(plan))
        except Exception as exc:     # noqa: BLE001
            raise self._broken("publishing the plan", exc) from exc
        plan = self._check(self._inject(plan))
        self.store.delete_key(f"plan/{self.k - 1}")   # every rank has read it (they passed the check)
        self.stats.plan_sync_s += time.perf_counter() - t0
        return plan

    def recv_plan(self) -> StepPlan | None:
        """Ranks 1..N-1: wait (as long as the driver idles) for plan ``k``; None means stop."""
        key = f"plan/{self.k}"
        try:
            self.store.wait([key], IDLE_TIMEOUT)
            t0 = time.perf_counter()
            raw = self.store.get(key)
        except Exception as exc:     # noqa: BLE001 - the driver (and its store) went away
            raise self._broken("waiting for the next plan", exc) from exc
        if raw == _STOP:
            return None
        plan = self._check(self._inject(pickle.loads(raw)))
        self.stats.plan_sync_s += time.perf_counter() - t0
        return plan

    def stop_workers(self) -> None:
        """Rank 0: tell the others to leave their loop (best effort: they may be gone already)."""
        try:
            self.store.set(f"plan/{self.k}", _STOP)
        except Exception:            # noqa: BLE001
            pass

    def _check(self, plan: StepPlan) -> StepPlan:
        mine = torch.tensor([plan_digest(plan, self.k)], dtype=torch.int64)
        all_digests = [torch.zeros_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(all_digests, mine, group=self.cpu_group)
        except Exception as exc:     # noqa: BLE001
            raise self._broken("comparing plan digests", exc) from exc
        digests = [int(t) for t in all_digests]
        if len(set(digests)) > 1:
            listing = ", ".join(f"rank {r}: {d & (2**64 - 1):016x}" for r, d in enumerate(digests))
            err = DistributedError(
                f"tensor-parallel rank {self.rank}: the ranks hold different plans for plan {self.k} "
                f"(scheduler step {plan.step}): {listing}; stopping every rank instead of running "
                "different batches")
            self.failure = self.failure or err
            raise err
        self.k += 1
        self.stats.plans += 1
        return plan

    def _inject(self, plan: StepPlan) -> StepPlan:
        if self.fault is None or self.fault.at != self.k:
            return plan
        if self.fault.kind == "exit":
            sys.stderr.write(f"minicb: tensor-parallel rank {self.rank}: injected exit at plan {self.k}\n")
            sys.stderr.flush()
            os._exit(1)
        if self.fault.kind == "hang":
            time.sleep(10**6)
        if len(plan.seqs) > 1:
            return dataclasses.replace(plan, seqs=plan.seqs[:-1])
        s = dataclasses.replace(plan.seqs[0], block_table=plan.seqs[0].block_table[::-1] + (0,))
        return dataclasses.replace(plan, seqs=(s,))

    def _broken(self, what: str, exc: BaseException) -> DistributedError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err = DistributedError(
            f"tensor-parallel rank {self.rank}: {what} failed at plan {self.k}: {first} (another rank "
            f"died, hung past the {self.timeout_s:g} s timeout, or left the group)")
        self.failure = self.failure or err
        return err

    def fail(self, exc: BaseException) -> None:
        """Record a failure that left collectives unmatched (the group cannot be used any more)."""
        self.failure = self.failure or exc


def _nccl_group(store, rank: int, world: int, timeout: timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world, opts)
