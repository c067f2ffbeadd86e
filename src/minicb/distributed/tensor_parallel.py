"""Tensor parallelism: one model split across N processes that run every step together.

With tensor parallelism (Megatron-LM's scheme) every rank holds a slice of every weight matrix and runs
the *same* step on the *same* flat batch; two all-reduces per layer sum the ranks' partial results. So
the seed's last warning applies literally: all ranks must agree on every step's batch. If they do
not, their collectives pair up wrongly: a rank may hang, fail with an error far from the cause, or
(when the shapes happen to agree) silently sum unrelated numbers. minicb's answer, in one picture::

    rank 0 (the driver: LLM / engine)               ranks 1 .. N-1 (workers: a ModelRunner each)
    plan = scheduler.schedule()                     no scheduler, no sampler: they follow
    store.set("plan/k", plan) ───────────────────►  plan = store.get("plan/k")    (waits while idle)
    all_gather(digest(plan)) ◄─────────────────────► all_gather(digest(plan))     (differ: error on all)
    runner.run(plan, params) ◄─ 2 all-reduces per layer ─► runner.run(plan)     (the same method)
    scheduler.update(...)

**One rank schedules.** Only rank 0 runs the scheduler and the sampler; each executed plan goes to the
others through the key-value store that every ``torch.distributed`` job already has (a ``TCPStore``),
as plan number ``k``. Then every rank all-gathers an 8-byte digest of ``(k, plan.fingerprint())``
(slot ids, token counts, positions, block tables, swaps) and compares: any difference raises
``DistributedError`` on *every* rank before the forward, so ranks never enter all-reduces of different
shapes. The store (not a broadcast) carries the plan because a worker may wait for the next plan for
as long as the user leaves the engine idle, while the driver must never block on a worker that is not
listening: it writes the plan and moves on, and every collective after that has a deadline.

**Never a hang.** All collectives run on a process group created with ``timeout`` (default 60 s): a
rank that dies closes its sockets and the others' pending collective fails at once; a rank that hangs
makes the others' collective fail when the deadline passes. Either way each surviving rank raises
``DistributedError``; workers print it, report it to the driver and exit with status 1; the driver's
``step()`` raises it (after the step's requests end with ``finish_reason == "error"``), stops the
workers it launched and includes their reports. If the driver dies, a waiting worker's store
connection breaks and it exits too. A failure is final: the engine refuses further steps.

**Sharding of each layer** (``shard_layout`` decides which heads and columns rank ``r`` holds)::

    x ─ RMSNorm ─┬ q_proj[q heads of r]  ─┐ attention over r's heads,
                 ├ k_proj[kv heads of r] ─┼ r's own KV cache ─ o_proj[:, q heads of r] ─ all-reduce ─ + x
                 └ v_proj[kv heads of r] ─┘
    x ─ RMSNorm ─ gate_proj[cols of r], up_proj[cols of r] ─ silu(g)·u ─ down_proj[:, cols of r]
                                                                          ─ all-reduce ─ + x

q / k / v and gate / up are *column-parallel* (each rank computes some output features, no
communication); o_proj and down_proj are *row-parallel* (each rank multiplies its slice of the input
features and the partial products are summed by an all-reduce, ``RowParallelLinear``). Everything
else (RMSNorm, RoPE, the residual stream) is computed on every rank. Each rank's KV cache holds only
its own KV heads, so KV memory per rank is divided as well.

Heads are split *by KV group*, so each rank's query heads use only KV heads it holds and its
attention is an ordinary grouped-query attention (no change to any attention backend):

* ``N <= kv heads``: rank ``r`` gets a contiguous, near-equal share of the KV heads and all of their
  query heads. SmolLM2 (9 q / 3 kv) with N = 3: one KV head and 3 query heads per rank. With N = 2:
  rank 0 gets kv heads 0-1 (q heads 0-5), rank 1 kv head 2 (q heads 6-8): uneven, so rank 0 does twice
  the attention work, but no KV head is stored twice.
* ``N > kv heads``: the ranks are split into one near-equal group per KV head; every rank of a group
  holds (replicates) that KV head and a share of its query heads. 4 q / 1 kv with N = 2: both ranks
  hold kv head 0, rank 0 q heads 0-1, rank 1 q heads 2-3. N may not exceed the number of query heads.

The MLP's intermediate columns are split near-equally (uneven when N does not divide them).

**Embedding and LM head: replicated.** Every rank holds the whole embedding (it needs the whole
residual stream anyway); only rank 0 applies the LM head, to the rows it samples. A vocab-parallel
head would divide those weights too (at the price of a gather of logits every step); for the models
minicb runs, replication keeps the code and the step shorter.

**Launching.** ``LLM(..., tensor_parallel_size=N)`` / ``minicb generate --tp N`` run rank 0 in the
calling process and start ranks 1..N-1 with ``torch.multiprocessing`` (spawn; each gets only its
shard of the weights, through shared memory). Under ``torchrun`` (environment ``RANK`` /
``WORLD_SIZE``, any number of machines) nothing is spawned: every process loads the model and keeps
its shard; rank 0 returns the engine, and on the other ranks ``LLM(...)`` serves rank 0's plans and
then exits the process (``SystemExit(0)``) when rank 0 shuts down. Backend: gloo for CPU tensors,
NCCL on CUDA (plan digests always go through gloo). On the CPU each rank uses
``cpu_count // N`` intra-op threads (at least 1).

Process groups here are plain objects owned by the engine (no ``init_process_group``), so nothing
global is left behind and several engines can live in one process. ``Fault`` lets the tests make one
rank diverge, die or hang at a chosen plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.errors import DistributedError, InvalidArgument, check_int
from minicb.core.plan import StepPlan
from minicb.engine.llm_engine import LLMEngine
from minicb.model.llama import LlamaForCausalLM
from minicb.runtime.runner import ModelRunner

DEFAULT_TIMEOUT_S = 60.0          # deadline of every collective once the group is up
STARTUP_TIMEOUT_S = 600.0         # ranks loading the model and joining the group
IDLE_TIMEOUT = timedelta(days=7)  # how long a worker waits for the next plan of an idle driver
_STOP = b"stop"                   # the plan that ends a worker's loop


# --- which rank holds what ---------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class RankShard:
    """The query heads, KV heads and MLP intermediate columns that one rank holds."""

    rank: int
    q_heads: range
    kv_heads: range
    mlp: range


def _split(r: range, n: int) -> list[range]:
    """``r`` cut into ``n`` contiguous parts whose lengths differ by at most one (longer ones first)."""
    q, extra = divmod(len(r), n)
    bounds = [r.start]
    for i in range(n):
        bounds.append(bounds[-1] + q + (i < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def shard_layout(cfg: ModelConfig, world: int) -> tuple[RankShard, ...]:
    """Who holds which heads and columns (module docstring, "Sharding"). Raises ``InvalidArgument`` if
    ``world`` exceeds the query heads or the MLP's intermediate size."""
    h, k = cfg.num_attention_heads, cfg.num_key_value_heads
    check_int("tensor_parallel_size", world, lo=1, hi=min(h, cfg.intermediate_size))
    group = h // k
    mlp = _split(range(cfg.intermediate_size), world)
    if world <= k:
        kv = _split(range(k), world)
        return tuple(RankShard(r, range(kv[r].start * group, kv[r].stop * group), kv[r], mlp[r])
                     for r in range(world))
    shards: list[RankShard] = []
    for j, ranks in enumerate(_split(range(world), k)):          # the ranks that share KV head j
        q_parts = _split(range(j * group, (j + 1) * group), len(ranks))
        shards += [RankShard(r, q, range(j, j + 1), mlp[r]) for r, q in zip(ranks, q_parts)]
    return tuple(shards)


