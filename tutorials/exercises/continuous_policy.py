"""Exercise 7 (the build-it track): the continuous policy's ``schedule``.

Every step the scheduler asks its policy which requests run and how many
tokens each computes. You write that policy against minicb's real
interfaces; the checker plugs your class into a real ``Scheduler`` (and into
an engine running a tiny model) and holds it to the scheduler's invariants,
to minicb's own plans and to a padded batch's tokens.

What you READ (the scheduler's state; never write it yourself):

* ``self.running``: dict request_id -> ``Sequence``, in admission order
  (oldest first); ``self.waiting``, ``self.swapped``: deques, front first;
* ``self.config``: ``max_num_batched_tokens``, ``max_num_seqs``,
  ``long_prefill_chunk`` (None: no cap of its own), ``prefix_caching``;
* ``self.slots.num_free``: the free slots (rows) of the batch;
* ``self.blocks`` (``minicb.core.block_manager.BlockManager``):
  ``append_slots``, ``can_allocate``, ``can_swap_in``, ``computed_blocks``,
  ``block_size``;
* a ``Sequence``: ``request_id``, ``num_computed_tokens``,
  ``num_uncomputed_tokens``, ``num_tokens``, ``all_token_ids``, ``status``,
  ``wants_prompt_rows``, ``params.cache_salt``.

What you ASK the scheduler (``self.sched``) to do:

* ``admit(seq, num_tokens, hits, cached)``: waiting -> running, with blocks
  for ``num_tokens`` positions, the first ``cached`` of them in the cached
  blocks ``hits``;
* ``resume(seq, num_tokens)``: the front of swapped -> running; returns the
  host -> device copies;
* ``preempt(seq)``: running -> the front of waiting (or swapped); returns a
  ``Preemption`` whose ``swap_out`` lists the device -> host copies.

What you RETURN: a ``StepWork`` (``minicb.core.policy``): ``scheduled``
(request_id -> tokens this step, in row order), ``preempted`` (ids, in the
order you preempted them), ``swap_in``, ``swap_out``, ``copy_blocks``.

The rules of one step (vLLM's, and chapter 07's):

1. Every running request asks for its next tokens: the ones decoding (one
   uncomputed token) first, then the ones still prefilling; within each, in
   admission order. Each gets a chunk of the step's token budget
   (``minicb.core.planner.TokenBudget``) and the blocks to hold it. When the
   pool has no blocks for it, the LEAST important running request is
   preempted (under fcfs: the one admitted last; it may be the asker itself)
   until it fits. A preempted request computes nothing in this step.
2. Only if nothing was preempted: the swapped requests come back, front
   first, before any new request, while a slot, the budget and the blocks
   allow.
3. Only if nothing was preempted and nothing is left swapped: waiting
   requests are admitted from the front while a slot, the budget and the
   blocks allow; a cached prefix (``computed_blocks``) is shared, not
   recomputed (except for a request that wants prompt logprobs,
   ``wants_prompt_rows``: it needs the logits of every prompt row). The
   first request that does not fit stays where it is.

The exercise is fcfs only, and forks (``n > 1``) are left out. Write the
class, then check it:

    cp tutorials/exercises/continuous_policy.py my_policy.py
    python -m pytest tutorials/exercises/check_continuous_policy.py \\
        --solution my_policy.py

minicb's answer: ``minicb.core.continuous`` (read it after you pass).
"""

from minicb.core.planner import TokenBudget  # noqa: F401  (you need it)
from minicb.core.policy import Policy, StepWork
from minicb.core.sequence import Sequence


class ContinuousPolicy(Policy):
    """Rebuilds the batch every step: running, then swapped, then waiting."""

    def schedule(self) -> StepWork:
        """This step's work, by the three rules of the module docstring."""
        raise NotImplementedError("exercise 7: ContinuousPolicy.schedule")

    # A shape that works (fill the bodies in, or write your own):
    def _schedule_running(self, work: StepWork, budget) -> None:
        """Rule 1: a chunk and its blocks for every running request."""
        ...

    def _preempt(self, victim: Sequence, work: StepWork, budget) -> None:
        """Preempt ``victim`` and undo whatever this step gave it."""
        ...

    def _schedule_swapped(self, work: StepWork, budget) -> None:
        """Rule 2."""
        ...

    def _schedule_waiting(self, work: StepWork, budget) -> None:
        """Rule 3."""
        ...

    def finished(self, seq: Sequence) -> None:
        """A finished request frees its slot and blocks (given)."""
        self.sched.free(seq.request_id)
