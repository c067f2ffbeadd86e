"""The chunked-prefill rule as one pure function of plain numbers: the tests' statement of it.

``plan_chunks(decodes, prefills, new, ...)`` says how many tokens each sequence gets in one step, in
the order ``minicb.core.planner`` documents (decodes, then ongoing prefills, then new prompts until the
first that gets nothing). The scheduler applies the rule step by step with ``TokenBudget``, interleaved
with block allocation; ``tests/core/test_planner.py`` checks exact outputs of this function and that the
scheduler's grants equal it whenever blocks are plentiful (so the two cannot drift apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minicb.core.errors import check_int
from minicb.core.planner import TokenBudget


@dataclass(slots=True, frozen=True)
class ChunkPlan:
    """Tokens granted per input sequence, in input order (0 = not scheduled this step)."""

    decodes: tuple[int, ...]
    prefills: tuple[int, ...]
    new: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.decodes) + sum(self.prefills) + sum(self.new)


def plan_chunks(decodes: int, prefills: Sequence[int], new: Sequence[int], *,
                max_num_batched_tokens: int, max_num_seqs: int, chunk_cap: int | None = None,
                max_prefill_tokens_while_decoding: int | None = None,
                prefill_tokens_per_seq: int = 0) -> ChunkPlan:
    """Split one step's budget: ``decodes`` sequences of one token, then ongoing ``prefills`` and
    ``new`` prompts given as their uncomputed token counts. New prompts are taken in queue order and
    stop at the first one that gets nothing (no overtaking). With decodes, the prefills and new prompts
    together get at most ``max_prefill_tokens_while_decoding + N * prefill_tokens_per_seq`` tokens,
    ``N`` every sequence given, ``decodes + len(prefills) + len(new)``, at most ``max_num_seqs``
    (stall-free; None: no cap)."""
    check_int("decodes", decodes, lo=0)
    budget = TokenBudget(max_num_batched_tokens, max_num_seqs, chunk_cap or max_num_batched_tokens)
    got_decodes = tuple(_grant(budget, 1) for _ in range(decodes))
    if decodes and max_prefill_tokens_while_decoding:
        held = min(decodes + len(prefills) + len(new), max_num_seqs)
        budget.prefill_left = max_prefill_tokens_while_decoding + held * prefill_tokens_per_seq
    got_prefills = tuple(_grant(budget, check_int("prefills[i]", n, lo=2)) for n in prefills)
    got_new: list[int] = []
    for n in new:
        got_new.append(_grant(budget, check_int("new[i]", n, lo=1)) if not got_new or got_new[-1] else 0)
    return ChunkPlan(got_decodes, got_prefills, tuple(got_new))


def _grant(budget: TokenBudget, num_uncomputed: int) -> int:
    n = budget.chunk(num_uncomputed)
    if n:
        budget.take(n)
    return n
