"""Tensor parallelism (``minicb.distributed``): N gloo processes on the CPU give TP 1's
tokens, and a broken group (a rank that diverges, dies or hangs) raises ``DistributedError`` everywhere, never
hangs.

Each multi-process test launches its ranks (a forkserver makes every launch after the first cheap).
Equivalence runs in float64 with continuous batching, chunked prefill and preemption in play.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers import TINY, random_prompts, tiny_model
from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.errors import DistributedError, InvalidArgument
from minicb.core.sampling_params import SamplingParams
from minicb.distributed.group import Fault
from minicb.distributed.launch import launch
from minicb.distributed.sharding import local_config, shard_layout, shard_state_dict
from minicb.entrypoints.llm import LLM
from minicb.model.attention import ReferenceAttention
from minicb.model.llama import LlamaForCausalLM, rope_cos_sin
from minicb.runtime.packer import pack_prompts
from minicb.runtime.runner import engine_for

TIMEOUT_S = 60.0          # collective deadline in these tests, a hang guard (a healthy step: milliseconds)


# --- the layout (no processes) ------------------------------------------------------------------------
def _cfg(h: int, k: int, inter: int = 64) -> ModelConfig:
    return ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=inter, num_hidden_layers=1,
                       num_attention_heads=h, num_key_value_heads=k, head_dim=8)


@pytest.mark.parametrize("h, k", [(4, 2), (4, 1), (9, 3), (8, 8), (6, 2), (12, 3)])
def test_shard_layout_covers_every_head_once_with_its_kv_head(h, k):
    cfg = _cfg(h, k, inter=13)
    group = h // k
    for world in range(1, h + 1):
        shards = shard_layout(cfg, world)
        assert [s.rank for s in shards] == list(range(world))
        assert sorted(q for s in shards for q in s.q_heads) == list(range(h))
        assert [c for s in shards for c in s.mlp] == list(range(13))
        assert max(len(s.mlp) for s in shards) - min(len(s.mlp) for s in shards) <= 1
        for s in shards:
            assert len(s.q_heads) >= 1 and len(s.kv_heads) >= 1
            assert {q // group for q in s.q_heads} == set(s.kv_heads)       # uses only KV heads it holds
            assert len(s.q_heads) % len(s.kv_heads) == 0                   # ordinary GQA on the rank
        held = [kv for s in shards for kv in s.kv_heads]
        if world <= k:
            assert sorted(held) == list(range(k))                          # split, never stored twice
        else:
            assert set(held) == set(range(k)) and len(held) == world       # one replica per rank


def test_shard_layout_examples_from_the_docstring():
    smol = _cfg(9, 3, inter=1536)
    assert [(s.q_heads, s.kv_heads) for s in shard_layout(smol, 3)] == [
        (range(0, 3), range(0, 1)), (range(3, 6), range(1, 2)), (range(6, 9), range(2, 3))]
    assert [(s.q_heads, s.kv_heads, s.mlp) for s in shard_layout(smol, 2)] == [
        (range(0, 6), range(0, 2), range(0, 768)), (range(6, 9), range(2, 3), range(768, 1536))]
    assert [(s.q_heads, s.kv_heads) for s in shard_layout(_cfg(4, 1), 2)] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]


def test_shard_layout_rejects_more_ranks_than_query_heads():
    with pytest.raises(InvalidArgument, match="tensor_parallel_size must be in \\[1, 4\\], got 5"):
        shard_layout(_cfg(4, 2), 5)
    with pytest.raises(InvalidArgument, match="tensor_parallel_size"):
        LLM(tiny_model(), tensor_parallel_size=0)


@pytest.mark.parametrize("h, k, world", [(4, 2, 2), (4, 1, 2), (4, 2, 3), (9, 3, 2)])
def test_shards_summed_equal_the_whole_layer(h, k, world):
    """The algebra without processes: per-rank attention + MLP outputs, summed, equal the full layer's."""
    cfg = dataclasses.replace(_cfg(h, k), num_hidden_layers=1)
    full = LlamaForCausalLM.random(cfg, seed=3)
    batch = pack_prompts([[5, 6, 7, 8], [9, 10]])
    x = torch.randn(6, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, x.dtype)

    def layer_out(model):
        lay, be = model.model.layers[0], ReferenceAttention(None)
        return lay.self_attn(x, cos, sin, 0, be, be.prepare(batch.attn)), lay.mlp(x)

    want_attn, want_mlp = layer_out(full)
    attn, mlp = 0, 0
    for s in shard_layout(cfg, world):
        part = LlamaForCausalLM.from_state_dict(local_config(cfg, s),
                                                shard_state_dict(full.state_dict(), cfg, s), torch.float64)
        a, m = layer_out(part)
        attn, mlp = attn + a, mlp + m
    torch.testing.assert_close(attn, want_attn, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mlp, want_mlp, rtol=1e-12, atol=1e-12)


