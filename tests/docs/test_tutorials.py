"""Every chapter runs cell by cell, as its page shows it (``tutorials/_cells.py``); its page shows the
output of the current script; and the facts it prints are true: each number is recomputed here
independently, from the scheduler driven step by step with a fake model, the block manager, or plain
arithmetic. Every exercise's flags are run as well: the page states the answer the run gives, and that
answer is checked the same way (``EXERCISE_CHECKS``).

Chapter 11 (serving) has its own test file, tests/docs/test_tutorial_11_serving.py."""

from __future__ import annotations

import ast
import functools
import math
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from drain import drain
from minicb.core.block_manager import ROOT_HASH, BlockManager, hash_block
from minicb.core.config import TINY_MODEL, SchedulerConfig
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import Sequence
from minicb.measure.trace import make_workload
from minicb.simulate.simulator import preset

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
TUTORIALS, PAGES = ROOT / "tutorials", ROOT / "docs" / "tutorials"
CHAPTERS = sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py"))
MINE = [c for c in CHAPTERS if c[:2] != "11"]      # 11 is tested in tests/docs/test_tutorial_11_serving.py

sys.path.insert(0, str(TUTORIALS))
import _cells  # noqa: E402

sys.path.remove(str(TUTORIALS))


def run(name: str, flags: str = "") -> _cells.ChapterRun:
    """Run a chapter (cell by cell, in a fresh interpreter) with ``flags``; it must exit 0. Once per
    (chapter, flags) in a session, whichever way the flags were passed."""
    return _run(name, flags)


@functools.cache                  # keyed on its arguments as given: run() passes both, always
def _run(name: str, flags: str) -> _cells.ChapterRun:
    return _cells.run(TUTORIALS / name, tuple(shlex.split(flags)), timeout=300)


def out(name: str, flags: str = "") -> str:
    return run(name, flags).stdout


def const(name: str) -> dict:
    return run(name).constants


def value(text: str, pattern: str):
    """The first group of ``pattern`` in ``text``, parsed as a Python literal when it is one."""
    m = re.search(pattern, text, re.M)
    assert m, f"the tutorial no longer prints {pattern!r}"
    try:
        return ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return m.group(1)


def prompt(length: int, k: int) -> list[int]:
    """The tutorials' prompt ids (``_common.prompt_ids``), so prefix caching sees the same prefixes."""
    return [4 + (k * 7 + i * 13) % 60 for i in range(length)]


class Drive:
    """The scheduler with a fake model, stepped here by hand: requests ``r0, r1, ...`` of
    (prompt length or token ids, tokens to generate), request k added before step ``arrivals[k]``.
    Keeps every plan, the state before each step's schedule() and right after it, and each request's
    finish step and Sequence."""

    def __init__(self, config: SchedulerConfig, lengths, arrivals=None, ids=None) -> None:
        self.sched = sched = Scheduler(config)
        arrivals = arrivals or [0] * len(lengths)
        self.plans, self.finish, self.seqs, self.before, self.after = [], {}, {}, [], []
        drain(sched, lambda sched: self._step(lengths, arrivals, ids),
              more=lambda: len(self.seqs) < len(lengths))
        self.stats = sched.stats

    def _step(self, lengths, arrivals, ids) -> list:
        sched, step = self.sched, len(self.plans)
        for k in range(len(self.seqs), len(lengths)):
            if arrivals[k] > step:
                break
            p, o = lengths[k]
            tokens = list(ids[k]) if ids else prompt(p, k) if isinstance(p, int) else list(p)
            seq = Sequence(f"r{k}", tokens, SamplingParams(max_tokens=o, ignore_eos=True))
            sched.add(seq)
            self.seqs[seq.request_id] = seq
        if len(self.seqs) == len(lengths):
            sched.close_arrivals()
        self.before.append(sched.snapshot())
        plan = sched.schedule()
        self.after.append(sched.snapshot())
        self.plans.append(plan)
        done = sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample}, 0.0)
        for seq in done:
            self.finish[seq.request_id] = step
        return done


def tables(state) -> str:
    """A snapshot's block tables and free list, as chapter 07 prints them."""
    return f"device tables { {r: list(t) for r, t in state.block_tables} }  free {list(state.free_blocks)}"


# --- every chapter, its page, its exercises -----------------------------------------------------------
def test_every_chapter_is_tested():
    here = {int(n[5:7]) for n in globals() if re.match(r"test_\d\d_", n)}
    elsewhere = {int(p.name[14:16]) for p in (ROOT / "tests").rglob("test_tutorial_[0-9][0-9]_*.py")}
    assert here | elsewhere == {int(c[:2]) for c in CHAPTERS}
    checked = {(c[:2], flags) for c in MINE for flags in declared_exercises(c)}
    assert checked == set(EXERCISE_CHECKS), "every exercise of chapters 01-10 has a check"


def page_parts(name: str) -> tuple[list[str], list[list[str]]]:
    """(the output blocks before "Try it", the answer block of each exercise) of a chapter's page."""
    page = (PAGES / name.replace(".py", ".md")).read_text()
    body, _, tried = page.partition("\n## Try it\n")
    outputs = re.findall(r"^```text\n(.*?)\n```$", body, re.S | re.M)
    answers = [re.sub(r"^    ", "", a, flags=re.M).split("\n")
               for a in re.findall(r"^    ```text\n(.*?)\n    ```$", tried, re.S | re.M)]
    return outputs, answers


def masked(text: str, measured: str | None) -> str:
    """``text`` with every number of the lines ``measured`` matches replaced by ``#`` (and their runs of
    spaces by one, since a number's width moves its neighbours): a chapter's ``MEASURED`` lines hold
    wall-clock times of the machine that ran it, which a rerun cannot repeat. The words stay."""
    if not measured:
        return text
    return "\n".join(re.sub(r" +", " ", re.sub(r"\d+(\.\d+)?", "#", line)) if re.search(measured, line)
                     else line for line in text.split("\n"))


@pytest.mark.parametrize("name", MINE)
def test_the_page_shows_the_current_output(name):
    outputs, _ = page_parts(name)
    measured = const(name).get("MEASURED")
    # load-independent: the numbers of measured lines are masked
    assert [masked(o, measured) for o in outputs] == \
        [masked(o.rstrip("\n"), measured) for o in run(name).outputs if o.strip()], \
        f"{name}: regenerate its page: python docs/gen_pages.py --only tutorials --tutorial {name[:2]}"


