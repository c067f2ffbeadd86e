"""hypothesis ``RuleBasedStateMachine`` models of the slot table, the block manager and the scheduler.

Each machine keeps a plain model of what the state must be, applies random operations (valid ones and
invalid ones, which must raise and change nothing) and checks docs/design.md's invariants after every rule:
blocks conserved (device and host), ref counts, slot uniqueness, step limits, every request ending
exactly once, and, for the scheduler, token-exactness against the fake model of ``scheduler_fixtures``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hypothesis_profiles import examples
from minicb.core.block_manager import BlockManager
from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, RequestRejected
from minicb.core.sampling_params import SamplingParams
from minicb.core.scheduler import Scheduler
from minicb.core.sequence import FinishReason, Sequence
from minicb.core.slot_table import SlotTable
from scheduler_fixtures import EOS, VOCAB, FakeModel, alone, assert_drained, check_plan, child_id

SETTINGS = settings(max_examples=examples(60), stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
NAMES = st.sampled_from([f"q{i}" for i in range(8)])
FEW_NAMES = st.sampled_from(["q0", "q1", "q2"])          # fewer names: longer tables, more swaps


# --- slot table ------------------------------------------------------------------------------------
class SlotTableMachine(RuleBasedStateMachine):
    @initialize(num_slots=st.integers(1, 6))
    def setup(self, num_slots):
        self.table = SlotTable(num_slots)
        self.model: dict[str, int] = {}

    @rule(rid=NAMES)
    def assign(self, rid):
        free = set(range(self.table.num_slots)) - set(self.model.values())
        if rid in self.model or not free:
            with pytest.raises(InvalidArgument):
                self.table.assign(rid)
            return
        assert self.table.assign(rid) == min(free)
        self.model[rid] = min(free)

    @rule(data=st.data())
    def release(self, data):
        slot = data.draw(st.integers(0, self.table.num_slots - 1))
        owner = next((r for r, s in self.model.items() if s == slot), None)
        if owner is None:
            with pytest.raises(InvalidArgument):
                self.table.release(slot)
            return
        assert self.table.release(slot) == owner
        del self.model[owner]

    @invariant()
    def agrees_with_model(self):
        self.table.check_integrity()
        assert self.table.held() == {s: r for r, s in self.model.items()}
        assert self.table.num_free == self.table.num_slots - len(self.model)
        for r, s in self.model.items():
            assert self.table.slot_of(r) == s and self.table.owner(s) == r


# --- block manager ---------------------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), host=st.integers(0, 8))
    def setup(self, num_blocks, block_size, host):
        self.bm = BlockManager(num_blocks, block_size, host)
        self.device: dict[str, list[int]] = {}
        self.host: dict[str, list[int]] = {}

    def _free_device(self):
        return sorted(set(range(self.bm.num_blocks)) - {b for t in self.device.values() for b in t})

    def _free_host(self):
        return sorted(set(range(self.bm.num_host_blocks)) - {b for t in self.host.values() for b in t})

    @rule(rid=FEW_NAMES, num_tokens=st.integers(0, 30))
    def allocate(self, rid, num_tokens):
        if rid in self.host:
            with pytest.raises(InvalidArgument):
                self.bm.allocate(rid, num_tokens)
            return
        table = self.device.get(rid, [])
        missing = max(0, -(-num_tokens // self.bm.block_size) - len(table))
        free = self._free_device()
        assert self.bm.can_allocate(rid, num_tokens) == (missing <= len(free))
        if missing > len(free):
            with pytest.raises(InvalidArgument):
                self.bm.allocate(rid, num_tokens)
            return
        assert self.bm.allocate(rid, num_tokens) == free[:missing]       # lowest free blocks first
        self.device[rid] = table + free[:missing]

    @rule(rid=FEW_NAMES)
    def free(self, rid):
        held = len(self.device.pop(rid, [])) + len(self.host.pop(rid, []))
        assert self.bm.free(rid) == held

    @rule(rid=FEW_NAMES)
    def swap_out(self, rid):
        ok = rid in self.device and len(self.device[rid]) <= len(self._free_host())
        assert self.bm.can_swap_out(rid) == ok
        if not ok:
            with pytest.raises(InvalidArgument):
                self.bm.swap_out(rid)
            return
        table, free = self.device.pop(rid), self._free_host()
        assert self.bm.swap_out(rid) == list(zip(table, free[:len(table)], strict=True))
        self.host[rid] = free[:len(table)]

    @rule(rid=FEW_NAMES)
    def swap_in(self, rid):
        ok = rid in self.host and len(self.host[rid]) <= len(self._free_device())
        assert self.bm.can_swap_in(rid) == ok
        if not ok:
            with pytest.raises(InvalidArgument):
                self.bm.swap_in(rid)
            return
        table, free = self.host.pop(rid), self._free_device()
        assert self.bm.swap_in(rid) == list(zip(table, free[:len(table)], strict=True))
        self.device[rid] = free[:len(table)]

    @invariant()
    def blocks_are_conserved(self):
        self.bm.check_integrity()
        assert {r: t for r, t in self.bm.block_tables.items()} == self.device
        assert {r: t for r, t in self.bm.host_tables.items()} == self.host
        assert self.bm.device.free_blocks() == self._free_device()
        assert self.bm.host.free_blocks() == self._free_host()
        assert self.bm.num_free_blocks + sum(map(len, self.device.values())) == self.bm.num_blocks
        assert self.bm.num_free_host_blocks + sum(map(len, self.host.values())) == self.bm.num_host_blocks
        named = [b for t in self.device.values() for b in t]
        assert all(self.bm.device.ref_counts[b] == named.count(b) == 1 for b in named)


# --- block manager with prefix caching ------------------------------------------------------------------
class PrefixCacheMachine(RuleBasedStateMachine):
    """The block manager with prefix caching against a model that knows *contents*, not hashes.

    The model keeps, for every device and host position, the fake K/V written there: the tuple of all
    tokens up to and including that position (what a real K/V depends on). It predicts, from contents
    alone, which blocks are cached, the longest hit of every lookup, which block every allocation
    takes (lowest clean block first, then the least recently freed cached one, which is evicted) and
    the LRU order; it checks ref counts, free lists and that a cached or hit block holds exactly the
    K/V of the prefix it stands for. ``STRICT = False`` runs with a monkeypatched hash that collides
    all the time: then only safety is checked (no wrong hit, nothing lost), not what gets cached.
    """

    STRICT = True

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), host=st.integers(0, 8))
    def setup(self, num_blocks, block_size, host):
        self.bm = BlockManager(num_blocks, block_size, host, enable_caching=True)
        self.bs = block_size
        self.tables: dict[str, list[int]] = {}
        self.host: dict[str, list[int]] = {}
        self.toks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.offered: dict[str, int] = {}
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.hkv = [[None] * block_size for _ in range(host)]
        self.cached: dict[int, tuple] = {}            # block -> the prefix (all tokens) it holds K/V for
        self.lru: list[int] = []
        self.history: list[list[int]] = []            # every request's tokens, to share prefixes with

    # --- the model's own bookkeeping ---
    def _refs(self, block):
        return sum(t.count(block) for t in self.tables.values())

    def _clean(self):
        held = {b for t in self.tables.values() for b in t}
        return sorted(set(range(self.bm.num_blocks)) - held - set(self.lru))

    def _take(self, k):
        """The k blocks the pool must hand out next (clean ones lowest first, then the least recently
        freed cached ones, evicted), applied to the model."""
        clean, out = self._clean(), []
        for _ in range(k):
            block = clean.pop(0) if clean else self.lru.pop(0)
            self.cached.pop(block, None)             # evicted: it will hold other tokens
            self.kv[block] = [None] * self.bs
            out.append(block)
        return out

    def _drop(self, table):
        for block in reversed(table):
            if self._refs(block) == 0 and block in self.cached:
                self.lru.append(block)

    def _expected_hits(self, tokens):
        hits, by_content = [], {c: b for b, c in self.cached.items()}
        for i in range((len(tokens) - 1) // self.bs):
            block = by_content.get(tuple(tokens[:(i + 1) * self.bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    def _check_kv(self, block, prefix):
        """``block`` holds the K/V of the last block_size tokens of ``prefix``, with ``prefix`` before."""
        n = len(prefix)
        assert self.kv[block] == [prefix[:n - self.bs + j + 1] for j in range(self.bs)], \
            f"block {block} does not hold the K/V of {prefix}"

    # --- rules ---
    @rule(rid=FEW_NAMES, data=st.data())
    def admit(self, rid, data):
        if rid in self.tables or rid in self.host:
            return
        shared = self.history and data.draw(st.sampled_from([True, True, False]))
        base = data.draw(st.sampled_from(self.history)) if shared else []
        cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        tokens = base[:cut] + data.draw(st.lists(st.integers(1, 3), max_size=10))
        if not tokens:
            return
        hits = self.bm.computed_blocks(tokens)
        for i, block in enumerate(hits):                  # safety: a hit holds exactly our prefix
            self._check_kv(block, tuple(tokens[:(i + 1) * self.bs]))
        if self.STRICT:
            assert hits == self._expected_hits(tokens)   # and it is the longest one
        cached = len(hits) * self.bs
        target = cached + data.draw(st.integers(1, len(tokens) - cached))
        missing = -(-target // self.bs) - len(hits)
        free = len(self._clean()) + len(self.lru)
        ok = missing + sum(1 for b in hits if self._refs(b) == 0) <= free
        assert self.bm.can_allocate(rid, target, hits) == ok
        if not ok:
            with pytest.raises(InvalidArgument):
                self.bm.allocate(rid, target, hits)
            return
        self.tables[rid] = list(hits)
        self.lru = [b for b in self.lru if b not in hits]
        new = self._take(missing)
        assert self.bm.allocate(rid, target, hits) == new
        self.tables[rid] += new
        self.toks[rid], self.computed[rid], self.offered[rid] = list(tokens), cached, len(hits)
        self.history.append(self.toks[rid])

    @rule(data=st.data(), n=st.integers(1, 8), extra=st.lists(st.integers(1, 3), max_size=3))
    def compute(self, data, n, extra):
        """The forward computes up to n more positions (the request's table grows to hold them),
        then the step is recorded: full computed blocks are offered to the cache. ``extra`` tokens
        were generated meanwhile."""
        if not self.tables:
            return
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        toks, table = self.toks[rid], self.tables[rid]
        toks += extra
        target = min(self.computed[rid] + n, len(toks))
        missing = max(0, -(-target // self.bs) - len(table))
        if missing > len(self._clean()) + len(self.lru):
            assert not self.bm.can_allocate(rid, target)
            return
        new = self._take(missing)
        assert self.bm.allocate(rid, target) == new
        table += new
        for p in range(self.computed[rid], target):
            self.kv[table[p // self.bs]][p % self.bs] = tuple(toks[:p + 1])
        self.computed[rid] = target
        full = min(target // self.bs, len(table))
        expect = 0
        for i in range(self.offered[rid], full):
            block, content = table[i], tuple(toks[:(i + 1) * self.bs])
            if self.STRICT:
                parent_ok = i == 0 or table[i - 1] in self.cached
                if parent_ok and block not in self.cached and content not in self.cached.values():
                    self.cached[block] = content
                    expect += 1
        got = self.bm.cache_full_blocks(rid, toks, target)
        if not self.STRICT:
            for i in range(self.offered[rid], full):
                if self.bm.is_cached(table[i]):
                    self.cached[table[i]] = tuple(toks[:(i + 1) * self.bs])
                    expect += 1
        assert got == expect
        self.offered[rid] = max(self.offered[rid], full)

    @rule(rid=FEW_NAMES)
    def free(self, rid):
        held = len(self.tables.get(rid, [])) + len(self.host.get(rid, []))
        assert self.bm.free(rid) == held
        table = self.tables.pop(rid, [])
        self._drop(table)
        self.host.pop(rid, None)
        for d in (self.toks, self.computed, self.offered):
            d.pop(rid, None)

    @rule(rid=FEW_NAMES)
    def swap_out(self, rid):
        free_host = sorted(set(range(self.bm.num_host_blocks)) - {b for t in self.host.values() for b in t})
        ok = rid in self.tables and len(self.tables[rid]) <= len(free_host) \
            and all(self._refs(b) == 1 for b in self.tables[rid])
        assert self.bm.can_swap_out(rid) == ok
        if not ok:
            if rid in self.tables and any(self._refs(b) > 1 for b in self.tables[rid]):
                with pytest.raises(InvalidArgument, match="shared"):
                    self.bm.swap_out(rid)
            return
        table = self.tables.pop(rid)
        copies = list(zip(table, free_host[:len(table)], strict=True))
        assert self.bm.swap_out(rid) == copies
        for d, h in copies:
            self.hkv[h] = list(self.kv[d])
        self.host[rid] = free_host[:len(table)]
        self._drop(table)

    @rule(rid=FEW_NAMES)
    def swap_in(self, rid):
        ok = rid in self.host and len(self.host[rid]) <= len(self._clean()) + len(self.lru)
        assert self.bm.can_swap_in(rid) == ok
        if not ok:
            return
        table = self.host.pop(rid)
        new = self._take(len(table))
        assert self.bm.swap_in(rid) == list(zip(table, new, strict=True))
        for h, d in zip(table, new):
            self.kv[d] = list(self.hkv[h])
        self.tables[rid], self.offered[rid] = new, 0

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        bm.check_integrity()
        assert bm.block_tables == self.tables and bm.host_tables == self.host
        for block in range(bm.num_blocks):         # ref count == number of tables naming the block
            assert bm.device.ref_counts[block] == self._refs(block)
        free = set(bm.device.free_blocks())
        assert all(bm.device.ref_counts[b] == 0 for b in free), "a held block is on a free list"
        assert bm.device.cached_free_blocks() == self.lru, "LRU order"
        assert sorted(free) == sorted(self._clean() + self.lru)
        assert set(bm.cache.blocks) == set(self.cached)
        for block, prefix in self.cached.items():   # every cached block holds the K/V it stands for
            self._check_kv(block, prefix)


WEAK_HASHES = {
    "first token only": lambda parent_hash, token_ids: hash(token_ids[:1]),     # other blocks, positions
    "no parent": lambda parent_hash, token_ids: hash(token_ids),                 # same block, other prefix
    "constant": lambda parent_hash, token_ids: 7,
}


class CollidingPrefixCacheMachine(PrefixCacheMachine):
    """Block hashes collide all the time (a monkeypatched ``hash_block``): never a wrong hit."""

    STRICT = False

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), host=st.integers(0, 8),
                weak=st.sampled_from(sorted(WEAK_HASHES)))
    def setup(self, num_blocks, block_size, host, weak):
        import minicb.core.prefix_cache as hash_module

        self._saved_hash = hash_module.hash_block
        hash_module.hash_block = WEAK_HASHES[weak]
        PrefixCacheMachine.setup(self, num_blocks, block_size, host)

    def teardown(self):
        import minicb.core.prefix_cache as hash_module

        hash_module.hash_block = self._saved_hash


# --- scheduler -------------------------------------------------------------------------------------
MAX_MODEL_LEN = 24


@st.composite
def scheduler_configs(draw, policy: str, preemption_mode: str):
    """Pools of one or two of the largest requests: memory is tight, so preemption is frequent."""
    max_num_seqs = draw(st.sampled_from([1, 2, 3, 4, 4]))
    budget = draw(st.integers(1, 24))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    per_request = -(-MAX_MODEL_LEN // block_size)
    hosts = [per_request, 3 * per_request, 1] if preemption_mode == "swap" else [0]
    return SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size,
        long_prefill_chunk=draw(st.one_of(st.none(), st.integers(1, budget))),
        max_prefill_tokens_while_decoding=draw(st.one_of(st.none(), st.integers(1, budget + 2))),
        prefill_tokens_per_seq=draw(st.integers(0, 3)),
        num_blocks=max(max_num_seqs, per_request + draw(st.integers(0, per_request // 2))),
        num_host_blocks=draw(st.sampled_from(hosts)), max_model_len=MAX_MODEL_LEN,
        policy=policy, preemption_mode=preemption_mode,
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])))


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps, aborts and failing steps against a model of who must end how."""

    POLICY, MODE = "continuous", "recompute"

    @initialize(data=st.data())
    def setup(self, data):
        config = data.draw(scheduler_configs(self.POLICY, self.MODE))
        self.config = config
        self.sched = Scheduler(config)
        self.model = FakeModel(config)
        self.requests: dict[str, tuple | None] = {}   # prompt, max_tokens, ignore_eos, salt
        self.ended: dict[str, FinishReason] = {}
        self.seqs: dict[str, Sequence] = {}

    def _end(self, seqs, reason=None):
        for s in seqs:
            assert s.request_id not in self.ended, f"{s.request_id} ended twice"
            assert s.is_finished and (reason is None or s.finish_reason is reason)
            self.ended[s.request_id] = s.finish_reason

    @rule(batch=st.lists(st.tuples(st.lists(st.integers(1, VOCAB - 1), max_size=12), st.integers(1, 16),
                                   st.integers(0, 3), st.sampled_from([True, True, False])),
                         min_size=1, max_size=3))
    def add(self, batch):
        for prompt, max_tokens, priority, ignore_eos in batch:
            self._add_one(prompt, max_tokens, priority, ignore_eos)

    @rule(data=st.data(), max_tokens=st.integers(1, 16), ignore_eos=st.sampled_from([True, True, False]))
    def add_sharing(self, data, max_tokens, ignore_eos):
        """A request sharing a prefix with an earlier one: the same prompt, a prefix of it, or it
        extended by (some of) that request's generated tokens and more (a next chat turn)."""
        if not self.seqs:
            return
        old = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        base = old.prompt_token_ids + old.output_token_ids
        cut = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(st.integers(1, VOCAB - 1), max_size=4))
        self._add_one(base[:cut] + tail, max_tokens, data.draw(st.integers(0, 3)), ignore_eos)

    @rule(prompt=st.lists(st.integers(1, VOCAB - 1), max_size=12), max_tokens=st.integers(1, 12),
          n=st.integers(2, 4), ignore_eos=st.sampled_from([True, True, False]))
    def add_parallel(self, prompt, max_tokens, n, ignore_eos):
        """A request with n > 1 children: they fork after the prompt (continuous) or run on their own."""
        self._add_one(prompt, max_tokens, 0, ignore_eos, n)

    def _add_one(self, prompt, max_tokens, priority, ignore_eos, n=1):
        rid = f"r{len(self.requests)}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        group = [Sequence(child_id(rid, i, n), list(prompt), params, priority=priority, eos_token_id=EOS,
                          index=i) for i in range(n)]
        total = len(prompt) + max_tokens
        never_fits = not prompt or total > self.config.max_model_len \
            or -(-total // self.config.block_size) > self.config.num_blocks
        before = (len(self.sched.waiting), self.sched.has_unfinished())
        if never_fits:
            with pytest.raises(RequestRejected):
                self.sched.add(group[0], group[1:])
            assert (len(self.sched.waiting), self.sched.has_unfinished()) == before
            self.requests[rid] = None
            return
        self.sched.add(group[0], group[1:])
        for i, seq in enumerate(group):
            self.seqs[seq.request_id] = seq
            self.requests[seq.request_id] = (list(prompt), max_tokens, ignore_eos, i)

    @rule(n=st.integers(1, 8))
    def steps(self, n):
        for _ in range(n):
            self.step()

    def step(self):
        decodes = {r for r, q in self.sched.running.items() if q.num_uncomputed_tokens == 1}
        held = min(len(self.sched.running) + len(self.sched.swapped) + len(self.sched.waiting),
                   self.config.max_num_seqs)
        plan = self.sched.schedule(now=1.0)
        check_plan(self.sched, plan)
        c = self.config
        if decodes and c.max_prefill_tokens_while_decoding and c.policy == "continuous":   # stall-free
            cap = c.max_prefill_tokens_while_decoding + c.prefill_tokens_per_seq * held
            assert sum(s.num_tokens for s in plan.seqs if s.request_id not in decodes) <= cap, plan
        self.copies = getattr(self, "copies", 0) + len(plan.copy_blocks)
        self._end(self.sched.update(plan, self.model.run(plan), now=1.0))
        self.sched.check_integrity()

    @rule(what=st.sampled_from(["abort", "fail", "duplicate", "close", "open"]), data=st.data())
    def disturb(self, what, data):
        """The rare events, behind one rule so that adding and stepping dominate the runs."""
        if what == "abort" and self.seqs:
            self._abort(data.draw(st.sampled_from(sorted(self.seqs))))
        elif what == "fail":
            self._failing_step()
        elif what == "duplicate" and self.sched.has_unfinished():
            rid = next(r for r in self.seqs if r not in self.ended)
            with pytest.raises(InvalidArgument, match="already in use"):
                self.sched.add(Sequence(rid, [1], SamplingParams(max_tokens=1)))
        elif what == "close":
            self.sched.close_arrivals()
        elif what == "open":
            self.sched.close_arrivals(False)

    def _failing_step(self):
        plan = self.sched.schedule(now=1.0)
        check_plan(self.sched, plan)
        failed = self.sched.fail_step(plan, "injected failure", now=1.0)
        rows = {s.request_id for s in plan.seqs}
        assert rows <= {s.request_id for s in failed}
        # besides the rows: the children still attached to a failed child 0 (never forked)
        assert all(f.request_id.partition("_")[2] in {r.partition("_")[2] for r in rows if r.startswith("0_")}
                   for f in failed if f.request_id not in rows)
        self._end(failed, FinishReason.ERROR)

    def _abort(self, rid):
        got = self.sched.abort(rid)
        assert (got is None) == (rid in self.ended)
        if got is not None:
            self._end([got], FinishReason.ABORT)
            # a child 0 aborted before its fork takes its attached children (same request) with it
            gone = [s for r, s in self.seqs.items() if s.is_finished and r not in self.ended]
            assert all(rid.startswith("0_") and s.request_id.partition("_")[2] == rid[2:] for s in gone)
            self._end(gone, FinishReason.ABORT)

    @invariant()
    def integrity(self):
        if hasattr(self, "sched"):
            self.sched.check_integrity()
            assert self.sched.has_unfinished() == (len(self.ended) < len(self.seqs))

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self.sched.close_arrivals()
        self.requests = {r: v for r, v in self.requests.items() if v is not None}
        bound = 10 + 8 * sum(len(p) + m for p, m, _, _ in self.requests.values())
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), f"not drained within {bound} steps"
        assert_drained(self.sched)
        assert set(self.ended) == set(self.seqs), "a request never ended"
        for rid, (prompt, max_tokens, ignore_eos, salt) in self.requests.items():
            want = alone(prompt, max_tokens, None if ignore_eos else EOS, salt)
            got = self.seqs[rid].output_token_ids
            if self.ended[rid] in (FinishReason.STOP, FinishReason.LENGTH):
                assert got == want, rid
            else:
                assert got == want[:len(got)], rid     # aborted / failed: a prefix of the right answer
        assert sum(s.num_preemptions for s in self.seqs.values()) == self.sched.stats.num_preemptions
        target(float(self.sched.stats.num_preemptions), label="preemptions")   # steer towards pressure
        target(float(self.sched.stats.num_swaps), label="swaps")
        target(float(self.sched.stats.num_cached_prompt_tokens), label="prefix-cache hits")
        target(float(getattr(self, "copies", 0)), label="copies on write")