def local_config(cfg: ModelConfig, shard: RankShard) -> ModelConfig:
    """The shape of one rank's slice: a LLaMA with fewer heads and a narrower MLP (same hidden size)."""
    return dataclasses.replace(cfg, num_attention_heads=len(shard.q_heads),
                               num_key_value_heads=len(shard.kv_heads),
                               intermediate_size=len(shard.mlp), head_dim=cfg.head_dim)


def shard_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig,
                     shard: RankShard) -> dict[str, torch.Tensor]:
    """One rank's weights (Hugging Face names): sliced ones are fresh, contiguous copies (so the full
    tensors can be freed); replicated ones (embedding, norms, head) are the originals."""
    d = cfg.head_dim
    q = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    cols = slice(shard.mlp.start, shard.mlp.stop)
    out = {}
    for name, w in state_dict.items():
        if name.endswith("q_proj.weight"):
            w = w[q]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            w = w[kv]
        elif name.endswith("o_proj.weight"):
            w = w[:, q]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            w = w[cols]
        elif name.endswith("down_proj.weight"):
            w = w[:, cols]
        else:
            out[name] = w
            continue
        out[name] = w.clone(memory_format=torch.contiguous_format)
    return out


# --- one rank's view of the group --------------------------------------------------------------------
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


# --- the sharded model --------------------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """``y = x_r @ W_r.T`` summed over ranks: rank ``r`` holds the input columns ``W_r`` of its heads (or
    MLP columns) and an all-reduce adds the partial products. The weight keeps its parameter name."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class ShardedLlama(LlamaForCausalLM):
    """One rank's slice of a LLaMA: ``config`` is the local shape (``local_config``), ``full_config`` the
    model's. Its forward is the single-process one; only o_proj and down_proj are row-parallel."""

    full_config: ModelConfig
    tp: TPGroup | None = None

    @classmethod
    def build(cls, cfg: ModelConfig, shard: RankShard, state_dict: dict[str, torch.Tensor],
              dtype: torch.dtype, device: torch.device) -> ShardedLlama:
        model = cls.from_state_dict(local_config(cfg, shard), state_dict, dtype, device)
        model.full_config = cfg
        return model

    def attach(self, tp: TPGroup) -> None:
        """Make o_proj and down_proj row-parallel over ``tp``."""
        self.tp = tp
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj.weight, tp)
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj.weight, tp)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        try:
            return super().forward(*args, **kwargs)
        except BaseException as exc:   # the other ranks wait in an all-reduce this rank will not join
            self.tp.fail(exc)
            raise


