"""Exercise 3: the chunk rule (the planner's ``TokenBudget.chunk``).

Every step has a token budget (``max_num_batched_tokens``) and a cap on rows
(``max_num_seqs``). The scheduler walks the running requests (decodes first)
and gives each one ``chunk(its uncomputed tokens)`` tokens: a decode has 1
uncomputed token, a prompt many. A long prompt is cut into chunks of at most
``chunk_cap`` tokens (``long_prefill_chunk``), and nobody gets more than the
budget has left. That is chunked prefill: decodes keep running while a long
prompt is fed a piece per step.

Write the function, then check it:

    cp tutorials/exercises/chunk.py my_chunk.py
    python -m pytest tutorials/exercises/check_chunk.py --solution my_chunk.py

minicb's answer: ``minicb.core.planner.TokenBudget.chunk``.
"""


def chunk(num_uncomputed: int, tokens_left: int, chunk_cap: int,
          seqs_left: int = 1) -> int:
    """Tokens a request with ``num_uncomputed`` tokens may compute this step,
    when the budget has ``tokens_left`` tokens and ``seqs_left`` rows left;
    0 means none this step."""
    raise NotImplementedError("exercise 3: chunk")