TestSlotTable = SlotTableMachine.TestCase
TestSlotTable.settings = settings(SETTINGS, max_examples=examples(50))
TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(SETTINGS, max_examples=examples(80))
TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(SETTINGS, max_examples=examples(100), stateful_step_count=40)
TestPrefixCacheCollisions = CollidingPrefixCacheMachine.TestCase
TestPrefixCacheCollisions.settings = settings(SETTINGS, max_examples=examples(50), stateful_step_count=40)


class SwapMachine(SchedulerMachine):
    POLICY, MODE = "continuous", "swap"


class DynamicMachine(SchedulerMachine):
    POLICY = "dynamic"


class StaticMachine(SchedulerMachine):
    POLICY = "static"


TestContinuousRecompute = SchedulerMachine.TestCase
TestContinuousRecompute.settings = settings(SETTINGS, max_examples=examples(60), stateful_step_count=30)
TestContinuousSwap = SwapMachine.TestCase
TestContinuousSwap.settings = settings(SETTINGS, max_examples=examples(60), stateful_step_count=30)
TestDynamic = DynamicMachine.TestCase
TestDynamic.settings = settings(SETTINGS, max_examples=examples(30), stateful_step_count=30)
TestStatic = StaticMachine.TestCase
TestStatic.settings = settings(SETTINGS, max_examples=examples(30), stateful_step_count=30)
