"""Per-request logits processors: how per-row state lives inside one flat batch.

A step's forward returns one row of logits per request that samples (``[num_rows, V]``), and the rows
belong to unrelated requests: one asks for a repetition penalty over its own prompt, its neighbour for
a logit bias, a third for nothing at all. So everything a knob needs is kept **per request**, outside
the batch, and applied to that request's row only::

    step t:  rows = [ r7 | r2 | r9 ]            (whoever reached the end of its scheduled tokens)
             for each row i:  x = logits[i]
                              for p in processors[request_ids[i]]:  x = p.process(x)
                              token = filters + draw (temperature, min_p, top-k, top-p)
             for each row i:  for p in processors[request_ids[i]]:  p.accept(token_i)

A ``RowProcessor`` is built once, when the request is registered with the sampler (it sees the
prompt's token ids then), and is told every token the request generates (``accept``). Nothing in it
depends on which rows share the step, on their order, or on how many there are, so a request's tokens
are the same alone and in any batch (*batch independence*, the same trick as the per-request generator
of ``minicb.runtime.sampling``).

**Where the state lives, and why preemption cannot break it.** The processors live in the sampler,
keyed by request id, from ``register`` (the request is queued) to ``release`` (it finished). Preemption
touches neither: a swapped request keeps them while its KV blocks sit in host memory; a recomputed one
feeds its prompt and generated tokens again as one long prefill, and that prefill samples once, at its
end, exactly like the decode it replaces. So ``accept`` is called exactly once per generated token,
whatever the schedule, and a count of generated tokens (``min_tokens``) or a histogram of them
(penalties) is right after any number of preemptions. (A step that fails ends all its requests, and
``accept`` runs only after every row of the step is sampled, so a half-sampled step changes nothing.)

The knobs, in vLLM's order (``Sampler.sample`` applies them in this order, then the filters):

===================  ==================================================================================
``bad_words``        a word's last token is banned (-inf) when the tokens generated so far end with the
                     word's other tokens
``min_tokens``       EOS and ``stop_token_ids`` are banned until ``min_tokens`` tokens are generated
``logit_bias``       ``logits[t] += bias`` (OpenAI's table of token id -> bias in [-100, 100])
penalties            ``repetition_penalty`` over prompt + generated tokens (a positive logit divided by
                     it, a negative one multiplied), then ``frequency_penalty * count`` and
                     ``presence_penalty * (count > 0)`` subtracted, counts over generated tokens
grammar              a structured output's token mask (``minicb.runtime.grammar``), last: it always holds
===================  ==================================================================================

``min_p`` is not a processor: like top-k and top-p it is a filter of the (temperature-scaled)
distribution, applied in ``minicb.runtime.sampling.filter_logits`` (vLLM applies it after temperature,
before top-k/top-p, and not to greedy rows: it never changes the argmax).

Every processor works on a float64 copy of its row and never writes into the input. Processors keep
their state sparse (a ``dict`` of counts, a ``set`` of seen ids): a vocabulary-sized tensor per live
request would cost ``V x 8`` bytes each (400 KB for SmolLM2, 100 MB at 256 requests) for rows that
use a few hundred distinct tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minicb.core.sampling_params import SamplingParams


class RowProcessor:
    """Per-request state that edits that request's row of logits before the sampler's filters.

    ``process`` maps a ``[V]`` row to a new ``[V]`` row (float32 or float64, never in place on the
    input), or raises ``minicb.core.errors.RowFailed`` to end its request with an error; ``accept``
    is called once for every token the request generates, after the step's rows are all sampled."""

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def accept(self, token_id: int) -> None:
        """Nothing to remember by default."""


def _ids(ids) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long)


class BadWords(RowProcessor):
    """vLLM's ``bad_words``: each word is a token sequence; its last token is banned whenever the
    generated tokens end with the others (a one-token word is always banned). Only generated tokens
    count, not the prompt (vLLM's rule)."""

    def __init__(self, words: Sequence[Sequence[int]]) -> None:
        self.words = [tuple(w) for w in words if w]
        self.longest = max((len(w) for w in self.words), default=0)
        self.recent: list[int] = []                 # the last ``longest - 1`` generated tokens

    def banned(self) -> set[int]:
        out = set()
        for w in self.words:
            k = len(w) - 1
            if k == 0 or (k <= len(self.recent) and tuple(self.recent[len(self.recent) - k:]) == w[:k]):
                out.add(w[-1])
        return out

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.to(torch.float64, copy=True)
        ban = self.banned()
        if ban:
            x[_ids(ban)] = float("-inf")
        return x

    def accept(self, token_id: int) -> None:
        if self.longest > 1:
            self.recent.append(token_id)
            del self.recent[:len(self.recent) - (self.longest - 1)]


