"""Requests in: every argument of ``add_request`` checked, and a prompt turned into token ids, before
the engine changes anything.

A request that is wrong (a token id outside the vocabulary, text for an engine without a tokenizer,
an empty prompt, a ``priority`` that is not an integer) must fail *here*, with one clear
``InvalidArgument``, and leave the engine and every other request untouched. Checking is the
caller's cost, not the step loop's: nothing here runs inside a step.

Text is encoded with a bound (``max_tokens=max_model_len``: the tokenizer refuses text that cannot
fit before it encodes it all). Token ids given as a list are checked with C-speed builtins when they
are plain ints (``min`` / ``max`` over the list), and one by one only to name the bad one, or when they
are other integer types (numpy, torch scalars) that need converting. This module imports no torch.
"""

from __future__ import annotations

from minicb.core.errors import InvalidArgument, as_int, check_float, check_int, describe
from minicb.core.sampling_params import SamplingParams


def prompt_token_ids(prompt, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """Validate a prompt (text or token ids) and return its token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidArgument("prompt is text but the engine has no tokenizer; pass token ids")
        ids = tokenizer.encode(prompt, max_tokens=max_model_len)        # bounded first
        if ids and max(ids) >= vocab_size:
            raise InvalidArgument(f"prompt text encodes to token id {max(ids)}, outside the model's "
                                  f"vocabulary [0, {vocab_size - 1}]: the tokenizer does not match the model")
    elif isinstance(prompt, (list, tuple)):
        ids = _token_ids(prompt, vocab_size)
    else:
        hint = ("; add_request takes (request_id, prompt, params), the id first, as vLLM's LLMEngine does"
                if type(prompt).__name__ == "SamplingParams" else "")
        raise InvalidArgument(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"
                              f"{hint}")
    if not ids:
        raise InvalidArgument("prompt must not be empty: it needs at least 1 token (it has 0)")
    return ids


def _token_ids(prompt, vocab_size: int) -> list[int]:
    if all(type(t) is int for t in prompt) and (not prompt or 0 <= min(prompt) <= max(prompt) < vocab_size):
        return list(prompt)                      # the common case, at the speed of C
    return [token_id(t, i, vocab_size) for i, t in enumerate(prompt)]


def token_id(t, i: int, vocab_size: int) -> int:
    """A prompt token id as a plain int (numpy / torch integers welcome), checked against the vocabulary."""
    v = as_int(t)                 # bools and boolean tensors are not token ids
    if v is None or not 0 <= v < vocab_size:
        raise InvalidArgument(f"prompt token ids must be integers in [0, {vocab_size - 1}] (the vocabulary), "
                              f"got {describe(t)} at index {i}")
    return v


def checked_params(params) -> SamplingParams:
    """``params``, or the defaults for None; anything else than ``SamplingParams`` is refused."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidArgument(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    return params


def check_params_fit(params: SamplingParams, vocab_size: int, tokenizer) -> None:
    """What only the engine can judge about ``params``: ``logit_bias`` names tokens of this model's
    vocabulary, and ``bad_words`` (text) has a tokenizer to become token ids."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidArgument(f"logit_bias token ids must be in the vocabulary [0, {vocab_size - 1}], "
                              f"got {bad[0]}")
    if params.bad_words and tokenizer is None:
        raise InvalidArgument("bad_words needs a tokenizer (this engine has none): ban token ids with "
                              "logit_bias -100 instead")


# About one entry in a JSON response, '"12345": {"logprob": -1.2345678901234567, "rank": 12,
# "decoded_token": " word"}, ' (vLLM's shape; issue 46 saw a 12.6 MB body for 168,000 entries, 75 B
# each): what the refusal below quotes as the response's size.
LOGPROB_ENTRY_BYTES = 80


def logprob_entries(params: SamplingParams, num_prompt_tokens: int) -> int:
    """The logprob entries a request asks for: per scored row the token's own and the top-k."""
    entries = 0
    if params.prompt_logprobs is not None:
        entries += (num_prompt_tokens - 1) * (params.prompt_logprobs + 1)
    if params.logprobs is not None:
        entries += params.n * params.max_tokens * (params.logprobs + 1)
    return entries


def check_logprob_cost(params: SamplingParams, num_prompt_tokens: int, limit: int) -> None:
    """Refuse, before any work, a request whose logprobs would cost more than ``limit`` entries
    (``SchedulerConfig.max_logprob_entries``)."""
    entries = logprob_entries(params, num_prompt_tokens)
    if entries > limit:
        raise InvalidArgument(
            f"logprobs: this request asks for {entries:,} logprob entries (prompt tokens x "
            f"(prompt_logprobs + 1) + n x max_tokens x (logprobs + 1)), about "
            f"{entries * LOGPROB_ENTRY_BYTES / 1e6:,.0f} MB of response; the limit is {limit:,} "
            "(max_logprob_entries): ask for fewer top logprobs, fewer tokens or a shorter prompt")


def checked_request_id(rid) -> str:
    if not isinstance(rid, str) or not rid:
        raise InvalidArgument(f"request_id must be a non-empty str, got {rid!r}")
    return rid


def checked_priority(priority) -> int:
    return check_int("priority", priority)          # a plain int (numpy / torch ints too)


def checked_arrival_time(arrival_time) -> float:
    return check_float("arrival_time", arrival_time, finite=True)