def test_masking_keeps_what_is_not_measured():
    pattern = r"^measured: "
    assert masked("measured: 12.5 ms\nrows: 12", pattern) == "measured: # ms\nrows: 12"
    assert masked("measured:  9.5 ms", pattern) == masked("measured: 112.5 ms", pattern)
    assert masked("measured: 12.5 ms", pattern) != masked("measured: 12.5 s", pattern)


def declared_exercises(name: str) -> list[str]:
    """The flags of a chapter's exercises, read from its source (``Exercise(flags, ...)`` calls)."""
    cell = next(c for c in _cells.split((TUTORIALS / name).read_text()) if c.is_exercises)
    return [ast.literal_eval(call.args[0]) for call in ast.walk(ast.parse(cell.text))
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Exercise"]


@pytest.mark.parametrize("name, flags", [(c, f) for c in MINE for f in declared_exercises(c)])
def test_exercise_answers(name, flags):
    """The page states the answer the run with the exercise's flags gives, and it is true."""
    exercises = const(name)["EXERCISES"]
    k = [ex["flags"] for ex in exercises].index(flags)
    text = out(name, flags)
    lines = [line for line in text.splitlines() if re.search(exercises[k]["answer"], line)]
    assert lines, f"{name} {flags}: no line matches {exercises[k]['answer']!r}"
    assert page_parts(name)[1][k] == lines, f"{name}: the page's answer to {flags} is stale"
    EXERCISE_CHECKS[(name[:2], flags)]("\n".join(lines), text)


@pytest.mark.parametrize("name", ["03_slot_table.py", "08_tensor_parallel_consistency.py"])
def test_a_chapter_runs_as_a_plain_script(name):
    """``python tutorials/NN.py`` prints what the cells print (08: tensor-parallel ranks started from a
    script with no main() guard)."""
    proc = subprocess.run([sys.executable, str(TUTORIALS / name)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == out(name)


# --- 00 --------------------------------------------------------------------------------------------------
SMOLLM2_SHAPE = dict(layers=30, hidden=576, inter=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def smollm2_decode_rows(context: int) -> dict[int, tuple[float, float, float]]:
    """batch -> (GFLOP, MiB read, FLOP/B) of a SmolLM2 decode step, from the shape alone: 2 FLOPs per
    matmul weight (the tied LM head counted) plus 4 x heads x head_dim per (query, key) pair; the bytes
    are the bfloat16 weights once plus every request's bfloat16 KV cache."""
    s = SMOLLM2_SHAPE
    h, d = s["hidden"], s["head_dim"]
    layer = h * d * (2 * s["heads"] + 2 * s["kv_heads"]) + 3 * h * s["inter"] + 2 * h
    params = s["layers"] * layer + s["vocab"] * h + h
    matmul = params - s["vocab"] * h + s["vocab"] * h
    kv = s["layers"] * 2 * s["kv_heads"] * d * 2
    rows = {}
    for b in (1, 4, 16, 64, 256):
        flops = b * (2 * matmul + 4 * s["layers"] * s["heads"] * d * context)
        moved = 2 * params + b * context * kv
        rows[b] = (flops / 1e9, moved / 2**20, flops / moved)
    return rows


def check_00_context_2048(answer, text):
    rows = smollm2_decode_rows(2048)
    got = {int(line.split()[0]): float(line.split()[3]) for line in answer.splitlines()}
    assert got == {b: round(rows[b][2], 1) for b in (1, 64, 256)}
    base = smollm2_decode_rows(512)
    assert rows[256][2] / rows[1][2] < base[256][2] / base[1][2]         # "levels off" sooner


def test_00_why_batch():
    import csv

    text = out("00_why_batch.py")
    assert "float32: 30 layers x 2 x 3 kv heads x 64 x 4 B = 46,080 B a token" in text
    assert "bfloat16: 30 layers x 2 x 3 kv heads x 64 x 2 B = 23,040 B a token" in text
    assert f"{2048 * 23040 / 2**20:.0f} MiB of KV" in text
    for b, (gflop, mib, inten) in smollm2_decode_rows(512).items():
        assert re.search(rf"^ +{b} +{gflop:.2f} +{mib:.0f} +{inten:.1f}$", text, re.M), b
    assert "A100 ridge point: 153 FLOPs per byte" in text                     # 312e12 / 2.039e12
    # the A100 rows: vidur's four matmul medians of one layer at tp 1, read here with csv alone
    path = ROOT / "src/minicb/data/profiles/vidur_a100_Meta-Llama-3-70B_mlp.csv"
    ops = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
    with path.open(newline="") as f:
        ms = {int(r["num_tokens"]): sum(float(r[f"time_stats.{op}.median"]) for op in ops)
              for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "1"}
    for b in (1, 4, 16, 64):
        m = re.search(rf"^ {{0,4}}{b} +\S+ +\S+ +([\d.]+) +([\d.]+)$", text, re.M)
        assert m and float(m.group(1)) == pytest.approx(ms[b], abs=6e-4), b
        assert float(m.group(2)) == pytest.approx(ms[b] / ms[1], abs=6e-3)
    assert ms[64] / ms[1] < 1.1                                               # "about what one does"
    # the roofline rows: 70B layer shapes at tp 1, bfloat16 weights and activations
    hsz, inter, heads, kvh, d = 8192, 28672, 64, 8, 128
    shapes = [(hsz, (heads + 2 * kvh) * d), (heads * d, hsz), (hsz, 2 * inter), (inter, hsz)]
    for n in (1, 16, 64, 256, 1024, 4096):
        flops = sum(2 * n * k * m for k, m in shapes)
        moved = sum(2 * (k * m + n * (k + m)) for k, m in shapes)
        tflops = flops / (ms[n] * 1e-3) / 1e12
        assert f"{n:>5} tokens: {flops / moved:>6.1f} FLOP/B, {tflops:>5.1f} TFLOP/s" in text, n
    assert re.search(r"^measured here: \S.*, 1 torch thread$", text, re.M)       # the CPU is named
    # static batches of the filtered ShareGPT outputs, in order
    with (ROOT / "src/minicb/data/sharegpt_vllm_sosp23_opt_lengths.csv").open(newline="") as f:
        pairs = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    outs = [o for p, o in pairs if p >= 4 and o >= 4 and p + o <= 2048][:4096]
    waste = []
    for b in (1, 8, 32, 128):
        groups = [outs[i:i + b] for i in range(0, len(outs), b)]
        w = 100 * (1 - sum(outs) / sum(len(g) * max(g) for g in groups))
        waste.append(w)
        assert f"batch {b:>3}: {w:4.1f}% of decode rows are padding" in text
    assert waste == sorted(waste)                                             # "the larger, the more"


# --- 01 --------------------------------------------------------------------------------------------------
def static_and_continuous(slots: int) -> dict[str, Drive]:
    lengths = list(const("01_static_batching.py")["REQUESTS"].values())
    return {policy: Drive(SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=64, block_size=4,
                                          num_blocks=64, policy=policy), lengths)
            for policy in ("static", "continuous")}


def test_01_static_batching():
    text, requests = out("01_static_batching.py"), const("01_static_batching.py")["REQUESTS"]
    prompts = [p for p, _ in requests.values()]
    outs = [o for _, o in requests.values()]
    big, decodes = max(prompts), max(outs) - 1
    # padded batch: left padding in the prefill, then every finished row for every later step
    padded = sum(big - p for p in prompts) + sum(max(0, decodes - (o - 1)) for o in outs)
    total = len(prompts) * (big + decodes)
    assert value(text, r"token slots computed: (\d+), of which padding: \d+") == total
    assert value(text, r"token slots computed: \d+, of which padding: (\d+)") == padded
    assert value(text, r"padding waste of the static batch: ([\d.]+)%") == round(100 * padded / total, 2)
    runs = static_and_continuous(const("01_static_batching.py")["SLOTS"])
    for policy, d in runs.items():
        assert value(text, rf"^{policy}: (\d+) steps;") == d.stats.num_steps
        assert value(text, rf"{policy}: scheduler counted (\d+) padding tokens") == d.stats.num_padding_tokens
        first = {name: next(p.step for p in d.plans for s in p.seqs if s.request_id == f"r{i}")
                 for i, name in enumerate(requests)}
        assert value(text, rf"^{policy}: \d+ steps; first step of each request:\n  (\{{.*\}})") == first
    assert "slot 0  |AaaCccccDddd  |" in text                     # A's slot refilled by C at once
    assert value(text, r"^padded baseline: (\w+)") is True


def check_01_slots_4(answer, text):
    runs = static_and_continuous(4)
    assert answer == f"steps: static {runs['static'].stats.num_steps}, continuous " \
                     f"{runs['continuous'].stats.num_steps}"
    assert runs["static"].stats.num_steps == runs["continuous"].stats.num_steps       # "the same number"


def check_01_slots_1(answer, text):
    pad = static_and_continuous(1)["static"].stats.num_padding_tokens
    assert answer == f"static: scheduler counted {pad} padding tokens" and pad == 0


# --- 02 --------------------------------------------------------------------------------------------------
def packed_step(b_prompt: int, block_size: int) -> dict:
    """Chapter 02's second step, from the block manager and arithmetic: B decodes position
    ``b_prompt``, A (1 token) and C (3 tokens) prefill."""
    bm = BlockManager(64, block_size)
    bm.allocate("B", b_prompt)            # step 0: B's prefill
    bm.allocate("B", b_prompt + 1)        # step 1: B's decode, then A and C are admitted
    bm.allocate("A", 1)
    bm.allocate("C", 3)
    rows = [("B", b_prompt, 1), ("A", 0, 1), ("C", 0, 3)]

    def slot(rid: str, pos: int) -> int:
        return bm.block_table(rid)[pos // block_size] * block_size + pos % block_size

    return {"cu_q": [0, 1, 2, 5], "cu_k": [0, b_prompt + 1, b_prompt + 2, b_prompt + 5],
            "slots": [slot(r, s + j) for r, s, n in rows for j in range(n)],
            "positions": [s + j for _, s, n in rows for j in range(n)]}


def test_02_ragged_packing():
    text = out("02_ragged_packing.py")
    want = packed_step(37, 4)
    assert value(text, r"cu_seqlens_q = (\[[^\]]*\])") == want["cu_q"] == [0, 1, 2, 5]    # the note's example
    assert list(value(text, r"^positions\s+: \[([^\]]*)\]")) == want["positions"]
    assert value(text, r"cu_seqlens_k = (\[[^\]]*\])") == want["cu_k"]
    assert value(text, r"slot_mapping = (\[[^\]]*\])") == want["slots"]
    assert value(text, r"would compute (\d+) token rows") == 3 * 3
    assert value(text, r"^(\d+) of them padding") == 3 * 3 - 5
    # the mask: each query row sees keys 0..its position of its own request, nothing of the others'
    keys = [38, 1, 3]
    rows = re.findall(r"^([ABC])_(\d+) +(.*)$", text, re.M)
    assert [(r, int(p)) for r, p, _ in rows] == [("B", 37), ("A", 0), ("C", 0), ("C", 1), ("C", 2)]
    for rid, pos, cells in rows:
        segments = cells.split("|")
        for j, rid_j in enumerate("BAC"):
            seg = segments[j] if j < len(segments) else ""
            mine = "#" * (int(pos) + 1) + "." * (keys[j] - int(pos) - 1)
            assert seg.rstrip() == (mine if rid_j == rid else ""), (rid, pos, segments)
    assert value(text, r"up to float64 rounding\): (\w+)") is True


def check_02_b_prompt_40(answer, text):
    want = packed_step(40, 4)
    assert answer.splitlines() == [f"cu_seqlens_q = {want['cu_q']}",
                                   f"cu_seqlens_k = {want['cu_k']}   (cached keys + new ones)"]


def check_02_block_size_8(answer, text):
    want = packed_step(37, 8)["slots"]
    assert answer == f"slot_mapping = {want}"
    assert want[1:] == [5 * 8, 6 * 8, 6 * 8 + 1, 6 * 8 + 2]          # the "why": blocks 5 and 6


# --- 03 --------------------------------------------------------------------------------------------------
def slot_run(slots: int) -> tuple[Drive, dict]:
    requests = const("03_slot_table.py")["REQUESTS"]
    d = Drive(SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=64, block_size=4, num_blocks=32),
              [(p, o) for _, p, o in requests])
    names = {f"r{i}": r for i, (r, _, _) in enumerate(requests)}
    return d, {names[k]: v for k, v in d.finish.items()}


def test_03_slot_table():
    text = out("03_slot_table.py")
    assert "assign('D') -> 1" in text and "assign('E') -> 3" in text     # the lowest free slot
    assert "assign('F') raises InvalidArgument: no free slot" in text
    d, finish = slot_run(const("03_slot_table.py")["SLOTS"])
    assert value(text, r"finish step of each request: (\{[^}]*\})") == finish
    assert value(text, r"total steps: (\d+)") == d.stats.num_steps
    names = {f"r{i}": r for i, (r, _, _) in enumerate(const("03_slot_table.py")["REQUESTS"])}
    for plan, state in zip(d.plans, d.after, strict=True):
        admitted = [s.request_id for s in plan.seqs if s.start_pos == 0]
        line = re.search(rf"^step +{plan.step} +(.*)$", text, re.M).group(1)
        assert f"waiting {len(state.waiting)}" in line
        assert f"admitted {[names[r] for r in admitted]}" in line


def check_03_slots_2(answer, text):
    d, finish = slot_run(2)
    assert answer.splitlines() == [f"finish step of each request: {finish}",
                                   f"total steps: {d.stats.num_steps}"]


def check_03_slots_6(answer, text):
    d, _ = slot_run(6)
    assert answer == f"total steps: {d.stats.num_steps}"
    assert d.stats.num_steps == max(o for _, _, o in const("03_slot_table.py")["REQUESTS"])   # B's 6


# --- 04 --------------------------------------------------------------------------------------------------
def grow_a(block_size: int) -> list[int]:
    bm = BlockManager(32 // block_size, block_size)
    bm.allocate("A", 10)
    bm.allocate("B", 5)
    for n in (11, 12, 13):
        bm.allocate("A", n)
    return bm.block_table("A")


def test_04_paged_kv():
    text = out("04_paged_kv.py")
    bm = BlockManager(8, 4)
    assert f"allocate('A', 10) -> new blocks {bm.allocate('A', 10)}" in text
    assert f"allocate('B', 5)  -> new blocks {bm.allocate('B', 5)}" in text
    for n in (11, 12, 13):
        assert f"allocate('A', {n}) -> new blocks {bm.allocate('A', n)}" in text
    bm.free("B")
    assert f"allocate('C', 7)  -> new blocks {bm.allocate('C', 7)}" in text
    assert f"can_allocate('D', 16) = {bm.can_allocate('D', 16)}" in text
    table = bm.block_table("A")
    assert value(text, r"positions 0..12: (\[[^\]]*\])") == [table[p // 4] * 4 + p % 4 for p in range(13)]
    for i, block in enumerate(table):
        assert re.search(rf"^  {i} -> {block}: positions", text, re.M)
    assert value(text, r"contiguous rows\): (\d+)") == 3 * (8 + 120)
    assert value(text, r"paged, block_size 16, at each request's end: (\d+)") == \
        16 * sum(math.ceil(n / 16) for n in (18, 38, 128))


def check_04_block_size_2(answer, text):
    table = grow_a(2)
    mapping = [table[p // 2] * 2 + p % 2 for p in range(13)]
    assert answer.splitlines() == [f"A holds {len(table)} blocks for 13 tokens: at most one partly filled",
                                   f"A's slot_mapping for positions 0..12: {mapping}"]
    assert mapping[12] == table[-1] * 2                          # the first slot of A's last block


def check_04_page_64(answer, text):
    paged = 64 * sum(math.ceil(n / 64) for n in (18, 38, 128))
    less = round(100 * (1 - paged / (3 * 128)))
    assert answer == f"paged, block_size 64, at each request's end: {paged} positions ({less}% less)"
    assert less < round(100 * (1 - 208 / 384))                    # "less" than with pages of 16


# --- 05 --------------------------------------------------------------------------------------------------
def loop_lengths(text: str) -> list[tuple[int, int]]:
    """(prompt tokens, tokens generated) of chapter 05's requests, as its run reports them."""
    prompts = value(text, r"prompt lengths in tokens: (\[[^\]]*\])")
    made = value(text, r"tokens generated: (\{[^}]*\})")
    return [(p, made[f"r{i}"]) for i, p in enumerate(prompts)]


def loop_drive(text: str, slots: int = 2, budget: int = 64) -> Drive:
    return Drive(SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=budget, block_size=4,
                                 num_blocks=64, enable_prefix_caching=False), loop_lengths(text))


def plan_line(plan) -> str:
    rows = " ".join(f"{s.request_id}:{s.num_tokens}@{s.start_pos}" for s in plan.seqs)
    n = plan.num_batched_tokens
    return f"step {plan.step:2d}  plan {rows}  ({n} token{'s' * (n != 1)})"


def test_05_step_loop():
    text = out("05_step_loop.py")
    assert value(text, r"agree token for token: (\w+)") is True
    assert "free slots 2, free blocks 64 of 64" in text
    d = loop_drive(text)
    assert [line for line in text.splitlines() if line.startswith("step ")] == [plan_line(p) for p in d.plans]
    assert value(text, r"^steps: (\d+)") == d.stats.num_steps
    held = [ast.literal_eval(m) for m in re.findall(r"^ +slots (\{.*?\})  free", text, re.M)]
    finished_r0 = next(i for i, h in enumerate(held) if "r0" not in h.values())
    first_r2 = next(p.step for p in d.plans if any(s.request_id == "r2" for s in p.seqs))
    assert first_r2 == finished_r0 + 1                   # r0's slot is refilled at the very next step
    if "the tiny model" not in text:
        assert "r0: 'The capital of France is' -> ' Paris" in text


def check_05_slots_3(answer, text):
    d = loop_drive(text, slots=3)
    assert answer.splitlines() == [plan_line(d.plans[0]), f"steps: {d.stats.num_steps}"]
    assert {s.request_id for s in d.plans[0].seqs} == {"r0", "r1", "r2"}      # nobody waits


def check_05_budget_8(answer, text):
    d = loop_drive(text, budget=8)
    assert answer.splitlines() == [plan_line(d.plans[0]), f"steps: {d.stats.num_steps}"]
    assert d.stats.num_steps > loop_drive(out("05_step_loop.py")).stats.num_steps     # "takes longer"


# --- 06 --------------------------------------------------------------------------------------------------
def chunk_drive(budget: int) -> tuple[Drive, list]:
    c = const("06_chunked_prefill.py")
    d = Drive(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, block_size=4, num_blocks=64),
              [(p, o) for _, p, o in c["REQUESTS"]], c["ARRIVALS"])
    chunks = [(p.step, s.start_pos, s.num_tokens) for p in d.plans for s in p.seqs
              if s.request_id == "r2" and s.start_pos < c["REQUESTS"][2][1]]
    return d, chunks


def chunk_lines(budget: int) -> list[str]:
    d, chunks = chunk_drive(budget)
    full, _ = chunk_drive(64)
    first_full = next(p.step for p in full.plans for s in p.seqs if s.request_id == "r2")
    return [f"C's prompt went in {len(chunks)} chunks (step, first position, tokens):",
            f"C's first token came at step: chunked {chunks[-1][0]}, unchunked {first_full}"]


def test_06_chunked_prefill():
    text, budget = out("06_chunked_prefill.py"), const("06_chunked_prefill.py")["BUDGET"]
    d, chunks = chunk_drive(budget)
    full, _ = chunk_drive(64)
    listed = [ast.literal_eval(t) for t in re.findall(r"\(\d+, \d+, \d+\)", text.split("chunks (step")[1]
                                                      .split("max tokens")[0])]
    assert listed == chunks
    assert value(text, r"max tokens in one step: chunked (\d+)") == max(p.num_batched_tokens for p in d.plans)
    assert value(text, r"unchunked (\d+)\n") == max(p.num_batched_tokens for p in full.plans) == 22
    # every request running when a prefill chunk of C is planned gets its token in that step
    for plan, state in zip(d.plans, d.after, strict=True):
        if any(s.request_id == "r2" and s.start_pos < 20 for s in plan.seqs):
            assert set(state.running) <= {s.request_id for s in plan.seqs}
    assert value(text, r"every step of C's prefill: (\w+)") is True
    assert [line for line in text.splitlines() if re.match(r"C's (prompt went|first token)", line)] == \
        chunk_lines(budget)
    # bottom-right versus top-left masks of C's second chunk
    start, n = next((s, k) for _, s, k in chunks if s > 0)
    assert value(text, r"C's chunk at positions (\d+)\.\.") == start
    rows = re.findall(r"^  q(\d+) +([#.]+) +([#.]+)$", text, re.M)
    assert [int(q) for q, _, _ in rows] == list(range(start, start + n))
    for i, (_, top_left, bottom_right) in enumerate(rows):
        assert top_left == "#" * (i + 1) + "." * (start + n - i - 1)
        assert bottom_right == "#" * (start + i + 1) + "." * (n - i - 1)
    assert value(text, r"is_causal=True - reference\|: +([\d.]+)") > 0.1          # top-left is wrong
    assert value(text, r"causal_lower_right - reference\|: +([\d.e+-]+)") == 0.0
    assert value(text, r"identical tokens: (\w+)") is True


def last_chunk_step(d: Drive) -> int:
    """The step of C's (r2's) last prompt chunk: the one that samples its first token."""
    return next(p.step for p in d.plans for s in p.seqs
                if s.request_id == "r2" and s.start_pos + s.num_tokens == 20)


def test_06_stall_free_section():
    text, c = out("06_chunked_prefill.py"), const("06_chunked_prefill.py")
    d = Drive(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=c["BUDGET"], block_size=4, num_blocks=64,
                              max_prefill_tokens_while_decoding=c["STALL_CAP"]),
              [(p, o) for _, p, o in c["REQUESTS"]], c["ARRIVALS"])
    stall = text.split("stall-free: max_num_batched_tokens")[1]
    shown = [int(t) for t in re.findall(r"^  step +\d+ \|.*\| +(\d+) tokens$", stall, re.M)]
    assert shown == [p.num_batched_tokens for p in d.plans][:len(shown)] and len(shown) == 14
    # beside a or b, C gets at most the cap; once both have ended, the whole budget
    beside = [sum(s.num_tokens for s in p.seqs if s.request_id == "r2") for p in d.plans
              if {"r0", "r1"} & {s.request_id for s in p.seqs}]
    assert max(beside) == c["STALL_CAP"] == value(text, r"a step with decodes: at most (\d+)")
    first = last_chunk_step(d)
    assert value(text, r"stall-free: C's first token at step (\d+)") == first
    alone = [p.num_batched_tokens for p in d.plans if {s.request_id for s in p.seqs} == {"r2"}]
    assert alone[0] == c["BUDGET"]
    # the cost-model replay, derived by hand: a decode step is a + b; with the cap off the step that
    # carries the 2,000-token prompt is a + 2001 b; with cap C + 4 a sequence held, beside the one stream
    # (two sequences held: the stream and the prompt) every such step carries k = C + 8 prompt tokens,
    # a + (1 + k) b, and the prompt takes ceil(2000 / k) of them, the last with the remainder
    a, b = c["A_MS"], c["B_MS"]
    rows = {m[0]: m[1:] for m in re.findall(
        r"^cap +([\w+]+): stream gap median +(\d+) ms, largest +(\d+) ms \( *([\d.]+)x\); "
        r"TTFT +([\d.]+) s$",
        text, re.M)}
    assert set(rows) == {"off", "4+4", "12+4", "28+4"}
    for name, (med, worst, ratio, ttft) in rows.items():
        k = 2000 if name == "off" else int(name.split("+")[0]) + 8
        n, last = -(-2000 // k), 2000 - (-(-2000 // k) - 1) * k
        assert int(med) == round(a + b) and int(worst) == round(a + (1 + k) * b)
        assert float(ratio) == round((a + (1 + k) * b) / (a + b), 1)
        # load-independent: the chapter's TTFT is the cost model's replay (fixed a and b), not a clock
        assert float(ttft) == round(((n - 1) * (a + (1 + k) * b) + a + (1 + last) * b) / 1000, 1)
    # at saturation a fixed cap trickles the prompts in over many more steps; the share per sequence
    # held brings a burst in nearly as fast as no cap
    sat = {m[0]: (int(m[1]), float(m[2])) for m in re.findall(
        r"^saturation, cap +([\w+]+): (\d+) steps, +([\d.]+) s", text, re.M)}
    assert set(sat) == {"off", "4+0", "4+4"}
    assert sat["4+0"][0] > 2 * sat["4+4"][0] and sat["4+4"][0] >= sat["off"][0]
    assert sat["off"][1] <= sat["4+4"][1] < sat["4+0"][1]


def check_06_budget_4(answer, text):
    assert answer.splitlines() == chunk_lines(4)
    _, chunks = chunk_drive(4)
    assert {k for _, _, k in chunks} == {2}                        # two-token chunks


def check_06_budget_16(answer, text):
    assert answer.splitlines() == chunk_lines(16)
    assert len(chunk_drive(16)[1]) == 2


# --- 07 --------------------------------------------------------------------------------------------------
def preempt_config(mode: str, caching: bool = False, **changes) -> SchedulerConfig:
    fields = dict(max_num_seqs=3, max_num_batched_tokens=64, block_size=4,
                  num_blocks=const("07_preemption.py")["NUM_BLOCKS"], preemption_mode=mode,
                  num_host_blocks=8 if mode == "swap" else 0, enable_prefix_caching=caching)
    return SchedulerConfig(**{**fields, **changes})


def preempt_drive(mode: str, caching: bool = False, **changes) -> Drive:
    requests = const("07_preemption.py")["REQUESTS"]
    return Drive(preempt_config(mode, caching, **changes), [(p, o) for _, p, o in requests])


def preempt_lines(name: str, d: Drive) -> list[str]:
    st = d.stats
    lines = [f"{name}: {st.num_steps} steps; preemptions {st.num_preemptions} (recompute "
             f"{st.num_recomputes}, swap {st.num_swaps}); swap-ins {st.num_swap_ins}",
             f"{name}: tokens computed in all {st.num_batched_tokens}, computed tokens thrown away "
             f"{st.num_recomputed_tokens}"]
    if name.endswith("cache"):
        lines.append(f"{name}: tokens a victim found cached again {st.num_cached_reprefill_tokens}")
    return lines


def test_07_preemption():
    text = out("07_preemption.py")
    names = {f"r{i}": r for i, (r, _, _) in enumerate(const("07_preemption.py")["REQUESTS"])}
    for name, mode, caching in (("recompute", "recompute", False), ("swap", "swap", False),
                                ("recompute + cache", "recompute", True)):
        d = preempt_drive(mode, caching)
        cell = next(o for o in run("07_preemption.py").outputs
                    if re.search(rf"^{re.escape(name)}: tokens computed", o, re.M))
        assert preempt_lines(name, d) == [line for line in cell.splitlines() if line.startswith(name + ":")]
        assert d.stats.num_preemptions >= 1
        for plan in d.plans:                 # the tables before and after each preemption and swap-in
            if not (plan.preempted or plan.swap_in):
                continue
            head = (f"step {plan.step}: preempted {[names[r] for r in plan.preempted]}, copies out "
                    f"{list(plan.swap_out)}, in {list(plan.swap_in)}\n")
            before, after = cell.split(head, 1)[1].split("this step computes")[0].split("after (")
            assert f"    {renamed(tables(d.before[plan.step]), names)}\n" in before, (name, plan.step)
            assert f"    {renamed(tables(d.after[plan.step]), names)}\n" in after, (name, plan.step)
        if mode == "recompute":              # the victim's re-admission
            out_ = next(p for p in d.plans if p.preempted)
            back, s = next((p, s) for p in d.plans[out_.step + 1:] for s in p.seqs if s.request_id == "r2")
            assert (f"step {back.step}: C is admitted again: {s.start_pos} tokens found cached, "
                    f"{s.num_tokens} re-prefilled") in cell
    # the cost table and the costs of C's way back, recomputed with the cost models
    S, costs = const("07_preemption.py")["S"], {"CPU": preset("smollm2-135m"), "A100": preset("llama-3-8b")}
    big = [(4 * S, 8 * S)] * 3
    need = 3 * math.ceil(12 * S / 16)
    kw = dict(block_size=16, max_num_batched_tokens=1024, num_host_blocks=need)
    runs = {"enough memory": Drive(preempt_config("recompute", num_blocks=need, **kw), big),
            "recompute": Drive(preempt_config("recompute", num_blocks=need * 7 // 9, **kw), big),
            "swap": Drive(preempt_config("swap", num_blocks=need * 7 // 9, **kw), big),
            "recompute + cache": Drive(preempt_config("recompute", True, num_blocks=need * 7 // 9, **kw),
                                       big)}
    base = None
    extra = {}
    for name, d in runs.items():
        cpu = sum(costs["CPU"].step_time(p) for p in d.plans)
        gpu = 1e3 * sum(costs["A100"].step_time(p) for p in d.plans)
        base = base or (cpu, gpu)
        row = re.search(rf"^{re.escape(name)} +(\d+) +(\d+) +([\d.]+) +([+-][\d.]+) +([\d.]+) +([+-][\d.]+)$",
                        text, re.M)
        assert row, name
        assert (int(row.group(1)), int(row.group(2))) == (d.stats.num_steps, d.stats.num_batched_tokens)
        assert float(row.group(3)) == pytest.approx(cpu, abs=0.006)
        assert float(row.group(5)) == pytest.approx(gpu, abs=0.06)
        if name != "enough memory":
            out_ = next(p for p in d.plans if p.preempted)
            back = next(p for p in d.plans
                        if p.step > out_.step and any(s.request_id == "r2" for s in p.seqs))
            extra[name] = {k: 1e3 * (m.breakdown(out_)["swap"] + m.step_time(back)
                                     - m.step_time(d.plans[back.step + 1])) for k, m in costs.items()}
            way = re.search(rf"^{re.escape(name)} +{out_.step}, {back.step} .*?([+-][\d.]+) +([+-][\d.]+)$",
                            text, re.M)
            assert way, name
            assert float(way.group(1)) == pytest.approx(extra[name]["CPU"], abs=0.06)
            assert float(way.group(2)) == pytest.approx(extra[name]["A100"], abs=0.006)
    # what the prose says of these numbers
    assert extra["recompute"]["CPU"] > 100 * extra["swap"]["CPU"]                  # CPU: swap wins by far
    assert extra["swap"]["CPU"] < 5 and extra["recompute"]["CPU"] > 100            # ~ a ms vs most of a s
    assert extra["recompute + cache"]["A100"] < extra["swap"]["A100"] < extra["recompute"]["A100"]
    assert extra["recompute"]["A100"] < 10 * extra["swap"]["A100"]                  # the same order
    assert value(text, r"agree token for token: (\w+)") is True


def renamed(line: str, names: dict) -> str:
    for rid, letter in names.items():
        line = line.replace(f"'{rid}'", f"'{letter}'")
    return line


def check_07_num_blocks_9(answer, text):
    d = {name: preempt_drive(mode, caching, num_blocks=9)
         for name, mode, caching in (("recompute", "recompute", False), ("swap", "swap", False),
                                     ("recompute + cache", "recompute", True))}
    assert answer.splitlines() == [preempt_lines(n, r)[0] for n, r in d.items()]
    assert all(r.stats.num_preemptions == 0 for r in d.values())


def check_07_num_blocks_6(answer, text):
    d = preempt_drive("recompute", True, num_blocks=6)
    assert answer == preempt_lines("recompute + cache", d)[2]
    assert d.stats.num_cached_reprefill_tokens == 0


# --- 08 --------------------------------------------------------------------------------------------------
def tp_lengths() -> list[tuple[int, int]]:
    return [(p, o) for _, p, o in const("08_tensor_parallel_consistency.py")["REQUESTS"]]


def first_disagreement(a: int, b: int):
    """Two scheduler replicas with ``a`` and ``b`` KV blocks in lockstep: the first step whose plans
    differ (slot, positions, tokens or block tables of any row), or None."""
    ranks = [Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, block_size=4,
                                       num_blocks=n, enable_prefix_caching=False)) for n in (a, b)]
    for r in ranks:
        for i, (p, o) in enumerate(tp_lengths()):
            r.add(Sequence(f"r{i}", prompt(p, i), SamplingParams(max_tokens=o, ignore_eos=True)))
        r.close_arrivals()
    step = 0
    while ranks[0].has_unfinished():
        plans = [r.schedule() for r in ranks]
        rows = [tuple((s.slot_id, s.start_pos, s.num_tokens, s.block_table) for s in p.seqs) for p in plans]
        if rows[0] != rows[1]:
            return step
        for r, p in zip(ranks, plans, strict=True):
            r.update(p, {s.request_id: 5 for s in p.seqs if s.sample}, 0.0)
        step += 1
    return None


def tp_steps() -> int:
    return Drive(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, block_size=4, num_blocks=32,
                                 enable_prefix_caching=False), tp_lengths()).stats.num_steps


def test_08_tensor_parallel_consistency():
    text = out("08_tensor_parallel_consistency.py")
    blocks_1 = const("08_tensor_parallel_consistency.py")["BLOCKS_1"]
    assert first_disagreement(32, 32) is None
    steps = value(text, r"two identical ranks: (\d+) steps")
    assert steps == tp_steps()
    assert value(text, rf"ranks with 9 and {blocks_1} KV blocks first disagree at step (\d+)") == \
        first_disagreement(9, blocks_1)
    assert "DistributedError: step" in text
    # section 3: the real minicb.distributed with 2 processes
    assert value(text, r"2 ranks: (\d+) plans sent and checked") == steps        # one plan per step
    assert value(text, r"tensor-parallel tokens equal to a single process: (\w+)") is True
    assert "the ranks hold different plans for plan 3" in " ".join(text.split())  # Fault(rank=1, at=3)


def check_08_blocks_1_9(answer, text):
    assert first_disagreement(9, 9) is None
    assert answer == f"ranks with 9 and 9 KV blocks: no disagreement in {tp_steps()} steps"


def check_08_blocks_1_6(answer, text):
    step = first_disagreement(9, 6)
    assert answer == f"ranks with 9 and 6 KV blocks first disagree at step {step}"
    assert step < first_disagreement(9, 8)                                       # "earlier"


# --- 09 --------------------------------------------------------------------------------------------------
def bench_runs(gap: int) -> dict[str, tuple[Drive, list[float]]]:
    """Chapter 09's four runs, each with the start time of every step under its cost model."""
    c = const("09_benchmark.py")
    wl = make_workload(c["NUM_REQUESTS"], c["SEED"], TINY_MODEL.vocab_size, tuple(c["PROMPT_LEN"]),
                       tuple(c["OUTPUT_LEN"]), gap)
    out_ = {}
    for name, policy, budget in (("static", "static", 128), ("dynamic", "dynamic", 128),
                                 ("continuous", "continuous", 128),
                                 ("chunked", "continuous", c["CHUNKED_BUDGET"])):
        d = Drive(SchedulerConfig(max_num_seqs=c["SLOTS"], max_num_batched_tokens=budget, block_size=8,
                                  num_blocks=256, policy=policy),
                  list(zip(wl.prompts, wl.max_tokens, strict=True)), list(wl.arrivals))
        starts = [0.0]
        for p in d.plans:
            starts.append(starts[-1] + 1 + (p.num_batched_tokens + p.num_padding_tokens)
                          / c["TOKENS_PER_UNIT"])
        d.workload = wl
        out_[name] = (d, starts)
    return out_


def bench_row(d: Drive, starts: list[float]) -> dict:
    wl = d.workload
    first = {}
    for p in d.plans:
        for s in p.seqs:
            first.setdefault(s.request_id, p.step)
    queue = [starts[first[f"r{k}"]] - starts[wl.arrivals[k]] for k in range(len(wl.prompts))]
    duration = max(starts[s + 1] for s in d.finish.values()) - starts[0]
    return {"steps": d.stats.num_steps, "throughput": sum(wl.max_tokens) / duration,
            "queue": sum(queue) / len(queue)}


def table_row(text: str, name: str) -> tuple[int, float, float]:
    m = re.search(rf"^{name} +(\d+) +([\d.]+) +[\d.]+% +([\d.]+) ", text, re.M)
    assert m, name
    return int(m.group(1)), float(m.group(2)), float(m.group(3))


def test_09_benchmark():
    text = out("09_benchmark.py")
    runs = bench_runs(const("09_benchmark.py")["ARRIVAL_GAP"])
    for name, (d, starts) in runs.items():
        st = d.stats
        waste = st.num_padding_tokens / (st.num_padding_tokens + st.num_batched_tokens)
        assert (f"{name}: padding waste = {st.num_padding_tokens} / ({st.num_padding_tokens} + "
                f"{st.num_batched_tokens} real tokens) = {100 * waste:.2f}%") in text
        want = bench_row(d, starts)
        steps, throughput, queue = table_row(text, name)
        assert steps == want["steps"]
        # load-independent: simulated time (a cost model), no wall clock
        assert throughput == pytest.approx(want["throughput"], abs=0.006)
        assert queue == pytest.approx(want["queue"], abs=0.006)
        # the picture has a column for every step the table counts, idle ones included
        assert value(text, rf"^{name}: (\d+) steps in the table") == steps
        assert re.search(rf"^{name}: {steps} steps in the table\npolicy \w+: 6 slots x {steps} steps$",
                         text, re.M)
    for name in ("static", "dynamic"):
        d = runs[name][0]
        starts = [p for p in d.plans if p.seqs and all(s.start_pos == 0 for s in p.seqs)]
        assert value(text, rf"^{name}: batches at steps (\[.*\])") == [p.step for p in starts]
        sizes_line = text.split(f"{name}: batches at steps")[1].splitlines()[1]
        assert sizes_line == (f"   of sizes {[len(p.seqs) for p in starts]}; steps with nothing to run: "
                              f"{sum(1 for p in d.plans if p.is_empty)}")
    # the prose: dynamic's first batch is the one request there at step 0; static waited for a full one
    assert len(runs["dynamic"][0].plans[0].seqs) == 1
    assert runs["static"][0].plans[0].is_empty and runs["static"][0].stats.num_steps < \
        runs["dynamic"][0].stats.num_steps
    # load-independent: simulated time (a cost model), no wall clock
    assert value(text, r"delay, P99 ITL and throughput: (\w+)") is True           # metrics agree
    assert value(text, r"all four runs produced identical tokens: (\w+)") is True


def check_09_arrival_gap_0(answer, text):
    runs = bench_runs(0)
    rows = {name: bench_row(*runs[name]) for name in ("static", "dynamic")}
    assert rows["static"] == rows["dynamic"]                                  # "identical"
    header, static, dynamic = answer.splitlines()
    assert header.split()[:3] == ["policy", "steps", "through-"]
    assert static.split()[1:] == dynamic.split()[1:]
    assert table_row(answer, "static")[0] == rows["static"]["steps"]


def check_09_arrival_gap_8(answer, text):
    runs = bench_runs(8)
    rows = {name: bench_row(*runs[name]) for name in ("static", "dynamic")}
    for name in ("static", "dynamic"):
        steps, throughput, queue = table_row(answer, name)
        assert steps == rows[name]["steps"]
        # load-independent: simulated time (a cost model), no wall clock
        assert throughput == pytest.approx(rows[name]["throughput"], abs=0.006)
        assert queue == pytest.approx(rows[name]["queue"], abs=0.006)
    # load-independent: simulated time (a cost model), no wall clock
    assert rows["dynamic"]["queue"] < rows["static"]["queue"]                 # dynamic waits less
    # load-independent: simulated time (a cost model), no wall clock
    assert abs(rows["dynamic"]["throughput"] / rows["static"]["throughput"] - 1) < 0.05   # "hardly"
    first = next(p.step for p in runs["static"][0].plans if p.seqs)
    assert first == 5 * 8                                                     # "40 steps in"


# --- 10 --------------------------------------------------------------------------------------------------
def caching_drives(shared: int) -> dict[bool, Drive]:
    system = prompt(shared, 9)
    ids = [system + prompt(6, 20 + k) for k in range(8)]
    return {caching: Drive(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=4,
                                           num_blocks=16, enable_prefix_caching=caching),
                           [(len(p), 4) for p in ids], [2 * k for k in range(8)], ids)
            for caching in (False, True)}


def caching_lines(shared: int) -> list[str]:
    out_ = []
    for caching, d in caching_drives(shared).items():
        st, label = d.stats, f"caching {'on ' if caching else 'off'}"
        out_ += [f"{label}: {st.num_steps} steps, {st.num_batched_tokens} tokens computed",
                 f"{label}: prompt tokens from the cache {st.num_cached_prompt_tokens} of "
                 f"{st.num_prompt_tokens} ({100 * st.prefix_cache_hit_rate:.0f}%)"]
    return out_


def test_10_prefix_caching():
    text = out("10_prefix_caching.py")
    shared = const("10_prefix_caching.py")["SHARED"]
    system = prompt(shared, 9)
    a, b = system + prompt(5, 1), system + prompt(5, 2)
    for name, tokens in (("A", a), ("B", b)):          # the chain: each hash from its parent's
        parent = ROOT_HASH
        section = text.split(f"prompt {name}: ")[1]
        for i in range(len(tokens) // 4):
            h = hash_block(parent, tuple(tokens[4 * i:4 * i + 4]))
            assert re.search(rf"block {i} {re.escape(str(tokens[4 * i:4 * i + 4]))} +hash\(parent "
                             rf"{parent & 0xFFFFFFFF:08x}, tokens\) = {h & 0xFFFFFFFF:08x}", section)
            parent = h
    bm = BlockManager(16, 4, enable_caching=True)
    bm.allocate("A", len(a))
    bm.cache_full_blocks("A", a, len(a))
    hits = bm.computed_blocks(b)
    assert f"B: computed_blocks -> {hits}: {4 * len(hits)} of its {len(b)} tokens need no compute" in text
    bm.allocate("B", len(b), computed=hits)
    assert f"block tables: {bm.block_tables}" in text
    assert re.search(rf"block {hits[0]} {re.escape(str(a[:4]))}  ref 2 \(A,B\)", text)
    bm.cache_full_blocks("B", b, len(b))
    full = a[:len(a) // 4 * 4]
    assert f"computed_blocks -> {bm.computed_blocks(full)}" in text and len(bm.computed_blocks(full)) == \
        len(full) // 4 - 1                                                     # never the whole prompt
    tables_ = {r: bm.block_table(r) for r in ("A", "B")}
    bm.free("A")
    bm.free("B")
    lru = bm.device.cached_free_blocks()
    assert f"LRU order (evicted first on the left): {lru}" in text
    cached = set(bm.cache.blocks)
    need = bm.num_free_blocks - len(lru) + 1
    bm.allocate("C", 4 * need)
    gone = sorted(cached - set(bm.cache.blocks))
    owners = {g: "/".join(r for r, t in tables_.items() if g in t) for g in gone}
    assert f"evicted: {[f'block {g} (of {owners[g]})' for g in gone]}" in text
    assert gone == [lru[0]] and hits[0] in bm.cache.blocks                     # a leaf, not the root
    assert f"B's prompt again: computed_blocks -> {bm.computed_blocks(b)}" in text
    assert [line for line in text.splitlines() if line.startswith("caching") and "per request" not in line] \
        == caching_lines(shared)
    per_request = [s.num_cached_tokens for s in caching_drives(shared)[True].seqs.values()]
    assert value(text, r"^caching on : cached prompt tokens per request (\[.*\])") == per_request
    assert value(text, r"identical tokens with and without prefix caching: (\w+)") is True


def check_10_shared_3(answer, text):
    assert answer == caching_lines(3)[3]
    assert caching_drives(3)[True].stats.num_cached_prompt_tokens == 0


def check_10_shared_16(answer, text):
    assert answer.splitlines() == caching_lines(16)[1::2]
    cached = [s.num_cached_tokens for s in caching_drives(16)[True].seqs.values()]
    assert cached == [0] + [16] * 7                            # the four full blocks, after the first


EXERCISE_CHECKS = {
    ("00", "--context 2048"): check_00_context_2048,
    ("01", "--slots 4"): check_01_slots_4, ("01", "--slots 1"): check_01_slots_1,
    ("02", "--b-prompt 40"): check_02_b_prompt_40, ("02", "--block-size 8"): check_02_block_size_8,
    ("03", "--slots 2"): check_03_slots_2, ("03", "--slots 6"): check_03_slots_6,
    ("04", "--block-size 2"): check_04_block_size_2, ("04", "--page 64"): check_04_page_64,
    ("05", "--slots 3"): check_05_slots_3, ("05", "--budget 8"): check_05_budget_8,
    ("06", "--budget 4"): check_06_budget_4, ("06", "--budget 16"): check_06_budget_16,
    ("07", "--num-blocks 9"): check_07_num_blocks_9, ("07", "--num-blocks 6"): check_07_num_blocks_6,
    ("08", "--blocks-1 9"): check_08_blocks_1_9, ("08", "--blocks-1 6"): check_08_blocks_1_6,
    ("09", "--arrival-gap 0"): check_09_arrival_gap_0, ("09", "--arrival-gap 8"): check_09_arrival_gap_8,
    ("10", "--shared 3"): check_10_shared_3, ("10", "--shared 16"): check_10_shared_16,
}