class MinTokens(RowProcessor):
    """vLLM's ``min_tokens``: the stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) get
    -inf while fewer than ``min_tokens`` tokens have been generated."""

    def __init__(self, min_tokens: int, stop_ids: Sequence[int]) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = _ids(sorted(set(stop_ids)))
        self.generated = 0

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.to(torch.float64, copy=True)
        if self.generated < self.min_tokens and self.stop_ids.numel():
            x[self.stop_ids] = float("-inf")
        return x

    def accept(self, token_id: int) -> None:
        self.generated += 1


class LogitBias(RowProcessor):
    """OpenAI's ``logit_bias``: a fixed bias added to the logits of the given token ids."""

    def __init__(self, bias: Sequence[tuple[int, float]]) -> None:
        self.ids = _ids(t for t, _ in bias)
        self.values = torch.tensor([b for _, b in bias], dtype=torch.float64)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.to(torch.float64, copy=True)
        x[self.ids] += self.values
        return x


class Penalties(RowProcessor):
    """vLLM's repetition, frequency and presence penalties, in that order.

    * ``repetition_penalty`` (1 = off), over every token of the prompt and of the output: a positive
      logit is divided by it, a negative one multiplied (so > 1 always makes the token less likely);
    * ``frequency_penalty`` (0 = off): ``count(t) * frequency_penalty`` subtracted, count over the
      generated tokens;
    * ``presence_penalty`` (0 = off): ``presence_penalty`` subtracted once for every token generated
      at least once."""

    def __init__(self, repetition: float, frequency: float, presence: float,
                 prompt_token_ids: Sequence[int]) -> None:
        self.repetition, self.frequency, self.presence = repetition, frequency, presence
        self.prompt = set(prompt_token_ids)
        self.counts: dict[int, int] = {}

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.to(torch.float64, copy=True)
        if self.repetition != 1.0:
            seen = _ids(self.prompt | self.counts.keys())
            if seen.numel():
                v = x[seen]
                x[seen] = torch.where(v > 0, v / self.repetition, v * self.repetition)
        if self.counts and (self.frequency or self.presence):
            ids = _ids(self.counts)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float64)
            x[ids] -= self.frequency * counts + self.presence
        return x

    def accept(self, token_id: int) -> None:
        self.counts[token_id] = self.counts.get(token_id, 0) + 1


def bad_words_token_ids(words: Sequence[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as it would start the text (no leading space)
    and, when that is a different token sequence of the same length, as it would appear after a space
    (byte-level BPE spells ``" cat"`` and ``"cat"`` with different tokens)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            continue
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def build_processors(params: SamplingParams, prompt_token_ids: Sequence[int] = (), *, vocab_size: int,
                     eos_token_id: int | None, tokenizer=None) -> list[RowProcessor]:
    """The processors ``params`` asks for, in the order they apply (empty: a plain row).

    A structured output's grammar mask (``minicb.runtime.grammar``) comes last, so no knob can make
    the output break the grammar: if the knobs banned every token the grammar allows (``min_tokens``
    banning the EOS a complete grammar needs), the mask's own fallback shares the probability among
    the grammar's tokens. Raises ``InvalidArgument`` for a constraint that cannot be built (a bad
    grammar, no tokenizer).

    ``vocab_size`` bounds the token ids the processors may touch (ids beyond it are ignored: the
    engine refuses such a request before it is registered); ``eos_token_id`` is the token
    ``min_tokens`` bans besides ``stop_token_ids``; ``tokenizer`` turns ``bad_words`` into token ids."""
    procs: list[RowProcessor] = []
    if params.bad_words and tokenizer is not None:
        words = [[t for t in w if 0 <= t < vocab_size]
                 for w in bad_words_token_ids(params.bad_words, tokenizer)]
        procs.append(BadWords([w for w in words if w]))
    if params.min_tokens > 0:
        stops = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stops.append(eos_token_id)
        stops = [t for t in stops if 0 <= t < vocab_size]
        if stops:
            procs.append(MinTokens(params.min_tokens, stops))
    bias = [(t, b) for t, b in params.logit_bias if t < vocab_size and b != 0.0]
    if bias:
        procs.append(LogitBias(bias))
    if params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        procs.append(Penalties(params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
                               [t for t in prompt_token_ids if 0 <= t < vocab_size]))
    if params.structured_outputs is not None:     # last: whatever the knobs did, the grammar holds
        from minicb.runtime.grammar import GrammarProcessor, new_matcher

        matcher = new_matcher(params.structured_outputs, tokenizer, vocab_size, eos_token_id)
        procs.append(GrammarProcessor(matcher, vocab_size, eos_token_id))
    return procs