def serve(runner: ModelRunner, tp: TPGroup) -> None:
    """The loop of ranks 1..N-1: every plan rank 0 executes, executed here on this rank's shard by the
    same ``ModelRunner.run`` rank 0 calls (without sampling parameters: no LM head, no sampling), so
    every rank makes the same collectives in the same order."""
    while (plan := tp.recv_plan()) is not None:
        runner.run(plan)


# --- rank 0: the engine --------------------------------------------------------------------------------
class TPEngine(LLMEngine):
    """``LLMEngine`` on rank 0 of a tensor-parallel group: the model is rank 0's shard, each executed plan
    is shared with the other ranks first, and a failure of the group is raised (``DistributedError``)."""

    def __init__(self, model: ShardedLlama, config: SchedulerConfig, tp: TPGroup, workers: _Workers,
                 **kwargs) -> None:
        super().__init__(model, config, **kwargs)
        self.tp = tp
        self.workers = workers
        self._finalizer = weakref.finalize(self, workers.close, tp, False)
        self._shut_down = False

    @property
    def comm_stats(self) -> CommStats:
        return self.tp.stats

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Share the plan with the other ranks (and check they hold the same), then run it here."""
        plan = self.tp.send_plan(plan)
        return super().execute(plan)

    def add_request(self, *args, **kwargs) -> str:
        self._check_open()
        return super().add_request(*args, **kwargs)

    def step(self):
        if self._shut_down and self._pending:      # the final outputs of requests ended by shutdown()
            outs, self._pending = self._pending, []
            return outs
        self._check_open()
        self._raise_if_failed()
        outs = super().step()       # a failure inside execute ended the step's requests with an error
        self._raise_if_failed()
        return outs

    def _check_open(self) -> None:
        if self._shut_down:
            raise InvalidArgument("this tensor-parallel engine was shut down (its other ranks are gone): "
                                  "create a new LLM(..., tensor_parallel_size=N) to serve more requests")

    def _raise_if_failed(self) -> None:
        failure = self.tp.failure
        if failure is None:
            return
        self.workers.close(self.tp, abort=True)
        msg = str(failure) if isinstance(failure, DistributedError) else \
            f"tensor-parallel rank 0: the step failed inside the forward: {type(failure).__name__}: {failure}"
        reports = self.workers.describe()
        raise DistributedError(msg + (f"; {reports}" if reports else "")) from failure

    def shutdown(self) -> None:
        """Stop the other ranks and release the group (idempotent; also runs when the engine is freed).
        Unfinished requests end with ``finish_reason == "abort"``; ``step()`` hands out their outputs,
        then every further ``step()`` / ``add_request()`` raises ``InvalidArgument``."""
        if not self._shut_down:
            self._shut_down = True
            for rid in list(self._live):
                out = self.abort_request(rid)
                if out is not None:
                    self._pending.append(out)
        self._finalizer()


@dataclass(slots=True)
class _Workers:
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


# --- launching -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class _RankSpec:
    """Everything a spawned rank needs (its weights travel through shared memory)."""

    rank: int
    world: int
    host: str
    port: int
    cfg: ModelConfig
    shard: RankShard
    weights: torch.Tensor          # the shard's tensors end to end: one shared-memory segment
    index: list                    # (name, shape, offset) of each tensor in ``weights``
    config: SchedulerConfig
    dtype: torch.dtype
    device: torch.device
    attn_backend: str
    timeout_s: float
    startup_timeout_s: float
    threads: int
    fault: Fault | None


def _worker_runner(model: ShardedLlama, config: SchedulerConfig, attn_backend: str) -> ModelRunner:
    """A worker rank's runner: its shard, its own KV heads' cache, the same pool shape as rank 0."""
    return ModelRunner(model, num_blocks=config.num_blocks, block_size=config.block_size,
                       num_host_blocks=config.num_host_blocks, attn_backend=attn_backend)


def _torchrun_env() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local)


def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _join(store, rank: int, world: int, timeout_s: float, dead: Callable[[], str | None] = lambda: None):
    """The start-up barrier: every rank announces itself once its shard is built, then waits for the
    others. ``dead`` (on the driver) names a started rank that already exited, to fail fast; a worker
    whose driver died fails at once, since the store lived in the driver."""
    store.set(f"ready/{rank}", b"1")
    keys = [f"ready/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        gone = dead()
        if gone is not None:
            raise DistributedError(f"tensor-parallel start-up failed: {gone}")
        if time.monotonic() > deadline:
            raise DistributedError(f"tensor-parallel start-up: not every rank joined within {timeout_s:g} s")
        time.sleep(0.02)


def launch(model: LlamaForCausalLM, config: SchedulerConfig, tensor_parallel_size: int, *,
           tokenizer=None, seed: int | None = None, clock: Callable[[], float] = time.perf_counter,
           attn_backend: str = "auto", device: str | torch.device | None = None,
           timeout_s: float = DEFAULT_TIMEOUT_S, startup_timeout_s: float = STARTUP_TIMEOUT_S,
           fault: Fault | None = None) -> TPEngine:
    """Start a tensor-parallel group for ``model`` (the whole model, on any device) and return rank 0's
    engine. Spawns ranks 1..N-1 here, or joins a ``torchrun`` job (see the module docstring; there, on
    ranks other than 0, this serves rank 0 and then raises ``SystemExit(0)``)."""
    world = tensor_parallel_size
    cfg = model.config
    shards = shard_layout(cfg, world)
    device = torch.device(device) if device is not None else model.device
    engine_kwargs = dict(tokenizer=tokenizer, seed=seed, clock=clock, attn_backend=attn_backend)
    env = _torchrun_env()
    if env is not None:
        rank, env_world = env
        if env_world != world:
            raise InvalidArgument(f"tensor_parallel_size is {world} but torchrun started WORLD_SIZE="
                                  f"{env_world} processes; they must be equal")
        store = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=startup_timeout_s)))[0]
        store = dist.PrefixStore("minicb", store)
        dev = _rank_device(device, rank)
        if dev.type == "cpu":
            torch.set_num_threads(_threads(min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
        weights = shard_state_dict(model.state_dict(), cfg, shards[rank])
        shard_model = ShardedLlama.build(cfg, shards[rank], weights, model.dtype, dev)
        del weights
        del model
        _join(store, rank, world, startup_timeout_s)
        tp = TPGroup(store, rank, world, dev, timeout_s, fault)
        shard_model.attach(tp)
        if rank != 0:
            _serve_rank(rank, lambda: (_worker_runner(shard_model, config, attn_backend), tp))
            raise SystemExit(0)
        return TPEngine(shard_model, config, tp, _Workers(), **engine_kwargs)
    if device.type == "cuda" and (not dist.is_nccl_available() or torch.cuda.device_count() < world):
        raise InvalidArgument(f"tensor_parallel_size={world} on CUDA needs NCCL and {world} GPUs (rank r "
                              f"uses cuda:r); this machine has {torch.cuda.device_count()}")
    return _launch_local(model, config, shards, device, engine_kwargs, timeout_s, startup_timeout_s, fault)


def _launch_local(model, config, shards, device, engine_kwargs, timeout_s, startup_timeout_s, fault):
    cfg, world = model.config, len(shards)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=startup_timeout_s))
    ctx = _mp_context()
    workers = _Workers(queue=ctx.SimpleQueue())
    full = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    threads = _threads(world)
    try:
        for shard in shards[1:]:
            spec = _RankSpec(shard.rank, world, "127.0.0.1", store.port, cfg, shard,
                             *_flatten(shard_state_dict(full, cfg, shard)), config, model.dtype,
                             _rank_device(device, shard.rank), engine_kwargs["attn_backend"], timeout_s,
                             startup_timeout_s, threads, fault)
            p = ctx.Process(target=_spawned_rank, args=(spec, workers.queue), daemon=True,
                            name=f"minicb-tp-rank{shard.rank}")
            p.start()
            workers.processes.append(p)
            spec = None                            # its weights now live in shared memory
        dev0 = _rank_device(device, 0)
        if dev0.type == "cpu":
            torch.set_num_threads(threads)
        weights = shard_state_dict(full, cfg, shards[0])
        shard_model = ShardedLlama.build(cfg, shards[0], weights, model.dtype, dev0)
        del weights
        del full

        def dead() -> str | None:
            for p in workers.processes:
                if not p.is_alive():
                    workers._collect()
                    rank = int(p.name.removeprefix("minicb-tp-rank"))
                    return f"rank {rank} exited with code {p.exitcode}" + (
                        f": {workers.reports[rank]}" if rank in workers.reports else "")
            return None

        prefixed = dist.PrefixStore("minicb", store)
        _join(prefixed, 0, world, startup_timeout_s, dead)
        tp = TPGroup(prefixed, 0, world, dev0, timeout_s, fault)   # keeps the TCPStore server alive
        shard_model.attach(tp)
        return TPEngine(shard_model, config, tp, workers, **engine_kwargs)
    except BaseException:
        for p in workers.processes:
            p.terminate()
        raise


def _flatten(state_dict: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """All tensors in one buffer, so a rank's shard crosses to its process as one shared-memory
    segment (one file descriptor; a forkserver passes at most a few hundred)."""
    dtypes = {t.dtype for t in state_dict.values()}
    if len(dtypes) != 1:
        raise InvalidArgument(f"the model's weights must share one dtype, got {sorted(map(str, dtypes))}")
    flat = torch.empty(sum(t.numel() for t in state_dict.values()), dtype=dtypes.pop())
    index, offset = [], 0
    for name, t in state_dict.items():
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        index.append((name, tuple(t.shape), offset))
        offset += t.numel()
    return flat, index


def _unflatten(flat: torch.Tensor, index: list) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape, offset in index:
        n = 1
        for d in shape:
            n *= d
        out[name] = flat[offset:offset + n].view(shape)
    return out


def _mp_context():
    """``forkserver`` where the OS has it: one clean server process imports torch and minicb once, and
    every later rank is a fork of it (milliseconds, where a spawned interpreter takes seconds to import
    torch); otherwise ``spawn``. Never plain ``fork``: the driver may already run OpenMP or CUDA threads."""
    import multiprocessing

    import torch.multiprocessing as mp

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["minicb.distributed.tensor_parallel"])
    return ctx


def _spawned_rank(spec: _RankSpec, queue) -> None:
    """Entry point of a rank started by ``launch`` (runs in a fresh interpreter)."""
    if spec.device.type == "cpu":
        torch.set_num_threads(spec.threads)
    elif spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)

    def setup():
        store = dist.TCPStore(spec.host, spec.port, spec.world, is_master=False,
                              timeout=timedelta(seconds=spec.startup_timeout_s))
        store = dist.PrefixStore("minicb", store)
        weights = _unflatten(spec.weights, spec.index)
        model = ShardedLlama.build(spec.cfg, spec.shard, weights, spec.dtype, spec.device)
        del weights
        spec.weights = None
        _join(store, spec.rank, spec.world, spec.startup_timeout_s)
        tp = TPGroup(store, spec.rank, spec.world, spec.device, spec.timeout_s, spec.fault)
        model.attach(tp)
        return _worker_runner(model, spec.config, spec.attn_backend), tp

    _serve_rank(spec.rank, setup, queue)


def _serve_rank(rank: int, setup, queue=None) -> None:
    """Run a worker rank; on any error print one line, report it and exit with status 1."""
    try:
        runner, tp = setup()
        serve(runner, tp)
    except BaseException as exc:    # noqa: BLE001 - a worker must never outlive a broken group
        msg = f"{type(exc).__name__}: {exc}"
        sys.stderr.write(f"minicb: tensor-parallel rank {rank}: {msg}\n")
        sys.stderr.flush()
        if queue is not None:
            queue.put((rank, msg))
        raise SystemExit(1) from None
    if queue is not None:
        queue.put((rank, "ok"))
