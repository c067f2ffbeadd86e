"""Choosing the next token: greedy, or temperature / top-k / top-p with a per-request generator.

Why per request: if all requests shared one random generator, the token a request draws would depend
on how many draws its batch neighbours made before it, so its output would change with the schedule.
Each request with a ``seed`` owns a ``torch.Generator`` seeded once and advanced exactly one draw per
generated token, so its tokens are the same alone, in a batch of 8, under any policy, and across
preemptions (the generator lives in the engine, not in the preempted state).

The filters are applied in vLLM's order: temperature, then top-k, then top-p (nucleus), then a draw
from the renormalised distribution. ``temperature == 0`` is greedy argmax and draws nothing.

**One row never fails another.** Every row is sampled on its own, and the distribution a row draws
from is valid by construction, whatever its logits hold:

* the logits are shifted so their maximum is 0 *before* dividing by the temperature, so even the
  smallest temperature ``SamplingParams`` accepts cannot overflow to ``inf - inf = nan``;
* a NaN logit is a token the model could not score: it is never drawn (it counts as ``-inf``);
* ``+inf`` logits share all the probability between them (the limit of very large logits);
* a row with no usable logit at all (every one NaN or ``-inf``: a broken forward) draws uniformly.

Greedy rows are a plain ``argmax``, which never raises either (it treats NaN as the largest value,
as the padded baseline does).

So ``torch.multinomial`` never sees a bad distribution, and nothing one request asks for (or one
row's numbers) can raise in the middle of a batch and take the other requests of the step with it.

**Per-row processors** (``minicb.runtime.logits_processors``: a grammar's mask, ...) are built when a
request is registered and applied to its row only, before the filters; a row without any is sampled
exactly as before (the batched greedy ``argmax`` included), so a request without them gets the same
tokens whatever its neighbours ask for.
"""

from __future__ import annotations

import secrets

import torch

from minicb.core.sampling_params import SamplingParams
from minicb.runtime.logits_processors import RowProcessor, build_processors


def usable_scores(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (``[V]``) as float64 scores whose maximum is exactly 0 and that hold no NaN.

    NaN becomes ``-inf`` (never drawn); if any logit is ``+inf``, those tokens get 0 and every other
    ``-inf`` (they share the mass); if nothing finite is left, every token gets 0 (uniform).
    """
    x = logits.to(torch.float64)
    x = x.masked_fill(torch.isnan(x), float("-inf"))
    top = torch.isposinf(x)
    if bool(top.any()):
        return torch.full_like(x, float("-inf")).masked_fill(top, 0.0)
    m = x.max()
    if not bool(torch.isfinite(m)):
        return torch.zeros_like(x)
    return x - m


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scale by temperature and mask (to -inf) what top-k and top-p exclude. ``logits``: ``[V]``.

    The result's maximum is 0 (``usable_scores``), so ``softmax`` of it is always a distribution."""
    x = usable_scores(logits) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class Sampler:
    """Holds one generator per live request and samples rows of a logits matrix.

    An unseeded request gets its seed from the sampler's own generator, which is seeded with ``seed``
    (repeatable runs) or, without one, from the operating system's entropy: a ``torch.Generator``
    left alone starts from the same constant in every process, so every unseeded request of every
    run would draw the same tokens."""

    def __init__(self, seed: int | None = None, *, tokenizer=None, vocab_size: int | None = None,
                 eos_token_id: int | None = None) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._processors: dict[str, list[RowProcessor]] = {}
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._fallback = torch.Generator()
        self._fallback.manual_seed(secrets.randbits(63) if seed is None else seed)

    def register(self, request_id: str, params: SamplingParams, prompt_token_ids=()) -> None:
        """Keep what ``request_id`` samples with: its processors (built first: a bad grammar raises
        ``InvalidArgument`` before anything is kept) and, unless greedy, its seeded generator."""
        if params.structured_outputs is not None:
            procs = build_processors(params, prompt_token_ids, vocab_size=self.vocab_size,
                                     eos_token_id=self.eos_token_id, tokenizer=self.tokenizer)
            if procs:
                self._processors[request_id] = procs
        if params.greedy:
            return
        seed = params.seed
        if seed is None:   # unseeded: a fresh seed from the engine's generator, still per request
            seed = int(torch.randint(0, 2**62, (1,), generator=self._fallback))
        self._generators[request_id] = torch.Generator().manual_seed(seed)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._processors.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: tuple[str, ...],
               params: list[SamplingParams]) -> list[int]:
        """One token per row; row ``i`` belongs to ``request_ids[i]``."""
        greedy = None
        if all(p.greedy for p in params):
            # widening bfloat16 is exact (the same argmax) and torch's float argmax is ~3x faster on the CPU
            wide = logits.float() if logits.dtype == torch.bfloat16 else logits
            greedy = torch.argmax(wide, dim=-1).tolist()
            if not self._processors:
                return greedy
        out = []
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            procs = self._processors.get(rid)
            if procs is None:          # untouched: the batched argmax, or the row as it is
                out.append(greedy[i] if greedy is not None else sample_token(logits[i], p,
                                                                             self._generators.get(rid)))
                continue
            row = logits[i]
            for proc in procs:
                row = proc.process(row)
            token = sample_token(row, p, self._generators.get(rid))
            for proc in procs:
                proc.accept(token)
            out.append(token)
        return out
