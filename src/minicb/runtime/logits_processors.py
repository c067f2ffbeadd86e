"""Per-row logits processors: per-request state that edits that request's row before it is sampled.

A step's logits are one matrix, a row per request that samples this step. Some requests want their
row changed first (a grammar's mask, penalties, a logit bias): each such request owns a list of
``RowProcessor``s, built once when it is registered with the sampler (``build_processors``) and
dropped when it ends. The sampler applies a row's processors in order, then temperature / top-k /
top-p and the draw as always, then tells each processor which token was drawn (``accept``), so a
stateful one (a grammar's parser) advances exactly one token per generated token. A row with no
processors is sampled exactly as before, in the batched greedy fast path where it applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from minicb.core.sampling_params import SamplingParams


class RowProcessor(Protocol):
    """Per-request state that edits that request's row of logits before the sampler's filters."""

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """``[V] -> [V]``, a new tensor (the input is not modified)."""
        ...

    def accept(self, token_id: int) -> None:
        """Called once per token the request generates."""
        ...


def build_processors(params: SamplingParams, prompt_token_ids: Sequence[int] = (), *, vocab_size: int,
                     eos_token_id: int | None, tokenizer=None) -> list[RowProcessor]:
    """The processors ``params`` asks for, in the order they apply (empty for plain sampling).

    Raises ``InvalidArgument`` for a constraint that cannot be built (a bad grammar, no tokenizer)."""
    procs: list[RowProcessor] = []
    if params.structured_outputs is not None:
        from minicb.runtime.grammar import GrammarProcessor, new_matcher

        matcher = new_matcher(params.structured_outputs, tokenizer, vocab_size, eos_token_id)
        procs.append(GrammarProcessor(matcher, vocab_size, eos_token_id))
    return procs
