"""``StepPlan``: everything one forward step must do, decided by the scheduler, executed by the engine.

The plan is a plain, frozen value (no torch): the packer turns it into tensors, tensor-parallel ranks
compare its fingerprint, the simulator costs it, the tutorials print it. Per scheduled sequence it says
which tokens get K/V this step, where they start, which blocks hold them, and whether a token is
sampled. Besides real sequences a plan may carry *padding rows*: the padded policies (static, dynamic)
keep computing throw-away tokens for rows that are shorter than the batch's longest or already
finished; they run through the model like any row but write no K/V and are never sampled.

Order of effects inside one step (the engine keeps it): swap-out copies, then swap-in copies, then the
copy-on-write block copies (``copy_blocks``), then the forward pass (which writes the new K/V through
``slot_mapping``), then sampling. A copy's destination is a block taken fresh for this step; its source
was held when the copy was planned, and nothing writes it before the copies run: a step that
preempts (the only way the source can be freed) swaps nothing in, and the forward comes after.

Parallel sampling: the row that finishes the prompt of a request with ``n > 1`` children names the
other children in ``forks``; its logits are sampled once per child, each with the child's own
generator, and the children fork from it (``Scheduler.update``).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL, DECODE = "prefill", "decode"


def row_kind(start_pos: int, num_tokens: int, num_prompt_tokens: int) -> str:
    """``"prefill"`` or ``"decode"``: the one rule every picture, replay and page uses for a row.

    A row is a *decode* when it starts at or past the end of the prompt (``start_pos >=
    num_prompt_tokens``): it feeds back a token the model sampled. Every row that starts inside the
    prompt is a *prefill*, however short: a one-token last chunk of a prompt, the one token left after
    a prefix-cache hit (the hit is capped at ``num_tokens - 1``), or a one-token grant of a tight
    budget. The row's length says nothing about its kind::

        prompt of 9, chunks of 8:      (start 0, 8 tokens) prefill, (start 8, 1 token) prefill
        then its first decode:         (start 9, 1 token)  decode

    A recompute re-prefill that starts past the prompt and feeds several generated tokens again is
    counted as a prefill too: it computes K/V for tokens that are already known.
    """
    if start_pos < num_prompt_tokens or num_tokens > 1:
        return PREFILL
    return DECODE


@dataclass(slots=True, frozen=True)
class ScheduledSeq:
    """One request's row of a step: which of its tokens get K/V now, from where, in which blocks."""

    request_id: str
    slot_id: int
    token_ids: tuple[int, ...]      # tokens whose K/V is computed this step (a chunk, a prompt, a decode)
    start_pos: int                  # num_computed_tokens before this step = position of token_ids[0]
    block_table: tuple[int, ...]    # device blocks covering positions [0, start_pos + len(token_ids))
    sample: bool                    # True when this step reaches the sequence's last token
    forks: tuple[str, ...] = ()     # children (n > 1) that also sample from this row, then fork from it
    # Prompt logprobs (``SamplingParams.prompt_logprobs``): the first ``len(prompt_targets)`` rows of this
    # chunk also return their logits, and row ``i`` scores ``prompt_targets[i]``, the prompt token at
    # position ``start_pos + i + 1`` (it may lie in the next chunk, which is why the plan carries it).
    # Empty for every other row, so the default step computes logits for the sampled rows only.
    prompt_targets: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Keys this sequence attends over after the step: cached ones plus the new ones."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True, frozen=True)
class StepPlan:
    """Everything one forward step must do (no torch): the rows, padding rows, swap copies, preemptions."""

    step: int
    seqs: tuple[ScheduledSeq, ...] = ()
    padding: tuple[int, ...] = ()                    # lengths of padding rows (padded policies only)
    swap_out: tuple[tuple[int, int], ...] = ()       # (device block, host block) copies
    swap_in: tuple[tuple[int, int], ...] = ()        # (host block, device block) copies
    preempted: tuple[str, ...] = ()                  # request ids preempted while planning this step
    copy_blocks: tuple[tuple[int, int], ...] = ()    # (src, dst) device copies: copy-on-write of forks
    block_size: int = 16

    @property
    def num_batched_tokens(self) -> int:
        """Real tokens computed this step (padding excluded)."""
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_padding_tokens(self) -> int:
        return sum(self.padding)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.padding or self.swap_in or self.swap_out or self.copy_blocks)

    def fingerprint(self) -> tuple:
        """A cheap, order-sensitive summary that every tensor-parallel rank must agree on."""
        return (
            self.step,
            tuple((s.request_id, s.slot_id, s.start_pos, s.num_tokens, s.block_table, s.sample, s.forks)
                  for s in self.seqs),
            self.padding, self.swap_out, self.swap_in, self.copy_blocks,
        )
