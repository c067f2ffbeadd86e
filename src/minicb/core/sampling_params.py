"""``SamplingParams``: how one request wants its tokens chosen (vLLM's name and fields).

Torch-free: the scheduler reads ``max_tokens``, ``stop_token_ids`` and ``ignore_eos``; only
``minicb.runtime.sampling`` (which imports torch) reads the rest. Validation happens here, at construction, so
a bad value is reported before any work starts.

* ``temperature == 0`` means greedy (argmax); ``top_k == 0`` means no top-k; ``top_p == 1`` no top-p.
* ``seed`` gives the request its own random generator, so its tokens do not depend on which other
  requests share its batch (the per-request generator is the whole trick).
* ``structured_outputs`` (``StructuredOutputsParams``: a JSON schema, a regex, a choice, a grammar)
  constrains the output with a per-row token mask (``minicb.runtime.grammar``); it cannot be combined
  with ``ignore_eos`` (the grammar ends a request by allowing only EOS once it is complete).

What is accepted is what has a meaning. A temperature between 0 and ``MIN_TEMPERATURE`` is refused
rather than silently treated as greedy: dividing logits by 1e-320 gives infinities, and a value that
small says "greedy" in a way the caller should spell ``0``. Every number may be a Python number, a
numpy scalar or a 0-d tensor; the fields always hold plain ``int`` / ``float`` values afterwards, so
equal parameters compare and hash equal whatever types they were built from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minicb.core.errors import InvalidArgument, check_float, check_int, describe
from minicb.core.structured_outputs import StructuredOutputsParams

# Below this a temperature has no sampling meaning left (vLLM's _SAMPLING_EPS): use 0 for greedy.
MIN_TEMPERATURE = 1e-5
MAX_SEED = 2**63 - 1          # torch.Generator.manual_seed takes a signed 64-bit integer
MAX_INT = 2**63 - 1           # counts and ids beyond int64 mean nothing (no tensor can index them)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None

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
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidArgument("structured_outputs must be a StructuredOutputsParams, got "
                                      f"{type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                raise InvalidArgument("structured_outputs cannot be combined with ignore_eos: a complete "
                                      "grammar ends the request with EOS")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _int64(name: str, value, lo: int) -> int:
    """``check_int(name, value, lo=lo)`` (message ``[lo, inf]``), and at most ``MAX_INT``: beyond a
    64-bit integer a count or a token id means nothing, and could not even be printed in a message."""
    v = check_int(name, value, lo=lo)
    if v > MAX_INT:
        raise InvalidArgument(f"{name} must be at most 2**63 - 1 (a 64-bit integer), got {describe(v)}")
    return v
