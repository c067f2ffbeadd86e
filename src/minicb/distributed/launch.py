"""Starting a tensor-parallel group: ``launch(model, config, N)`` returns rank 0's engine.

Two ways to get N processes:

* **Here** (``LLM(..., tensor_parallel_size=N)``, ``minicb generate --tp N``): this process is rank
  0; ranks 1..N-1 are started with ``torch.multiprocessing`` (a forkserver where the OS has one,
  else spawn). Each gets only its shard of the weights, as one shared-memory segment.
* **Under torchrun** (environment ``RANK`` / ``WORLD_SIZE``, any number of machines): nothing is
  spawned; every process loads the model and keeps its shard. Rank 0 returns the engine; on the
  other ranks ``launch`` serves rank 0's plans and then exits the process (``SystemExit(0)``).

Start-up is a barrier (``_join``): every rank announces itself in the store once its shard is built,
and a rank that exits early fails the launch at once. Then rank 0 builds its ``TPRunner`` and a plain
``LLMEngine`` around it; the workers run ``serve``. A worker that fails prints one line, reports it
to rank 0 through a queue (``Workers.reports``) and exits with status 1.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.errors import DistributedError, InvalidArgument
from minicb.distributed.group import DEFAULT_TIMEOUT_S, Fault, TPGroup
from minicb.distributed.runner import TPRunner, Workers, serve, worker_runner
from minicb.distributed.sharding import RankShard, ShardedLlama, shard_layout, shard_state_dict
from minicb.engine.llm_engine import LLMEngine
from minicb.model.llama import LlamaForCausalLM

STARTUP_TIMEOUT_S = 600.0         # ranks loading the model and joining the group


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
           fault: Fault | None = None) -> LLMEngine:
    """Start a tensor-parallel group for ``model`` (the whole model, on any device) and return rank 0's
    engine: an ``LLMEngine`` whose runner is a ``TPRunner`` (``engine.runner.comm_stats``,
    ``engine.runner.workers``; ``engine.shutdown()`` stops the group). Spawns ranks 1..N-1 here, or
    joins a ``torchrun`` job (see the module docstring; there, on ranks other than 0, this serves rank 0
    and then raises ``SystemExit(0)``)."""
    world = tensor_parallel_size
    cfg = model.config
    shards = shard_layout(cfg, world)
    device = torch.device(device) if device is not None else model.device

    def engine(shard_model: ShardedLlama, tp: TPGroup, workers: Workers) -> LLMEngine:
        runner = TPRunner(shard_model, config, tp, workers, attn_backend=attn_backend, seed=seed,
                          tokenizer=tokenizer)
        return LLMEngine(runner, config, tokenizer, clock=clock)

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
            _serve_rank(rank, lambda: (worker_runner(shard_model, config, attn_backend), tp))
            raise SystemExit(0)
        return engine(shard_model, tp, Workers())
    if device.type == "cuda" and (not dist.is_nccl_available() or torch.cuda.device_count() < world):
        raise InvalidArgument(f"tensor_parallel_size={world} on CUDA needs NCCL and {world} GPUs (rank r "
                              f"uses cuda:r); this machine has {torch.cuda.device_count()}")
    return _launch_local(model, config, shards, device, engine, attn_backend, timeout_s, startup_timeout_s,
                         fault)


def _launch_local(model, config, shards, device, engine, attn_backend, timeout_s, startup_timeout_s, fault):
    cfg, world = model.config, len(shards)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=startup_timeout_s))
    ctx = _mp_context()
    workers = Workers(queue=ctx.SimpleQueue())
    full = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    threads = _threads(world)
    try:
        for shard in shards[1:]:
            spec = _RankSpec(shard.rank, world, "127.0.0.1", store.port, cfg, shard,
                             *_flatten(shard_state_dict(full, cfg, shard)), config, model.dtype,
                             _rank_device(device, shard.rank), attn_backend, timeout_s,
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
        return engine(shard_model, tp, workers)
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
    ctx.set_forkserver_preload(["minicb.distributed.launch"])
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
        return worker_runner(model, spec.config, spec.attn_backend), tp

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
