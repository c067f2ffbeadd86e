"""Choosing the next token: greedy, or temperature / top-k / top-p with a per-request generator.

Why per request: if all requests shared one random generator, the token a request draws would depend
on how many draws its batch neighbours made before it, so its output would change with the schedule.
Each request with a ``seed`` owns a ``torch.Generator`` seeded once and advanced exactly one draw per
generated token, so its tokens are the same alone, in a batch of 8, under any policy, and across
preemptions (the generator lives in the engine, not in the preempted state).

The filters are applied in vLLM's order: temperature, then min-p, then top-k, then top-p (nucleus),
then a draw from the renormalised distribution. ``temperature == 0`` is greedy argmax and draws nothing.

Before the filters, a row goes through its request's *logits processors* (penalties, ``logit_bias``,
``min_tokens``, ``bad_words``, a structured output's grammar mask: ``minicb.runtime.logits_processors``),
built once at ``register`` from the request's parameters and prompt, applied to that row only, and
told the token it drew. A row without any is sampled exactly as before (the batched greedy ``argmax``
included), so a request without them gets the same tokens whatever its neighbours ask for; a batch
in which no row has a processor and every row is greedy is one ``argmax`` over the whole matrix, as
before processors existed.

**One row never fails another.** Every row is sampled on its own, and the distribution a row draws
from is valid by construction, whatever its logits hold:

* the logits are shifted so their maximum is 0 *before* dividing by the temperature, so even the
  smallest temperature ``SamplingParams`` accepts cannot overflow to ``inf - inf = nan``;
* a NaN logit is a token the model could not score: it is never drawn (it counts as ``-inf``);
* ``+inf`` logits share all the probability between them (the limit of very large logits);
* a row with no usable logit at all (every one NaN or ``-inf``) draws uniformly.

**A broken forward is an error, not a draw.** Those rules keep ``sample_token`` total, but the model's
own row is checked first: a row whose largest logit is not finite (a NaN anywhere, a ``+inf``, or no
finite logit at all: damaged weights, an overflow) ends *its* request with ``finish_reason ==
"error"`` (a ``RowOutput`` with an ``error``, ``unscorable_rows``) instead of returning a token drawn
from a fallback, which would be garbage that looks like an answer. So does a processor that raises
``RowFailed`` (a grammar whose matcher broke). Either way the other rows of the step are sampled as
if nothing happened.

Greedy rows are a plain ``argmax``, which never raises either (it treats NaN as the largest value,
as the padded baseline does).

So ``torch.multinomial`` never sees a bad distribution, and nothing one request asks for (or one
row's numbers) can raise in the middle of a batch and take the other requests of the step with it.
"""

from __future__ import annotations

import operator
import secrets

import torch

from minicb.core.errors import RowFailed
from minicb.core.sampling_params import SamplingParams
from minicb.engine.logprobs import RowOutput, TokenLogprobs
from minicb.runtime.logits_processors import RowProcessor, build_processors
from minicb.runtime.logprobs import row_logprobs

