"""The padded policies, the baselines continuous batching is measured against: a batch is formed,
padded to its longest member, run until every member is done, then released.

``dynamic`` (naive dynamic batching). When no batch runs, take whatever waits (FIFO, up to
``max_num_seqs``, as long as blocks for prompt + max_tokens can be reserved up front), prefill all
prompts in one step padded to the longest, then decode one token per member per step. A finished
member keeps its slot and yields a padding row every step until *every* member has finished; then the
whole batch is released and the next one formed. No preemption ever happens::

    step 0   A A A A A        B B . . .    C C C . .     (prefill; '.' = padding, plan.padding=[3, 2])
    step 1   A                B            C             (decode)
    step 2   A                .            C             (B finished: a padding row of length 1)

``static``: like dynamic, but a batch is only formed once ``max_num_seqs`` requests wait or
``close_arrivals()`` said no more will come.

The token budget ``max_num_batched_tokens`` does not apply: a padded policy computes whole prompts in
one step, as a padded static-batch engine does. This module imports no torch.
"""

from __future__ import annotations

from minicb.core.policy import Policy, StepWork
from minicb.core.sequence import Sequence


class PaddedPolicy(Policy):
    """``dynamic`` / ``static``: one batch at a time, reserved up front, padded to its longest member.

    ``batch`` is the batch in row order, finished members included (they hold their slot and blocks
    until the whole batch is done)."""

    def schedule(self) -> StepWork:
        if not self.batch and self._may_form_batch():
            self._form_batch()
        work = StepWork()
        todo = [0 if s.is_finished else s.num_uncomputed_tokens for s in self.batch]   # row order
        longest = max(todo, default=0)
        for seq, n in zip(self.batch, todo):
            if n:
                work.scheduled[seq.request_id] = n
            if longest - n:
                work.padding.append(longest - n)
        return work

    def _may_form_batch(self) -> bool:
        if self.config.policy == "static" and self.sched.arrivals_open:
            return len(self.waiting) >= self.config.max_num_seqs
        return bool(self.waiting)

    def _form_batch(self) -> None:
        bm = self.blocks
        while self.waiting and len(self.batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq.request_id, seq.max_total_tokens):
                return                            # FIFO: the first that does not fit waits
            self.sched.admit(seq, seq.max_total_tokens)       # reserved up front: no preemption
            self.batch.append(seq)

    def _release_batch_if_done(self) -> None:
        if self.batch and all(s.is_finished for s in self.batch):
            for seq in self.batch:
                self.sched.free(seq.request_id)
            self.batch.clear()

    def finished(self, seq: Sequence) -> None:
        """A finished member keeps its slot and blocks (it becomes a padding row) until all are done."""
        self._release_batch_if_done()

    def ended(self, seq: Sequence) -> None:
        if seq in self.batch:
            self.batch.remove(seq)
        self._release_batch_if_done()

    def check_integrity(self) -> None:
        bm = self.blocks
        for seq in self.batch:
            assert len(bm.block_tables[seq.request_id]) == bm.blocks_needed(seq.max_total_tokens), \
                "padded batch reserves everything"
