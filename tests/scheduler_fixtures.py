"""The scheduler's test kit, shared by tests/core and tests/engine (torch-free).

The fake model (``FakeModel``) is a pure function of the token prefix, ``next = h(all tokens) % V``,
that reads the prefix back out of a fake *paged* KV cache through the plan's block tables, after
applying the plan's swap copies. So a request's tokens only come out right if every block table,
swap copy, recompute and chunk boundary the scheduler produced was right: comparing with the request
run alone (``alone``) checks the whole bookkeeping at the scheduler level, with no torch. ``drive``
runs requests with staggered arrivals to the end; ``step`` / ``drain_scheduler`` drive a scheduler by
hand with fixed tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from drain import drain, finals
from minicb.core.config import SchedulerConfig
from minicb.core.plan import StepPlan
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import FinishReason, Sequence, SequenceStatus

VOCAB = 23
EOS = 0


# --- the fake model and its paged KV cache -----------------------------------------------------------
FNV_START = 0xCBF29CE484222325


def fnv_step(h: int, t: int) -> int:
    return ((h ^ t) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF


def next_token(tokens, salt: int = 0) -> int:
    """A pure function of the whole prefix (FNV-1a), like a greedy model; EOS comes up now and then.
    ``salt`` stands for a sampler's seed: child ``i`` of a request with ``n > 1`` draws with salt ``i``,
    so the children's tokens differ (and a child reading a sibling's K/V would come out wrong)."""
    h = FNV_START
    for t in tokens:
        h = fnv_step(h, t)
    return ((h >> 17) + salt) % VOCAB


def child_id(rid: str, index: int, n: int) -> str:
    """The sequence id of child ``index`` of request ``rid`` (the engine's rule: ``rid`` itself for n=1)."""
    return rid if n == 1 else f"{index}_{rid}"


def child_salt(rid: str) -> int:
    """The salt ``FakeModel`` samples a sequence with: its child index (``child_id``), else 0."""
    head, _, rest = rid.partition("_")
    return int(head) if rest and head.isdigit() else 0


def alone(prompt: list[int], max_tokens: int, eos: int | None = EOS, salt: int = 0) -> list[int]:
    """The tokens a request gets when it is served by itself (sampling with ``salt``)."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens, salt)
        out.append(t)
        tokens.append(t)
        if t == eos:
            break
    return out


class FakeModel:
    """A fake K/V per (block, offset), device and host pools, moved only as the plan says.

    As in a transformer, a token's K/V depends on the token *and everything before it*: the value
    stored for position p is the FNV-1a state of tokens 0..p, chained from the value the cache holds
    for position p - 1. So a block reused from the prefix cache with the right token ids but the
    wrong prefix (or at the wrong position) gives wrong tokens, as it would with a real model.
    """

    def __init__(self, config: SchedulerConfig, salt: Callable[[str], int] | None = None):
        self.bs = config.block_size
        self.device = [[None] * self.bs for _ in range(config.num_blocks)]
        self.host = [[None] * self.bs for _ in range(config.num_host_blocks)]
        self.salt = salt or child_salt

    def run(self, plan: StepPlan) -> dict[str, int]:
        # The engine's order: swap-out copies, then swap-in copies, then copy-on-write copies, then the
        # forward, then sampling.
        for d, h in plan.swap_out:
            self.host[h] = list(self.device[d])
        for h, d in plan.swap_in:
            self.device[d] = list(self.host[h])
        for src, dst in plan.copy_blocks:
            self.device[dst] = list(self.device[src])
        for s in plan.seqs:                                   # the forward writes every row's K/V ...
            assert len(s.block_table) * self.bs >= s.context_len, "block table too short"
            h = FNV_START if s.start_pos == 0 else self._read(s.block_table, s.start_pos - 1)
            assert h is not None, f"{s.request_id} reads a position nobody wrote"
            for i, t in enumerate(s.token_ids):
                pos = s.start_pos + i
                h = fnv_step(h, t)
                self.device[s.block_table[pos // self.bs]][pos % self.bs] = h
        out = {}
        for s in plan.seqs:                                   # ... then every row reads its context
            if s.sample:
                ctx = [self._read(s.block_table, p) for p in range(s.context_len)]
                assert None not in ctx, f"{s.request_id} reads a position nobody wrote"
                for rid in (s.request_id, *s.forks):       # a fork's children sample the same row
                    out[rid] = ((ctx[-1] >> 17) + self.salt(rid)) % VOCAB
        return out

    def _read(self, table, pos):
        return self.device[table[pos // self.bs]][pos % self.bs]


# --- a driver: arrivals by step, check every plan, collect the outputs ---------------------------------
@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: int = 0          # step at which the request is added
    priority: int = 0
    ignore_eos: bool = False
    n: int = 1                # parallel sampling: children child_id(rid, i, n), child i with salt i


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, FinishReason] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    seqs: dict[str, Sequence] = field(default_factory=dict)
    scheduler: Scheduler | None = None


def make_seq(r: Req) -> Sequence:
    params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
    return Sequence(r.rid, list(r.prompt), params, priority=r.priority, eos_token_id=EOS)


def make_group(r: Req) -> list[Sequence]:
    """The ``r.n`` sequences of a request (one for n=1), as the engine makes them."""
    params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
    return [Sequence(child_id(r.rid, i, r.n), list(r.prompt), params, priority=r.priority,
                     eos_token_id=EOS, index=i) for i in range(r.n)]


def check_plan(sched: Scheduler, plan: StepPlan) -> None:
    c = sched.config
    assert len(plan.seqs) <= c.max_num_seqs and len(plan.padding) <= c.max_num_seqs
    assert plan.step == sched.stats.num_steps - 1
    if c.policy == "continuous":
        assert plan.num_batched_tokens <= c.max_num_batched_tokens
        assert not plan.padding
        assert not (plan.swap_in and plan.swap_out), "a step never swaps both ways"
    else:
        assert not plan.preempted and not plan.swap_in and not plan.swap_out
        assert 0 not in plan.padding
    slots = [s.slot_id for s in plan.seqs]
    assert len(set(slots)) == len(slots), "two rows share a slot"
    bm, bs = sched.block_manager, c.block_size
    written = [{s.block_table[p // bs] for p in range(s.start_pos, s.context_len)} for s in plan.seqs]
    assert sum(map(len, written)) == len(set().union(*written)), "two rows write the same block"
    assert not any(bm.is_cached(b) for w in written for b in w), \
        "a step writes into a prefix-cached block (that another request may read)"
    readers = {}                               # block -> rows of this step that only read it
    for s in plan.seqs:
        for b in s.block_table[:s.start_pos // bs]:
            readers.setdefault(b, set()).add(s.request_id)
    for s, w in zip(plan.seqs, written):       # a written block is the writer's own, or (same-step
        for b in w:                            # sharing) filled by it now and only read by other rows
            others = bm.device.ref_counts[b] - 1
            if others:
                i = s.block_table.index(b)
                assert (i + 1) * bs <= s.context_len and len(readers.get(b, ())) == others, \
                    f"{s.request_id} writes block {b}, which another table names (copy-on-write missed)"
    holders = {b: s.request_id for s in plan.seqs for b in s.block_table}
    for src, dst in plan.copy_blocks:          # a copy goes to a row's own block (which same-step readers
        assert dst in holders and src != dst   # may share); its source may have been freed since, by a
        assert bm.device.ref_counts[dst] == 1 + len(readers.get(dst, ()))   # later preemption
    assert len({d for _, d in plan.copy_blocks}) == len(plan.copy_blocks)
    # each copy is of a row's partly filled block, which that row then writes from inside it (a copy
    # left behind by a preempted victim would name a block nobody writes so, or one a row starts)
    copied_into = {s.block_table[s.start_pos // bs] for s in plan.seqs if s.start_pos % bs}
    assert all(d in copied_into for _, d in plan.copy_blocks), "a copy no row of the step needs"
    for s in plan.seqs:
        seq = sched.get(s.request_id)
        assert seq is not None and seq.status is SequenceStatus.RUNNING
        assert s.num_tokens >= 1 and s.start_pos == seq.num_computed_tokens
        assert s.token_ids == tuple(seq.all_token_ids[s.start_pos:s.context_len])
        assert s.sample == (s.context_len == seq.num_tokens)
        assert s.block_table == tuple(sched.block_manager.block_table(s.request_id))
        assert s.slot_id == seq.slot_id
        assert s.forks == (tuple(c.request_id for c in sched._attached.get(s.request_id, ())) if s.sample
                           else ())


def drive(config: SchedulerConfig, reqs: list[Req], max_steps: int = 10_000) -> Run:
    """Run ``reqs`` (each added at its ``arrival`` step) through a scheduler and the fake model to the
    end, checking every plan and the integrity after every step; fails if it does not drain."""
    sched, model, run = Scheduler(config), FakeModel(config), Run()
    run.scheduler = sched
    pending = sorted(reqs, key=lambda r: r.arrival)

    def one_step(sched: Scheduler) -> list[Sequence]:
        now = float(len(run.plans))
        while pending and pending[0].arrival <= now:
            group = make_group(pending.pop(0))
            run.seqs.update((s.request_id, s) for s in group)
            sched.add(group[0], group[1:])
        if not pending:
            sched.close_arrivals()
        plan = sched.schedule(now=now)
        check_plan(sched, plan)
        run.plans.append(plan)
        return sched.update(plan, model.run(plan), now=now)

    for seq_ in finals(drain(sched, one_step, max_steps=max_steps, more=lambda: bool(pending),
                             check=True)).values():
        run.outputs[seq_.request_id] = list(seq_.output_token_ids)
        run.reasons[seq_.request_id] = seq_.finish_reason
    assert_drained(sched)
    assert sum(s.num_preemptions for s in run.seqs.values()) == sched.stats.num_preemptions
    assert all(s.is_finished and s.slot_id is None for s in run.seqs.values())
    return run


def assert_drained(sched: Scheduler) -> None:
    c = sched.config
    assert sched.slot_table.num_free == c.max_num_seqs
    assert sched.block_manager.num_free_blocks == c.num_blocks
    assert sched.block_manager.num_free_host_blocks == c.num_host_blocks
    assert (len(sched.waiting), len(sched.running), len(sched.swapped)) == (0, 0, 0)
    sched.check_integrity()


def assert_token_exact(run: Run, reqs: list[Req]) -> None:
    """Every request's (every child's) tokens are those it gets alone (child i: with salt i)."""
    assert set(run.outputs) == {child_id(r.rid, i, r.n) for r in reqs for i in range(r.n)}, \
        "a request never ended"
    for r in reqs:
        for i in range(r.n):
            want = alone(r.prompt, r.max_tokens, None if r.ignore_eos else EOS, salt=i)
            assert run.outputs[child_id(r.rid, i, r.n)] == want, (r.rid, i)


def seq(rid: str, n_prompt: int, max_tokens: int = 4, first: int = 1, **kw) -> Sequence:
    prompt = [(first + i) % (VOCAB - 1) + 1 for i in range(n_prompt)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


def step(sched: Scheduler, tokens: dict[str, int] | None = None, now: float = 0.0):
    """schedule + update, sampling ``tokens[rid]`` (default 7) for every sampling row."""
    plan = sched.schedule(now)
    sampled = {s.request_id: (tokens or {}).get(s.request_id, 7) for s in plan.seqs if s.sample}
    done = sched.update(plan, sampled, now)
    sched.check_integrity()
    return plan, done


def drain_scheduler(sched: Scheduler, tokens: dict[str, int] | None = None, max_steps: int = 10_000,
                    model: FakeModel | None = None,
                    on_plan: Callable[[StepPlan], object] | None = None) -> list[Sequence]:
    """``step`` until ``sched`` drains (``drain``): sampling ``tokens`` (default 7), or what the fake
    ``model`` computes; ``on_plan`` sees every plan. Returns the sequences that finished, in order."""
    def one_step(s: Scheduler) -> list[Sequence]:
        if model is None:
            plan, done = step(s, tokens)
        else:
            plan = s.schedule()
            done = s.update(plan, model.run(plan), 0.0)
        if on_plan is not None:
            on_plan(plan)
        return done

    return drain(sched, one_step, max_steps=max_steps)


def rows(plan: StepPlan):
    return [(s.request_id, s.slot_id, s.start_pos, s.num_tokens, s.block_table, s.sample) for s in plan.seqs]


def step_bound(reqs: list[Req]) -> int:
    """Generous liveness bound: the scheduler must drain well within it."""
    return 20 + max(r.arrival for r in reqs) + 8 * sum(len(r.prompt) + r.max_tokens for r in reqs)
