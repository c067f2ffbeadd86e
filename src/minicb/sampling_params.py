"""``SamplingParams``: how one request wants its tokens chosen (vLLM's name and fields).

Torch-free: the scheduler reads ``max_tokens``, ``stop_token_ids`` and ``ignore_eos``; only
``minicb.sampling`` (which imports torch) reads the rest. Validation happens here, at construction, so
a bad value is reported before any work starts.

* ``temperature == 0`` means greedy (argmax); ``top_k == 0`` means no top-k; ``top_p == 1`` no top-p.
* ``seed`` gives the request its own random generator, so its tokens do not depend on which other
  requests share its batch (the per-request generator is the whole trick).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minicb.errors import InvalidArgument, check_float, check_int


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, lo=1)
        check_float("temperature", self.temperature, lo=0.0)
        check_int("top_k", self.top_k, lo=0)
        check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        if self.seed is not None:
            check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise InvalidArgument("stop_token_ids must be a tuple of token ids")
        for t in self.stop_token_ids:
            check_int("stop_token_ids[i]", t, lo=0)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
