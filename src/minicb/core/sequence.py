"""One request's life: its tokens, its progress through the KV cache, and its state machine.

::

                 admit                      EOS / stop / max_tokens
    WAITING ───────────────► RUNNING ─────────────────────────────► FINISHED
       ▲                     │     ▲                                   ▲
       │ preempt (recompute) │     │ swap in                           │ abort / error
       └─────────────────────┤     │                                   │ (from any state)
                             └─► SWAPPED
                          preempt (swap)

The one number that drives everything is ``num_computed_tokens``: how many of the sequence's tokens
already have K/V in the cache. A step schedules ``n`` more tokens starting there:

* a row that starts inside the prompt (``num_computed_tokens < num_prompt_tokens``) is a *prefill*, of
  any length: a one-token last chunk or a one-token remainder after a prefix hit is still a prefill;
  a row that starts past it is a *decode*, one token (the one sampled last step). The rule is
  ``minicb.core.plan.row_kind``, and every trace, replay and page uses it;
* the step samples a new token only when it reaches the end: ``num_computed_tokens + n == num_tokens``;
* recompute preemption just resets ``num_computed_tokens`` to 0: the prompt *and* the generated tokens
  are fed again as one long prefill, which yields exactly the same next token.

Parallel sampling (``SamplingParams.n > 1``) makes one sequence per child, ``index`` 0 .. n - 1, with
the same prompt. Child 0 computes the prompt; the others wait *attached* to it (in no queue) and fork
from it when its prompt is done: from then on each child is an ordinary sequence (its own tokens,
slot, preemptions, finish), whose recompute feeds its prompt and *its own* tokens again.

Invariant: ``0 <= num_computed_tokens <= num_tokens - 1`` while unfinished (the last token's K/V is
always computed in the step that feeds it). This module imports no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minicb.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # queued, holds no slot and no blocks (new or recompute-preempted)
    RUNNING = "running"        # holds a slot and device blocks
    SWAPPED = "swapped"        # preempted by swap: its blocks live in the host pool, no slot
    FINISHED = "finished"      # done: see ``finish_reason``


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS or a stop token id
    LENGTH = "length"    # max_tokens reached
    ABORT = "abort"      # abort_request()
    ERROR = "error"      # the step that served it failed (see Sequence.error)


@dataclass(slots=True, eq=False)
class Sequence:
    """One request through its life: prompt and output tokens, status, progress, timestamps."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0                    # lower value = more important (vLLM's convention)
    eos_token_id: int | None = None
    arrival_index: int = 0               # FIFO tie-break, set by the scheduler on add()
    index: int = 0                       # which child of its request (SamplingParams.n; vLLM's index)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    slot_id: int | None = None
    admitted_index: int = -1             # order of the latest admission (the default preemption victim
                                         # is the most recently admitted running sequence)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0           # tokens served from the prefix cache at the latest admission
                                         # (0 while waiting; after recompute they may include outputs)
    num_prompt_logprobs: int = 0         # prompt positions whose logits were returned (prompt_logprobs):
                                         # kept across preemption, so a recompute asks for none twice
    # timestamps (seconds, caller's clock)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    prompt: str | None = None            # the prompt's text when it came as text (RequestOutput.prompt)

    # --- sizes -------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: what admission must be able to fit."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than one token is waiting for K/V (a prompt, or a recompute re-prefill)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens > 1

    @property
    def wants_prompt_rows(self) -> bool:
        """Does this request still need logits of prompt rows (``params.prompt_logprobs``)? Row ``p``
        scores prompt token ``p + 1``, so rows ``0 .. num_prompt_tokens - 2`` are needed, once each."""
        return (self.params.prompt_logprobs is not None
                and self.num_prompt_logprobs < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # --- transitions ---------------------------------------------------------------------------
    def append_token(self, token_id: int, now: float) -> bool:
        """Record a sampled token; finish the sequence if it hit EOS, a stop id or max_tokens.

        A stop id ends the request only once ``min_tokens`` tokens came before it (the sampler bans
        stop ids until then, so this matters only for a runner that does not: the simulator's).

        Returns True when the sequence finished with this token.
        """
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now
        p = self.params
        stop_id = (not p.ignore_eos and token_id == self.eos_token_id) or token_id in p.stop_token_ids
        if stop_id and len(self.output_token_ids) > p.min_tokens:
            self.finish(FinishReason.STOP, now)
        elif len(self.output_token_ids) >= p.max_tokens:
            self.finish(FinishReason.LENGTH, now)
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = now
        self.error = error
        self.slot_id = None