# --- processes ---------------------------------------------------------------------------------------
def drive(eng, prompts, params, arrivals=None, plans=None) -> list[list[int]]:
    """Request i arrives at step ``arrivals[i]``; returns each request's tokens in input order."""
    arrivals = arrivals or [0] * len(prompts)
    if plans is not None:
        eng.listen(on_plan=lambda ev: plans.append(ev.plan))
    outs, step, added = {}, 0, 0
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while added < len(order) or eng.has_unfinished_requests():
        while added < len(order) and arrivals[order[added]] <= step:
            i = order[added]
            eng.add_request(f"r{i}", prompts[i], params)
            added += 1
        if added == len(order):
            eng.scheduler.close_arrivals()
        for o in eng.step():
            if o.finished:
                assert o.error is None, o.error
                outs[o.request_id] = o.token_ids
        step += 1
        assert step < 10_000
    return [outs[f"r{i}"] for i in range(len(prompts))]


def _tiny_workload(mode: str):
    prompts = random_prompts(10, 5, 40, TINY.vocab_size, seed=11)
    prompts = [prompts[0][:9] + p if i % 2 else p for i, p in enumerate(prompts)]   # prefix-cache hits
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, long_prefill_chunk=8, block_size=4,
                            num_blocks=24, num_host_blocks=12 if mode == "swap" else 0,
                            preemption_mode=mode)
    return prompts, params, sched, [i // 2 for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads, world, mode", [(2, 2, "recompute"), (1, 2, "swap"), (2, 3, "recompute")])
def test_tp_tokens_equal_tp1_tiny(kv_heads, world, mode):
    """TINY (4 q / 2 kv heads) split in 2; 1 KV head with TP 2 (KV replicated); 2 KV heads over 3 ranks.
    Half the prompts share a prefix, so prefix caching (on by default) skips computing some blocks."""
    cfg = dataclasses.replace(TINY, num_key_value_heads=kv_heads)
    model = tiny_model(cfg)
    prompts, params, sched, arrivals = _tiny_workload(mode)
    want = drive(engine_for(model, sched), prompts, params, arrivals)
    eng = launch(model, sched, world, timeout_s=TIMEOUT_S)
    plans = []
    try:
        got = drive(eng, prompts, params, arrivals, plans)
    finally:
        eng.shutdown()
    assert got == want
    # continuous batching with chunked prefill and preemption really happened
    stats = eng.scheduler.stats
    assert stats.num_preemptions > 0 and (mode != "swap" or stats.num_swaps > 0)
    assert stats.num_cached_prompt_tokens > 0
    assert any(any(s.num_tokens > 1 and not s.sample for s in p.seqs) for p in plans)          # chunks
    assert any({s.num_tokens == 1 for s in p.seqs} == {True, False} for p in plans)            # mixed
    # rank 0 holds only its KV shard; 2 all-reduces per layer per forward; every rank ended cleanly
    assert eng.runner.kv_cache.data.shape[-2] == len(shard_layout(cfg, world)[0].kv_heads)
    forwards = sum(1 for p in plans if p.seqs or p.padding)
    assert eng.runner.comm_stats.all_reduce_calls == 2 * cfg.num_hidden_layers * forwards
    assert eng.runner.workers.reports == {r: "ok" for r in range(1, world)}


@pytest.mark.slow
@pytest.mark.model
def test_tp3_smollm2_equals_tp1(smollm2):
    """SmolLM2 (9 q / 3 kv heads: one KV head per rank), float64, chunked prefill and preemption."""
    model = LlamaForCausalLM.from_state_dict(smollm2.config, smollm2.state_dict, torch.float64)
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,",
             "Once upon a time, in a small village by the sea,", "Water is made of hydrogen and"]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    kw = dict(max_num_seqs=5, max_num_batched_tokens=24, long_prefill_chunk=8, block_size=4,
              num_blocks=18)           # the five need 26 blocks at the end: preemption must happen
    want = LLM(model, tokenizer=tok, **kw).generate(prompts, params)
    with LLM(model, tokenizer=tok, tensor_parallel_size=3, **kw) as llm:
        got = llm.generate(prompts, params)
        stats = llm.engine.scheduler.stats
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert stats.num_preemptions > 0
    assert llm.engine.runner.workers.reports == {1: "ok", 2: "ok"}


def _run_until_error(eng, prompts, params):
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        drive(eng, prompts, params)
    return info.value, time.monotonic() - t0


