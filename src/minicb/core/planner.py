"""Chunked prefill: how many tokens each sequence computes in one step, under a token budget.

A step may compute at most ``max_num_batched_tokens`` tokens for at most ``max_num_seqs`` sequences.
The continuous policy hands the budget out in a fixed order, so that decodes (one token each, latency
sensitive) never wait behind a long prompt::

    1. decodes           running sequences with one uncomputed token          -> 1 token each
    2. ongoing prefills  running sequences with more (a prompt being chunked,  -> a chunk each
                         or a recompute-preempted sequence re-prefilling)
    3. new prompts       the waiting queue, in order, until one gets nothing   -> a chunk each

    budget 8, three decodes and a new 20-token prompt:
        decode  decode  decode  prompt[0:5]          (3 + 5 = 8; prompt[5:] goes next step)

A *chunk* is ``min(uncomputed tokens, long_prefill_chunk, budget left)``: ``long_prefill_chunk``
(``SchedulerConfig.chunk_cap``) keeps one long prompt from taking the whole step. Only the chunk that
reaches a sequence's last token samples.

**Stall-free batching** (Sarathi-Serve's point). Decodes first is not enough: the decodes get their
tokens, but the step that carries them also carries the prompt chunks that fill the rest of the budget,
and a running stream waits for the whole step: one 2,000-token chunk beside a decode makes that
decode's next token seconds late on a CPU. So a step *with* decodes gives the prompts after them
(those of 2 and 3 above, together) at most::

    max_prefill_tokens_while_decoding + N * prefill_tokens_per_seq        tokens

``N`` the sequences the scheduler holds (running, swapped and waiting; at most ``max_num_seqs``, the
most that decode together; a fork's children count once they are queued), and a step without decodes
gives prompts the whole budget, so a lone long prompt is not slowed down. The numbers come from a
cost model. A step's time is close to ``a + b x tokens`` (``a``: what every step pays, reading the
weights and the Python around the forward; ``b``: each token's share; ``bench/stall.py`` fits both).
Every sequence held will soon decode beside the others (the waiting ones once their prompts are in),
so ``a + b N`` is the step the running streams are heading for; with ``p`` prompt tokens a step of
``n <= N`` decodes takes ``a + b (n + p)``, at most ``k`` times that while ``p <= (k - 1) (a / b + N)``.
So the first number is about ``(k - 1) a / b`` and the second ``k - 1``. The bound is on the step the
held sequences will have together, not on the step a stream has now: with many requests waiting, a
running stream's gap grows towards ``k`` times a full batch's step, which it would soon have anyway::

    budget 2048, 4 + 4 a sequence; a stream and a new 2,000-token prompt (N = 2):
        decode  prompt[0:12]                 (1 + 12: the step stays short, the stream flows)
        decode  prompt[12:24]                ... and so on while the stream runs; once it has ended:
        prompt[24:2000]                      (no decode: the whole budget again)

    a stream and 63 new requests of ~100 tokens, arrived at once (N = 64):
        decode  prompts: 260 tokens          (4 + 4 x 64, a step while the burst waits)

Counting the waiting sequences, not only the decodes, is what keeps a server that is filling up
efficient: with ``n`` decodes alone in the formula (8 + 4 n until the twenty-third session), the
first request of a burst to start decoding held the other 63 to 12 prompt tokens a step, short steps
that each paid ``a`` (bench/RESULTS.md, twenty-third session). One stream and one long prompt get
what they got before (4 + 4 x 2 = 8 + 4 x 1).

The price is the long prompt's time to first token (its prompt is spread over more, shorter steps,
each paying ``a``) and, at saturation, a few more steps. The numbers are plain token counts, so a
schedule depends on the configuration and the queues only, never on a clock. ``minicb serve``'s
default, 4 + 4, was measured (``bench/stall.py``; ``LLM()`` offline has no cap): below the straight
line's ``(k - 1) a / b`` for ``k = 5``, because a chunk late in a long prompt costs more than ``b`` a
token (its tokens attend to all the keys before them).

``TokenBudget`` is the arithmetic, used step by step by the scheduler (which interleaves it with block
allocation and preemption). The tests state the same rule as one pure function of plain numbers
(``tests/chunk_rule.py``) and check the scheduler's grants against it.

Invariants: the tokens granted in a step sum to at most ``max_num_batched_tokens``; at most
``max_num_seqs`` sequences get tokens; every grant is at least 1 and at most ``chunk_cap``; in a step
with decodes, the grants after them sum to at most the stall-free cap above.
This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from minicb.core.errors import check_int


@dataclass(slots=True)
class TokenBudget:
    """What is left of one step's token and sequence budget."""

    max_num_batched_tokens: int
    max_num_seqs: int
    chunk_cap: int
    num_batched_tokens: int = 0
    num_seqs: int = 0
    # stall-free: the prompt tokens this step may still take (None: no cap). The policy sets it once the
    # decodes are granted, if there are any; every later ``take`` spends it, and ``give_back`` does not
    # refund it (a chunk taken back in a preemption is not offered again in the same step).
    prefill_left: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "chunk_cap"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:      # the policy passes a checked config's ints
                check_int(name, value, lo=1)             # raises, saying what is wrong

    @property
    def tokens_left(self) -> int:
        return self.max_num_batched_tokens - self.num_batched_tokens

    def chunk(self, num_uncomputed: int) -> int:
        """Tokens a sequence with ``num_uncomputed`` tokens may compute now (0: none this step)."""
        if self.num_seqs >= self.max_num_seqs:
            return 0
        left = self.max_num_batched_tokens - self.num_batched_tokens
        if self.prefill_left is not None:
            left = min(left, self.prefill_left)
        return max(0, min(num_uncomputed, self.chunk_cap, left))

    def take(self, num_tokens: int) -> None:
        """Charge one sequence's grant of ``num_tokens`` to the budget."""
        assert 1 <= num_tokens <= self.max_num_batched_tokens - self.num_batched_tokens
        assert self.num_seqs < self.max_num_seqs
        self.num_batched_tokens += num_tokens
        self.num_seqs += 1
        if self.prefill_left is not None:
            assert num_tokens <= self.prefill_left, "stall-free cap overdrawn"
            self.prefill_left -= num_tokens

    def give_back(self, num_tokens: int) -> None:
        """Undo one ``take`` (its sequence was preempted later in the same step)."""
        assert 1 <= num_tokens <= self.num_batched_tokens and self.num_seqs >= 1
        self.num_batched_tokens -= num_tokens
        self.num_seqs -= 1

    def check_integrity(self) -> None:
        assert 0 <= self.num_batched_tokens <= self.max_num_batched_tokens, "token budget overdrawn"
        assert 0 <= self.num_seqs <= self.max_num_seqs, "sequence budget overdrawn"
        assert self.num_seqs <= self.num_batched_tokens, "every granted sequence has at least one token"
        assert self.prefill_left is None or self.prefill_left >= 0, "stall-free cap overdrawn"
