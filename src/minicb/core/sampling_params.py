"""``SamplingParams``: how one request wants its tokens chosen (vLLM's name and fields).

Torch-free: the scheduler reads ``max_tokens``, ``stop_token_ids`` and ``ignore_eos``; only
``minicb.runtime.sampling`` (which imports torch) reads the rest. Validation happens here, at construction, so
a bad value is reported before any work starts.

* ``temperature == 0`` means greedy (argmax); ``top_k == 0`` means no top-k; ``top_p == 1`` no top-p.
* ``seed`` gives the request its own random generator, so its tokens do not depend on which other
  requests share its batch (the per-request generator is the whole trick).
* ``n`` (parallel sampling): the request forks into ``n`` children after its prompt, which share the
  prompt's KV blocks (``minicb.core.block_manager``) and sample on their own. Child ``i`` of a request
  with ``seed=s`` samples with seed ``s + i`` (vLLM V1's rule, ``child_params``), so it draws exactly
  the tokens of the same request run alone with ``n=1, seed=s + i``. The scheduler bounds ``n``
  (``SchedulerConfig.max_n``), so one request cannot cost unboundedly many sequences.
* ``logprobs = k`` returns, for every generated token, its log-probability, its rank and the ``k``
  most likely tokens' (``0``: the sampled token's alone); ``prompt_logprobs = k`` the same for every
  prompt token but the first (``RequestOutput.prompt_logprobs``). ``None`` (the default) computes
  nothing. At most ``MAX_LOGPROBS`` (vLLM's default ``max_logprobs``). Which distribution they are
  of is ``minicb.runtime.logprobs``'s docstring: the model's, after the per-request logits
  processors, before temperature, top-k and top-p.
* ``structured_outputs`` (``StructuredOutputsParams``: a JSON schema, a regex, a choice, a grammar)
  constrains the output with a per-row token mask (``minicb.runtime.grammar``); it cannot be combined
  with ``ignore_eos`` (the grammar ends a request by allowing only EOS once it is complete).

The knobs beyond those, with vLLM's names and meaning (applied per row by
``minicb.runtime.logits_processors``, each off at its default):

* ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (OpenAI's range): subtracted once per token
  generated at least once / once per time it was generated;
* ``repetition_penalty`` > 0 (1 = off): over prompt and generated tokens, a positive logit divided by
  it, a negative one multiplied;
* ``logit_bias``: token id -> bias in [-100, 100] (OpenAI's), given as a dict or as pairs, kept as a
  tuple of ``(id, bias)`` pairs sorted by id (so the parameters stay hashable);
* ``min_p`` in [0, 1]: tokens whose probability is below ``min_p`` times the top token's are dropped
  (a filter beside top-k / top-p; greedy rows are unaffected);
* ``min_tokens`` in [0, max_tokens]: EOS and ``stop_token_ids`` cannot end the request (nor be
  sampled) before that many tokens are generated;
* ``bad_words``: strings whose tokens may not be generated in sequence (the last token is banned
  whenever the others were just generated);
* ``include_stop_str_in_output``: a matched stop string stays in the text (``minicb serve``'s ``stop``);
* ``skip_special_tokens`` (default True): special tokens are left out of the decoded text.

Which outputs a request gets (``output_kind``, vLLM's ``RequestOutputKind``): by default
(``CUMULATIVE``) one every step it gets a token, carrying the whole text so far and what the step
added (``new_text``: vLLM's ``DELTA`` in the same object, so ``DELTA`` behaves the same here).
``FINAL_ONLY`` makes no output until the request has finished (its text is decoded once, at the end):
what ``LLM.generate`` and the simulator want, and it saves a copy of every token list every step.

What is accepted is what has a meaning. A temperature between 0 and ``MIN_TEMPERATURE`` is refused
rather than silently treated as greedy: dividing logits by 1e-320 gives infinities, and a value that
small says "greedy" in a way the caller should spell ``0``. Every number may be a Python number, a
numpy scalar or a 0-d tensor; the fields always hold plain ``int`` / ``float`` values afterwards, so
equal parameters compare and hash equal whatever types they were built from.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from minicb.core.errors import InvalidArgument, check_float, check_int, describe
from minicb.core.structured_outputs import StructuredOutputsParams

# Below this a temperature has no sampling meaning left (vLLM's _SAMPLING_EPS): use 0 for greedy.
MIN_TEMPERATURE = 1e-5
MAX_SEED = 2**63 - 1          # torch.Generator.manual_seed takes a signed 64-bit integer
MAX_INT = 2**63 - 1           # counts and ids beyond int64 mean nothing (no tensor can index them)
MAX_LOGPROBS = 20             # the most top logprobs a request may ask for (vLLM's max_logprobs, OpenAI's 20)


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request gets (vLLM's names and values; module docstring)."""

    CUMULATIVE = 0     # every step it gets a token: the whole output so far (and the step's delta)
    DELTA = 1          # the same here: each output carries both
    FINAL_ONLY = 2     # only the final one, once the request has finished


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    cache_salt: str | None = None        # vLLM's: requests share prefix-cache blocks only with equal salts
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        set_ = object.__setattr__           # frozen: normalise once, here
        set_(self, "max_tokens", _int64("max_tokens", self.max_tokens, lo=1))
        t = check_float("temperature", self.temperature, lo=0.0, finite=True)
        if 0.0 < t < MIN_TEMPERATURE:
            raise InvalidArgument(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE} "
                                  f"(smaller values overflow the logits), got {t!r}")
        set_(self, "temperature", t)
        set_(self, "top_k", _int64("top_k", self.top_k, lo=0))
        set_(self, "top_p", check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True))
        if self.seed is not None:
            set_(self, "seed", check_int("seed", self.seed, lo=0, hi=MAX_SEED))
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise InvalidArgument("stop_token_ids must be a tuple of token ids")
        set_(self, "stop_token_ids", tuple(_int64("stop_token_ids[i]", t, lo=0)
                                           for t in self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool, got {describe(getattr(self, name))}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(self, name, check_int(name, getattr(self, name), lo=0, hi=MAX_LOGPROBS))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, check_float(name, getattr(self, name), lo=-2.0, hi=2.0))
        set_(self, "repetition_penalty", check_float("repetition_penalty", self.repetition_penalty, lo=0.0,
                                                     lo_open=True, finite=True))
        set_(self, "min_p", check_float("min_p", self.min_p, lo=0.0, hi=1.0))
        set_(self, "min_tokens", _int64("min_tokens", self.min_tokens, lo=0))
        if self.min_tokens > self.max_tokens:
            raise InvalidArgument(f"min_tokens must be at most max_tokens ({self.max_tokens}), "
                                  f"got {self.min_tokens}")
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (tuple, list)):
            raise InvalidArgument("bad_words must be a list of strings")
        if not all(isinstance(w, str) for w in self.bad_words):
            raise InvalidArgument("bad_words must be a list of strings")
        set_(self, "bad_words", tuple(self.bad_words))
        set_(self, "n", _int64("n", self.n, lo=1))
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            raise InvalidArgument("output_kind must be a RequestOutputKind (0, 1 or 2), got "
                                  f"{describe(self.output_kind)}")
        set_(self, "output_kind", RequestOutputKind(self.output_kind))
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidArgument(f"cache_salt must be a non-empty string, got {describe(self.cache_salt)}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidArgument("structured_outputs must be a StructuredOutputsParams, got "
                                      f"{type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                raise InvalidArgument("structured_outputs cannot be combined with ignore_eos: a complete "
                                      "grammar ends the request with EOS")
            if self.min_tokens:
                raise InvalidArgument("structured_outputs cannot be combined with min_tokens: a complete "
                                      "grammar ends the request with EOS, whatever its length")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child_params(self, index: int) -> SamplingParams:
        """The parameters child ``index`` of a request with ``n`` children samples with: ``n=1`` and,
        when the request has a seed ``s``, seed ``s + index`` (vLLM V1's ``ParentRequest`` rule,
        wrapping at 2**63; an unseeded child gets its own fresh seed from the sampler). The prompt's
        logprobs are the request's: child 0 alone asks for them (it prefills the prompt for all; a
        later child never recomputes prompt rows). Child 0 of ``n=1`` is ``self``."""
        check_int("index", index, lo=0, hi=self.n - 1)
        if self.n == 1:
            return self
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """A dict or pairs of token id -> bias, as a tuple of ``(id, bias)`` pairs sorted by id."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)):
        pairs = list(value)
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
            raise InvalidArgument("logit_bias must be a dict of token id -> bias or (token id, bias) pairs")
    else:
        raise InvalidArgument(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}")
    out = {}
    for t, b in pairs:
        t = _int64("logit_bias token id", t, lo=0)
        if t in out:
            raise InvalidArgument(f"logit_bias gives token id {t} twice")
        out[t] = check_float(f"logit_bias[{t}]", b, lo=-100.0, hi=100.0)
    return tuple(sorted(out.items()))


def _int64(name: str, value, lo: int) -> int:
    """``check_int(name, value, lo=lo)`` (message ``[lo, inf]``), and at most ``MAX_INT``: beyond a
    64-bit integer a count or a token id means nothing, and could not even be printed in a message."""
    v = check_int(name, value, lo=lo)
    if v > MAX_INT:
        raise InvalidArgument(f"{name} must be at most 2**63 - 1 (a 64-bit integer), got {describe(v)}")
    return v