_temperature = operator.attrgetter("temperature")


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first maximum of each row (the first NaN where there is one), as ``argmax`` says. torch's
    bfloat16 argmax is slow on the CPU, and so is widening the logits first; ``max``'s indices are the
    same tokens."""
    if logits.dtype == torch.bfloat16:
        return torch.max(logits, dim=-1).indices.tolist()
    return torch.argmax(logits, dim=-1).tolist()


NOT_FINITE = ("the model's logits for this request are not finite (NaN or infinity: damaged weights or "
              "an overflow in the forward), so no token can be chosen")


def unscorable_rows(logits: torch.Tensor, greedy: list[int] | None = None) -> list[int]:
    """The rows whose largest logit is not finite: a NaN anywhere in the row (``max`` and ``argmax``
    propagate it), a ``+inf``, or no finite logit at all. ``greedy``: the rows' argmax tokens when
    they are known already, so the check reads one value per row instead of the whole matrix."""
    if not logits.shape[0] or not logits.shape[-1]:
        return []
    if greedy is not None:
        top = logits.gather(1, torch.tensor(greedy, device=logits.device)[:, None])[:, 0]
    else:
        top = logits.amax(dim=-1)
    bad = ~torch.isfinite(top)
    return bad.nonzero().flatten().tolist() if bool(bad.any()) else []


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
    if params.min_p > 0.0:
        # vLLM's min-p: drop tokens less likely than min_p times the most likely one (after temperature)
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
                 eos_token_id: int | None = None, argmax=None) -> None:
        # a faster greedy argmax, or None (``greedy_tokens``, ``unscorable_rows``): handed in by whoever
        # built the runner (the fast paths' one C pass, ``minicb.fastpaths.cpu_fused.greedy_argmax``: 1.0
        # against ``max``'s 2.7 ms for 64 x 49,152 bfloat16 logits on a Zen 4 core, ``python
        # bench/sampler_rows.py --bfloat16``), it returns both answers, or None for logits it does not take
        self.argmax = argmax
        self._generators: dict[str, torch.Generator] = {}
        self._processors: dict[str, list[RowProcessor]] = {}     # only requests that have some
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._fallback = torch.Generator()
        self._fallback.manual_seed(secrets.randbits(63) if seed is None else seed)

    def register(self, request_id: str, params: SamplingParams, prompt_token_ids=(), *,
                 vocab_size: int | None = None, eos_token_id: int | None = None, tokenizer=None) -> None:
        """Keep what ``request_id`` samples with: its processors (built first from ``params`` and the
        prompt: a bad grammar raises ``InvalidArgument`` before anything is kept) and, unless greedy,
        its seeded generator. ``vocab_size``, ``eos_token_id`` and ``tokenizer`` default to the
        sampler's own (``vocab_size`` bounds the ids a processor touches)."""
        vocab = vocab_size or self.vocab_size
        procs = build_processors(params, prompt_token_ids, vocab_size=vocab or 2**63 - 1,
                                 eos_token_id=self.eos_token_id if eos_token_id is None else eos_token_id,
                                 tokenizer=self.tokenizer if tokenizer is None else tokenizer)
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
               params: list[SamplingParams]) -> list[int | RowOutput]:
        """One token per row; row ``i`` belongs to ``request_ids[i]``. A row that cannot be sampled
        (its logits are not finite, a processor raised ``RowFailed``) gets ``RowOutput(error=...)``
        instead of a token; its processors hear nothing.

        Each row with processors goes through them first (in order); every processor then hears its
        row's token, once all rows are sampled (so a row that raises leaves no processor advanced).
        A row without processors is sampled as if there were none anywhere (the batched argmax of an
        all-greedy step included)."""
        return self._sample(logits, request_ids, params, None)

    def sample_with_logprobs(self, logits: torch.Tensor, request_ids: tuple[str, ...],
                             params: list[SamplingParams]
                             ) -> tuple[list[int | RowOutput], list[TokenLogprobs | None]]:
        """``sample``, and for each row whose request asks for ``logprobs = k`` the sampled token's
        logprob, rank and the row's top-k (None for the others), taken from the row the token was
        drawn from: after the request's processors, before temperature / top-k / top-p
        (``minicb.runtime.logprobs`` says why)."""
        lps: list[TokenLogprobs | None] = [None] * len(params)
        return self._sample(logits, request_ids, params, lps), lps

    def _sample(self, logits: torch.Tensor, request_ids: tuple[str, ...], params: list[SamplingParams],
                lps: list | None) -> list[int | RowOutput]:
        procs = self._processors
        greedy = broken = None
        if not any(map(_temperature, params)):            # every row greedy (SamplingParams.greedy)
            found = None if self.argmax is None else self.argmax(logits)
            greedy, broken = found if found is not None else (greedy_tokens(logits), None)
        if broken is None:
            broken = unscorable_rows(logits, greedy)
        plain = lps is None and not (procs and any(r in procs for r in request_ids))   # no extra per row
        if greedy is not None and not broken and plain:
            return greedy
        tokens: list[int | RowOutput] = []
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if broken and i in broken:
                tokens.append(RowOutput(error=NOT_FINITE))
                continue
            mine = procs.get(rid)
            row = logits[i]
            if mine is None:           # untouched: the batched argmax, or the row as it is
                token = greedy[i] if greedy is not None else sample_token(row, p, self._generators.get(rid))
            else:
                try:
                    for proc in mine:
                        row = proc.process(row)
                except RowFailed as e:
                    tokens.append(RowOutput(error=str(e)))
                    continue
                token = sample_token(row, p, self._generators.get(rid))
            if lps is not None and p.logprobs is not None:     # the row sampled from, before accept()
                lps[i] = row_logprobs(row[None], [token], p.logprobs)[0]
            tokens.append(token)
        for rid, token in zip(request_ids, tokens):
            if not isinstance(token, RowOutput):
                for proc in procs.get(rid, ()):
                    proc.accept(token)
        return tokens