@pytest.mark.timing
@pytest.mark.slow
def test_injected_divergence_raises_on_every_rank():
    """Rank 2 runs an altered plan 3 (one sequence dropped): every rank raises before the forward."""
    prompts, params, sched, _ = _tiny_workload("recompute")
    eng = launch(tiny_model(), sched, 3, timeout_s=TIMEOUT_S, fault=Fault(rank=2, at=3, kind="diverge"))
    try:
        err, elapsed = _run_until_error(eng, prompts, params)
        assert "different plans for plan 3" in str(err) and "rank 2:" in str(err)
        # found by comparing digests, not by a timeout: the error is the digest check's, never the
        # deadline's (no wall-clock bound: how long the steps before took is the machine's business)
        assert "timeout" not in str(err) and "hung" not in str(err)  # load-independent: the error's kind
        for r in (1, 2):
            assert eng.runner.workers.reports[r].startswith("DistributedError: tensor-parallel rank"), r
            assert "different plans for plan 3" in eng.runner.workers.reports[r]
        with pytest.raises(DistributedError):           # the group is gone: no further steps
            eng.step()
    finally:
        eng.shutdown()


@pytest.mark.timing
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["exit", "hang"])
def test_a_worker_that_dies_or_hangs_stops_the_others(kind):
    """Rank 1 calls os._exit(1) (or sleeps) at plan 3: rank 0 raises, rank 2 reports an error and exits.

    No bound here can be broken by a busy machine: a dead peer is found with a 600 s deadline (far past
    any load: only waiting for the deadline takes that long), and a hung one (it sleeps for 10**6 s) is
    found *by* a 30 s deadline, so it takes at least that (load only makes it longer); the same 30 s
    bound every collective of the healthy plans before it, which take milliseconds."""
    timeout = 600.0 if kind == "exit" else 30.0
    prompts, params, sched, _ = _tiny_workload("recompute")
    eng = launch(tiny_model(), sched, 3, timeout_s=timeout, fault=Fault(rank=1, at=3, kind=kind))
    try:
        err, elapsed = _run_until_error(eng, prompts, params)
        assert "tensor-parallel rank 0" in str(err) and "failed at plan 3" in str(err)
        if kind == "exit":
            # load-independent: a 600 s deadline; a dead peer's sockets close at once
            assert elapsed < timeout                    # a dead peer closes its sockets: no waiting
            assert "rank 1: exited with code 1" in str(err)
        else:
            # load-independent: a lower bound on a wait (load only lengthens it)
            assert elapsed >= 0.9 * timeout             # the deadline, not a dead socket, ended it
        assert eng.runner.workers.reports[2].startswith("DistributedError: tensor-parallel rank 2")
        for p in eng.runner.workers.processes:   # each exits after its report: wait for that, not race it
            p.join(60)                            # a hang guard: an exit takes milliseconds
        assert all(not p.is_alive() for p in eng.runner.workers.processes)
    finally:
        eng.shutdown()


DRIVER_DIES = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from minicb.core.config import SchedulerConfig
from minicb.distributed import Fault, launch
from minicb.core.sampling_params import SamplingParams

if __name__ == "__main__":
    torch.set_num_threads(1)
    eng = launch(tiny_model(), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), 3,
                 timeout_s=60, fault=Fault(rank=0, at=2, kind="exit"))
    print("pids", *[p.pid for p in eng.runner.workers.processes], flush=True)
    for i in range(4):
        eng.add_request(str(i), [5, 6, 7, 8, 9], SamplingParams(max_tokens=8))
    while eng.has_unfinished_requests():
        eng.step()
"""


@pytest.mark.slow
def test_driver_that_dies_makes_the_workers_exit(tmp_path):
    """Rank 0 (the driver process) dies mid-run: both workers raise and exit; nothing is left running.

    ``subprocess.run`` returns only once every process holding the pipes (the workers too) has exited.
    """
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER_DIES.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    pids = [int(p) for p in r.stdout.split()[1:]]
    assert len(pids) == 2
    for rank in (1, 2):
        assert f"minicb: tensor-parallel rank {rank}: DistributedError" in r.stderr, r.stderr
    for pid in pids:
        assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_files import tiny_weights, write_gguf

    return write_gguf(tmp_path_factory.mktemp("tp") / "tiny.gguf", tiny_weights(never_eos=True),
                      quantize=False)


@pytest.mark.slow
def test_cli_tp2_here_and_under_torchrun_equals_tp1(tiny_gguf, capsys):
    """``minicb generate --tp 2`` on a 2 q / 1 kv head model (the KV head replicated): ranks started by
    this process, then under ``torchrun`` (each process loads the model and keeps its shard; rank 0
    prints, rank 1 serves and exits)."""
    from minicb.entrypoints.cli import main

    args = ["generate", "hi", "the sea", "--model", str(tiny_gguf), "--dtype", "float64",
            "--max-tokens", "12", "--max-num-batched-tokens", "4"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert want.count("\n") == 2
    assert main([*args, "--tp", "2"]) == 0
    assert capsys.readouterr().out == want
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "minicb", *args, "--tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == want
