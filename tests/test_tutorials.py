"""Every tutorial runs (as a reader would: ``python tutorials/NN_name.py``) and the facts it prints are
true: each number is recomputed here independently, from the scheduler driven by a fake model, the
block manager, or plain arithmetic."""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from minicb.block_manager import BlockManager
from minicb.config import SchedulerConfig
from minicb.sampling_params import SamplingParams
from minicb.scheduler import Scheduler
from minicb.sequence import Sequence

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
CHAPTERS = sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py"))


@functools.cache
def run(name: str) -> str:
    """Run one tutorial in a fresh interpreter; return its stdout (it must exit 0)."""
    proc = subprocess.run([sys.executable, str(TUTORIALS / name)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def module(name: str):
    """Import a tutorial's constants (its main() is not run)."""
    sys.path.insert(0, str(TUTORIALS))
    try:
        spec = importlib.util.spec_from_file_location(name[:-3], TUTORIALS / name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(TUTORIALS))


def value(text: str, pattern: str):
    """The first group of ``pattern`` in ``text``, parsed as a Python literal when it is one."""
    m = re.search(pattern, text)
    assert m, f"the tutorial no longer prints {pattern!r}"
    try:
        return ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return m.group(1)


def prompt(length: int, k: int) -> list[int]:
    """The tutorials' prompt ids (``_common.prompt_ids``): the same inputs, so prefix caching (when on)
    sees the same prefixes."""
    return [4 + (k * 7 + i * 13) % 60 for i in range(length)]


def drive(config: SchedulerConfig, lengths, arrivals=None):
    """The scheduler with a fake model: ``lengths`` = (prompt length or ids, output) per request, ids
    r0, r1, ...; request k's prompt is ``prompt(length, k)`` unless ids are given."""
    sched = Scheduler(config)
    arrivals = arrivals or [0] * len(lengths)
    plans, finish, step, k = [], {}, 0, 0
    while k < len(lengths) or sched.has_unfinished():
        while k < len(lengths) and arrivals[k] <= step:
            p, o = lengths[k]
            ids = prompt(p, k) if isinstance(p, int) else list(p)
            sched.add(Sequence(f"r{k}", ids, SamplingParams(max_tokens=o, ignore_eos=True)))
            k += 1
        if k == len(lengths):
            sched.close_arrivals()
        plan = sched.schedule()
        plans.append(plan)
        for seq in sched.update(plan, {s.request_id: 7 for s in plan.seqs if s.sample}, 0.0):
            finish[seq.request_id] = step
        step += 1
    return sched, plans, finish


def test_every_chapter_is_tested():
    assert len(CHAPTERS) == 9
    tested = {int(n.split("_")[1][:2]) for n in globals() if re.match(r"test_\d\d_", n)}
    assert tested == {int(c[:2]) for c in CHAPTERS}


def test_01_static_batching():
    out, mod = run("01_static_batching.py"), module("01_static_batching.py")
    prompts = [p for p, _ in mod.REQUESTS.values()]
    outs = [o for _, o in mod.REQUESTS.values()]
    big, decodes = max(prompts), max(outs) - 1
    # padded batch: left padding in the prefill, then every finished row for every later step
    padded = sum(big - p for p in prompts) + sum(max(0, decodes - (o - 1)) for o in outs)
    total = len(prompts) * (big + decodes)
    assert value(out, r"token slots computed: (\d+), of which padding: \d+") == total
    assert value(out, r"token slots computed: \d+, of which padding: (\d+)") == padded
    assert value(out, r"padding waste of the static batch: ([\d.]+)%") == round(100 * padded / total, 2)
    for policy in ("static", "continuous"):
        cfg = SchedulerConfig(max_num_seqs=mod.SLOTS, max_num_batched_tokens=64, block_size=4, num_blocks=64,
                              policy=policy)
        sched, _, _ = drive(cfg, list(mod.REQUESTS.values()))
        assert value(out, rf"{policy}: (\d+) steps;") == sched.stats.num_steps
        assert value(out, rf"{policy}: scheduler counted (\d+) padding tokens") == \
            sched.stats.num_padding_tokens
    assert "slot 0  |AaaCccccDddd  |" in out                     # A's slot refilled by C at once
    assert value(out, r"continuous and the padded baseline: (\w+)") is True


def test_02_ragged_packing():
    out = run("02_ragged_packing.py")
    assert value(out, r"cu_seqlens_q = (\[[^\]]*\])") == [0, 1, 2, 5]          # the seed's offsets
    assert list(value(out, r"positions\s+: \[([^\]]*)\]")) == [37, 0, 0, 1, 2]
    assert value(out, r"cu_seqlens_k = (\[[^\]]*\])") == [0, 38, 39, 42]
    # B's 38 positions fill blocks 0..9 (block 9 offset 1 = position 37), A gets block 10, C block 11
    assert value(out, r"slot_mapping = (\[[^\]]*\])") == [9 * 4 + 1, 10 * 4, 11 * 4, 11 * 4 + 1, 11 * 4 + 2]
    assert value(out, r"would compute (\d+) token rows") == 9
    assert value(out, r"up to float64 rounding\): (\w+)") is True


def test_03_slot_table():
    out = run("03_slot_table.py")
    assert "assign('D') -> 1" in out and "assign('E') -> 3" in out
    assert "raises InvalidArgument: no free slot" in out
    mod = module("03_slot_table.py")
    requests = [("A", 4, 2), ("B", 3, 6), ("C", 5, 3), ("D", 2, 4), ("E", 6, 1), ("F", 3, 3)]
    assert "requests: " + ", ".join(f"{r}(prompt {p}, output {o})" for r, p, o in requests) in out
    sched, _, finish = drive(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, block_size=4,
                                             num_blocks=32), [(p, o) for _, p, o in requests])
    names = {f"r{i}": r for i, (r, _, _) in enumerate(requests)}
    assert value(out, r"finish step of each request: (\{[^}]*\})") == {names[k]: v for k, v in finish.items()}
    assert value(out, r"total steps: (\d+)") == sched.stats.num_steps
    assert mod.picture(mod.SlotTable(2)) == "slots: [0: - ] [1: - ]   free: [0, 1]"


def test_04_paged_kv():
    out = run("04_paged_kv.py")
    bm = BlockManager(8, 4)
    assert f"allocate('A', 10) -> new blocks {bm.allocate('A', 10)}" in out
    assert f"allocate('B', 5)  -> new blocks {bm.allocate('B', 5)}" in out
    for n in (11, 12, 13):
        assert f"allocate('A', {n}) -> new blocks {bm.allocate('A', n)}" in out
    bm.free("B")
    assert f"allocate('C', 7)  -> new blocks {bm.allocate('C', 7)}" in out
    assert f"can_allocate('D', 16) = {bm.can_allocate('D', 16)}" in out
    table = bm.block_table("A")
    assert value(out, r"positions 0..12: (\[[^\]]*\])") == [table[p // 4] * 4 + p % 4 for p in range(13)]
    assert value(out, r"contiguous rows\): (\d+)") == 3 * (8 + 120)
    assert value(out, r"at each request's end: (\d+)") == 16 * sum(-(-n // 16) for n in (18, 38, 128))


def test_05_step_loop():
    out = run("05_step_loop.py")
    assert value(out, r"agree token for token: (\w+)") is True
    assert "free slots 2, free blocks 64 of 64" in out
    steps = re.findall(r"step +(\d+) \| plan (.*?) +\| +(\d+) tokens \| slots (\{.*?\})", out)
    assert len(steps) == value(out, r"steps: (\d+)")
    finished_r0 = next(int(s) for s, _, _, held in steps if "r0" not in ast.literal_eval(held).values())
    first_r2 = next(int(s) for s, plan, _, _ in steps if "r2:" in plan)
    assert first_r2 == finished_r0 + 1                   # r0's slot is refilled at the very next step
    for _, plan, n, _ in steps:
        assert sum(int(row.split(":")[1].split("@")[0]) for row in plan.split()) == int(n) <= 64
    if "tiny random model instead" not in out:
        assert "r0: 'The capital of France is' -> ' Paris" in out


def test_06_chunked_prefill():
    out, mod = run("06_chunked_prefill.py"), module("06_chunked_prefill.py")
    lengths = [(p, o) for _, p, o in mod.REQUESTS]
    cfg = dict(max_num_seqs=4, block_size=4, num_blocks=64)
    _, chunked, _ = drive(SchedulerConfig(max_num_batched_tokens=mod.BUDGET, **cfg), lengths, mod.ARRIVALS)
    _, full, _ = drive(SchedulerConfig(max_num_batched_tokens=64, **cfg), lengths, mod.ARRIVALS)
    chunks = [(p.step, s.start_pos, s.num_tokens) for p in chunked for s in p.seqs
              if s.request_id == "r2" and s.start_pos < mod.REQUESTS[2][1]]
    assert value(out, r"\(step, first position, tokens\): (\[.*\])") == chunks
    assert value(out, r"max tokens in one step: chunked (\d+)") == max(p.num_batched_tokens for p in chunked)
    assert value(out, r"unchunked (\d+)\n") == max(p.num_batched_tokens for p in full) == 22
    assert value(out, r"every step of C's prefill: (\w+)") is True
    assert value(out, r"identical tokens: (\w+)") is True


def test_07_preemption():
    out, mod = run("07_preemption.py"), module("07_preemption.py")
    lengths = [(p, o) for _, p, o in mod.REQUESTS]
    for mode in ("recompute", "swap"):
        sched, plans, _ = drive(mod.config(mode), lengths)
        st = sched.stats
        assert (f"{mode}: {st.num_steps} steps, {st.num_preemptions} preemption(s), {st.num_recomputes} "
                f"recompute, {st.num_swaps} swap-out, {st.num_swap_ins} swap-in, "
                f"{st.num_recomputed_tokens} computed tokens thrown away") in out
        assert st.num_preemptions >= 1
        step = next(p for p in plans if p.preempted)
        victims = [mod.REQUESTS[int(r[1:])][0] for r in step.preempted]      # r2 -> "C"
        assert f"step {step.step}: preempted {victims}, swap_out copies (device, host) " \
               f"{list(step.swap_out)}" in out
    assert "device block tables: {'A': [0, 3], 'B': [1, 4], 'C': [2, 5]}   free blocks: []" in out
    assert "host block tables:   {'C': [0, 1]}" in out
    assert value(out, r"agree token for token: (\w+)") is True


def test_08_tensor_parallel_consistency():
    out, mod = run("08_tensor_parallel_consistency.py"), module("08_tensor_parallel_consistency.py")
    lengths = [(p, o) for _, p, o in mod.REQUESTS]

    def first_disagreement(a: int, b: int):
        ranks = [Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, block_size=4,
                                           num_blocks=n, enable_prefix_caching=False)) for n in (a, b)]
        for r in ranks:
            for i, (p, o) in enumerate(lengths):
                r.add(Sequence(f"r{i}", prompt(p, i), SamplingParams(max_tokens=o, ignore_eos=True)))
            r.close_arrivals()
        step = 0
        while ranks[0].has_unfinished():
            plans = [r.schedule() for r in ranks]
            fps = [tuple((s.slot_id, s.start_pos, s.num_tokens, s.block_table) for s in p.seqs)
                   for p in plans]
            if fps[0] != fps[1]:
                return step
            for r, p in zip(ranks, plans, strict=True):
                r.update(p, {s.request_id: 7 for s in p.seqs if s.sample}, 0.0)
            step += 1
        return None

    assert first_disagreement(32, 32) is None
    assert value(out, r"two identical ranks: (\d+) steps") == drive(
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, block_size=4, num_blocks=32,
                        enable_prefix_caching=False), lengths)[0].stats.num_steps
    diverged = value(out, r"ranks with 9 and 8 KV blocks first disagree at step (\d+)")
    assert diverged == first_disagreement(9, 8)
    assert "DistributedError: step" in out
    # section 3: the real minicb.distributed with 2 processes
    steps = value(out, r"two identical ranks: (\d+) steps")
    assert value(out, r"2 ranks: (\d+) plans sent and checked") == steps       # one plan per step
    assert value(out, r"tensor-parallel tokens equal to a single process: (\w+)") is True
    assert "the ranks hold different plans for plan 3" in out                 # Fault(rank=1, at=3)


def test_09_benchmark():
    out, mod = run("09_benchmark.py"), module("09_benchmark.py")
    from minicb.config import TINY_MODEL
    from minicb.measure.trace import make_workload

    wl = make_workload(mod.NUM_REQUESTS, mod.SEED, TINY_MODEL.vocab_size, mod.PROMPT_LEN, mod.OUTPUT_LEN,
                       mod.ARRIVAL_GAP)
    lengths = list(zip(wl.prompts, wl.max_tokens, strict=True))
    runs = (("static", "static", 128), ("dynamic", "dynamic", 128), ("continuous", "continuous", 128),
            ("chunked", "continuous", mod.CHUNKED_BUDGET))
    for name, policy, budget in runs:
        cfg = SchedulerConfig(max_num_seqs=mod.SLOTS, max_num_batched_tokens=budget, block_size=8,
                              num_blocks=256, policy=policy)
        sched, plans, finish = drive(cfg, lengths, list(wl.arrivals))
        st = sched.stats
        waste = st.num_padding_tokens / (st.num_padding_tokens + st.num_batched_tokens)
        assert (f"{name}: padding waste = {st.num_padding_tokens} padding / ({st.num_padding_tokens} + "
                f"{st.num_batched_tokens} real tokens) = {100 * waste:.2f}%") in out
        row = re.search(rf"^{name} +(\d+) +([\d.]+) ", out, re.M)
        assert int(row.group(1)) == st.num_steps
        # throughput in the cost model: generated tokens / (last finish - first arrival)
        ends, t = [], 0.0
        for p in plans:
            t += mod.step_cost(p)
            ends.append(t)
        starts = [0.0] + ends[:-1]
        duration = max(ends[s] for s in finish.values()) - starts[0]
        assert float(row.group(2)) == pytest.approx(sum(wl.max_tokens) / duration, abs=0.006)
    assert value(out, r"identical tokens: (\w+)") is True
    assert value(out, r"P99 ITL and throughput: (\w+)") is True               # minicb.measure.metrics agrees
