"""What a runner returns for one row, and the logprobs a request collects from it (no torch).

A step's runner returns one value per request whose row produced something (``Runner.run``)::

    {request_id: 17}                            a sampled token, nothing else asked for (the usual case)
    {request_id: RowOutput(token=17,            the same token with what the request asked for:
                           logprobs=...,        its logprob, rank and the top-k (SamplingParams.logprobs)
                           prompt=...)}         logprobs of prompt tokens this chunk scored (prompt_logprobs)
    {request_id: RowOutput(error="...")}       this request's row failed (its logits are not finite,
                                                its grammar's matcher broke): the request ends with
                                                ``finish_reason == "error"`` and this message, and the
                                                other rows of the step go on

A plain ``int`` stays the common answer, so a runner that knows nothing of logprobs (a test's, the
simulator's) is still a runner. Everything here is plain Python (ints, floats, tuples): the tensors
stay in the runner, and the engine stays torch-free.

The engine turns the rows into vLLM's shapes on the request's output (``RequestOutput.logprobs``:
one ``{token_id: Logprob}`` per generated token, the sampled token first, then the top-k;
``RequestOutput.prompt_logprobs``: the same per prompt token, ``None`` for the first, which nothing
predicts). ``PromptLogprobs`` keeps the first copy of each prompt position: a request preempted by
recompute computes some prompt rows again, and a chunk may be returned twice, never counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class Logprob:
    """One token's entry (vLLM's ``Logprob``): its log-probability, its rank in the distribution
    (1 = the most likely) and, when the engine has a tokenizer, its text alone."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """What one row says about one token: ``token_id``'s logprob and rank, then the ``k`` most
    likely tokens of the row (best first) as parallel tuples."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def as_dict(self, decode=None) -> dict[int, Logprob]:
        """vLLM's ``{token_id: Logprob}``: the scored token first, then the top-k (a top token that is
        the scored one is not repeated). ``decode(id) -> str`` names each token."""
        name = (lambda _t: None) if decode is None else decode
        out = {self.token_id: Logprob(self.logprob, self.rank, name(self.token_id))}
        for i, (t, lp) in enumerate(zip(self.top_ids, self.top_logprobs)):
            if t not in out:
                out[t] = Logprob(lp, i + 1, name(t))
        return out


@dataclass(slots=True, frozen=True)
class RowOutput:
    """One request's result of a step beyond a bare token (see the module docstring).

    ``token`` is None for a prompt chunk that does not sample yet. ``prompt`` scores the prompt tokens
    at positions ``prompt_start, prompt_start + 1, ...`` (``prompt_start`` = the chunk's
    ``start_pos + 1``)."""

    token: int | None = None
    logprobs: TokenLogprobs | None = None
    prompt: tuple[TokenLogprobs, ...] = ()
    prompt_start: int = 1
    error: str | None = None            # this request's row failed: it ends with finish_reason "error"


@dataclass(slots=True)
class PromptLogprobs:
    """A request's prompt logprobs as they arrive chunk by chunk: position 0 is ``None``, and each
    later position is filled once, by the first row that scores it."""

    entries: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])

    def add(self, start: int, rows: tuple[TokenLogprobs, ...], decode=None) -> None:
        """Rows scoring positions ``start, start + 1, ...``; positions already held are skipped."""
        for i, row in enumerate(rows):
            pos = start + i
            if pos == len(self.entries):
                self.entries.append(row.as_dict(decode))
