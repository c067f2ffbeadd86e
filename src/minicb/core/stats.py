"""What the scheduler reports: running totals for the metrics (``SchedulerStats``) and its state at one
moment as plain, immutable values (``SchedulerSnapshot``, what step listeners see).

``Scheduler.stats`` is updated as the scheduler works (tokens are counted when ``update`` records a
step); ``Scheduler.snapshot()`` copies the slot table, the block tables and the queues into a
``SchedulerSnapshot`` that a listener may keep. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """Running totals for the metrics (tokens are counted when ``update`` records the step)."""

    num_steps: int = 0                 # schedule() calls
    num_preemptions: int = 0           # recompute + swap
    num_recomputes: int = 0
    num_swaps: int = 0                 # swap-outs
    num_swap_ins: int = 0
    num_batched_tokens: int = 0        # real tokens computed
    num_padding_tokens: int = 0        # padding tokens computed (padded policies)
    num_recomputed_tokens: int = 0     # computed tokens thrown away by recompute preemption
    num_finished: int = 0              # requests that ended (any reason)
    num_prompt_tokens: int = 0         # prompt tokens of requests admitted for the first time
    num_cached_prompt_tokens: int = 0  # of those, tokens served from the prefix cache at that admission
    num_cached_reprefill_tokens: int = 0   # tokens a recompute-preempted request found cached again

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens (first admissions; 0.0 if none)."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def count_admission(self, num_prompt_tokens: int, num_cached: int, first: bool) -> None:
        """A request was admitted with ``num_cached`` tokens from the prefix cache: its first
        admission, or a recompute-preempted one coming back."""
        if first:
            self.num_prompt_tokens += num_prompt_tokens
            self.num_cached_prompt_tokens += num_cached
        else:
            self.num_cached_reprefill_tokens += num_cached

    def count_preemption(self, mode: str, num_lost_tokens: int) -> None:
        """A running request was preempted (``"swap"`` or ``"recompute"``, losing so many tokens)."""
        self.num_preemptions += 1
        self.num_swaps += mode == "swap"
        self.num_recomputes += mode == "recompute"
        self.num_recomputed_tokens += num_lost_tokens


@dataclass(slots=True, frozen=True)
class SchedulerSnapshot:
    """The scheduler's state at one moment as plain, immutable values: what step listeners see."""

    step: int                                              # steps planned so far
    slots: tuple[str | None, ...]                          # slot i -> the request holding it, or None
    block_tables: tuple[tuple[str, tuple[int, ...]], ...]  # (request, device blocks) of slot holders
    host_tables: tuple[tuple[str, tuple[int, ...]], ...]   # (request, host blocks) of swapped requests
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int                                 # blocks in the prefix cache (held or free)
    num_host_blocks: int
    num_free_host_blocks: int
    waiting: tuple[str, ...]                               # queue order: the front first
    running: tuple[str, ...]
    swapped: tuple[str, ...]
    arrivals_open: bool
    cached_blocks: tuple[int, ...] = ()                    # the blocks in the prefix cache (held or free)

    @classmethod
    def of(cls, sched) -> SchedulerSnapshot:
        """The ``Scheduler``'s state right now, copied into immutable values (listeners may keep it)."""
        bm, table = sched.block_manager, sched.slot_table
        held = table.held()
        return cls(
            step=sched.stats.num_steps,
            slots=tuple(held.get(i) for i in range(sched.config.max_num_seqs)),
            block_tables=tuple((rid, tuple(bm.block_tables[rid])) for rid in held.values()
                               if rid in bm.block_tables),
            host_tables=tuple((rid, tuple(t)) for rid, t in bm.host_tables.items()),
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks, num_host_blocks=sched.config.num_host_blocks,
            num_free_host_blocks=bm.num_free_host_blocks,
            waiting=tuple(s.request_id for s in sched.waiting),
            running=tuple(sched.running), swapped=tuple(s.request_id for s in sched.swapped),
            arrivals_open=sched.arrivals_open, cached_blocks=bm.cached_blocks)

    @property
    def num_held_slots(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def free_blocks(self) -> tuple[int, ...]:
        """The free device blocks (cached or not), lowest first: every block no table names. Derived
        on demand, so a snapshot costs O(held blocks), not O(pool) (simulated pools are large)."""
        held = {b for _, table in self.block_tables for b in table}
        return tuple(b for b in range(self.num_blocks) if b not in held)
