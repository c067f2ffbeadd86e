"""``RequestOutput``: what a request has produced so far, as the engine hands it out.

The scheduler keeps token ids; a user wants text that grows as tokens arrive. Byte-level BPE makes
that subtle: one character can span several tokens (an emoji is four bytes, often three tokens), so
text is produced by an incremental decoder that holds back an unfinished character until its last
byte arrives, and is flushed when the request ends (a request cut off by ``max_tokens`` in the
middle of a character still shows its bytes, as the tokenizer's ``decode`` would: U+FFFD).

``OutputTracker`` is the engine's per-sequence bookkeeping for that: the sequence, its decoder, the
text so far and how many tokens were already handed out (``new_token_ids`` / ``new_text`` are the
difference since the previous output of the same request).

**Parallel sampling** (``SamplingParams.n > 1``): a request has ``n`` sequences, and its output lists
one ``CompletionOutput`` per child in ``outputs`` (vLLM's shape: ``index`` is the child's number,
0 .. n - 1); ``RequestTracker`` joins the children's trackers. A request with ``n == 1`` has one
completion too, so ``outputs`` reads the same for every request. The flat fields (``token_ids``,
``text``, ``finish_reason``, ``new_*``) are those of ``outputs[0]``, so code written for ``n == 1``
reads as before; ``finished`` is True once *every* child has finished, ``first_token_time`` is the
earliest child's, ``finish_time`` the last one's, ``num_preemptions`` their sum.

Logprobs (``SamplingParams.logprobs`` / ``prompt_logprobs``) are vLLM's shapes: ``logprobs[i]`` is a
``{token_id: Logprob}`` for ``token_ids[i]`` (that token first, then the top-k), ``prompt_logprobs[j]``
the same for prompt token ``j`` (``None`` for ``j == 0``). Both are ``None`` when not asked for; the
tracker holds them beside the tokens they describe, so an output copies both or neither. With
``n > 1`` each ``CompletionOutput`` carries its child's ``logprobs``; ``prompt_logprobs`` are the
request's (child 0 prefills the prompt for all children, so it alone computes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minicb.core.sequence import Sequence
from minicb.engine.logprobs import Logprob, PromptLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One child's completion so far (vLLM's ``CompletionOutput``); ``index`` is its number in ``n``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)   # tokens added since the previous output
    new_text: str = ""
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None                 # one per token_ids entry

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far (complete once ``finished``); ``outputs`` holds each child's
    completion (one for ``n == 1``), the flat fields are ``outputs[0]``'s (module docstring)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)   # tokens added by the latest step
    new_text: str = ""
    error: str | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None                 # one per token_ids entry
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # one per prompt token
    prompt: str | None = None            # the prompt as text (vLLM's); None when it was given as token ids


@dataclass(slots=True)
class OutputTracker:
    """One live request's output state: its sequence, incremental decoder, text and tokens handed out.

    ``output()`` is all or nothing: it computes the new tokens and text first and changes the tracker
    only when nothing can fail any more, and the decoder's ``push_many`` is all or nothing too. So an
    exception while an output is made (in the detokenizer, say) leaves the tracker as it was, and the
    tokens it would have handed out go into the next output made: none is lost or handed out twice.
    """

    seq: Sequence
    decoder: object | None            # the tokenizer's incremental decoder, or None (token ids only)
    decode: object | None = None      # the tokenizer's full ``decode``: the text of a last resort output
    text: str = ""
    emitted: int = 0
    final: RequestOutput | None = None   # the finished request's last output, once made
    handed_out: bool = False             # ... and whether it went to the engine's outputs
    logprobs: list[dict[int, Logprob]] | None = None   # per output token, when params.logprobs is set
    prompt: PromptLogprobs | None = None               # when params.prompt_logprobs is set

    def output(self) -> RequestOutput:
        """The request's output now; advances what counts as already handed out."""
        s = self.seq
        n = len(s.output_token_ids)
        new = s.output_token_ids[self.emitted:n]
        finished = s.finish_reason is not None
        new_text = ""
        if self.decoder is not None:          # a trailing partial character is flushed at the end
            new_text = self.decoder.push_many(new, final=finished)
        out = self._make(new, new_text, self.text + new_text)
        self.emitted, self.text = n, out.text          # commit: nothing below can fail
        if finished:
            self.final = out
        return out

    def last_resort(self) -> RequestOutput:
        """The final output of a request whose engine died: every token, and the text decoded in one
        piece (the incremental decoder may be what failed)."""
        s = self.seq
        new = s.output_token_ids[self.emitted:]
        text = self.text
        if self.decode is not None:
            try:
                text = self.decode(list(s.output_token_ids))
            except Exception:                # once more: a transient failure must not cost the text
                text = self.decode(list(s.output_token_ids))
        new_text = text[len(self.text):] if text.startswith(self.text) else text
        out = self._make(new, new_text, text)
        self.emitted, self.text, self.final = s.num_output_tokens, text, out
        return out

    def _make(self, new: list[int], new_text: str, text: str) -> RequestOutput:
        s = self.seq
        reason = s.finish_reason.value if s.finish_reason else None
        logprobs = None if self.logprobs is None else self.logprobs[:len(s.output_token_ids)]
        return RequestOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_token_ids,
            token_ids=list(s.output_token_ids), text=text, finished=s.finish_reason is not None,
            finish_reason=reason, new_token_ids=list(new),
            new_text=new_text, error=s.error, arrival_time=s.arrival_time,
            first_scheduled_time=s.first_scheduled_time, first_token_time=s.first_token_time,
            token_times=list(s.token_times), finish_time=s.finish_time,
            num_preemptions=s.num_preemptions, num_cached_tokens=s.num_cached_tokens,
            logprobs=logprobs, prompt_logprobs=None if self.prompt is None else list(self.prompt.entries),
            prompt=s.prompt,
            outputs=[CompletionOutput(s.index, text, list(s.output_token_ids), reason, list(new), new_text,
                                      s.error, logprobs)],
        )


@dataclass(slots=True)
class RequestTracker:
    """One live request's output state: the ``OutputTracker`` of each of its ``n`` sequences.

    ``output()`` stays all or nothing across the children: each child's output commits that child
    (see ``OutputTracker``); if a later child's raises, the earlier children's deltas are kept
    (``_carry``) and go into the next output, merged with whatever they produce meanwhile."""

    request_id: str
    children: list[OutputTracker]
    final_only: bool = False            # ``RequestOutputKind.FINAL_ONLY``: no output until it has finished
    final: RequestOutput | None = None
    handed_out: bool = False
    _carry: dict[int, RequestOutput] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        if len(self.children) == 1 and not self._carry:     # one child (n == 1): its output is ours
            out = self.children[0].output()
            if out.finished:
                self.final = out
            return out
        return self._join(lambda c: c.output())

    def last_resort(self) -> RequestOutput:
        """The final output of a request whose engine died (each child's ``last_resort``)."""
        # a child that had finished was handed out already: it adds nothing new
        return self._join(lambda c: c._make([], "", c.text) if c.final is not None else c.last_resort())

    def _join(self, make) -> RequestOutput:
        for i, child in enumerate(self.children):
            out, prev = make(child), self._carry.get(i)
            if prev is not None:                       # a failed join handed this delta out to nobody
                out = _merged(prev, out)
            self._carry[i] = out
        outs = [self._carry[i] for i in range(len(self.children))]
        out = outs[0] if len(outs) == 1 else _group(self.request_id, outs)
        if self.finished:
            self.final = out
        self._carry = {}                               # only now is every delta in ``out``, handed out
        return out


def _merged(prev: RequestOutput, out: RequestOutput) -> RequestOutput:
    """``out`` with ``prev``'s deltas in front (both outputs of the same child)."""
    new, text = prev.new_token_ids + out.new_token_ids, prev.new_text + out.new_text
    c = out.outputs[0]
    return _replace(out, new_token_ids=new, new_text=text,
                    outputs=[CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, new, text,
                                              c.error, c.logprobs)])


def _group(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """The request's output from its children's: the flat fields of child 0, the rest joined."""
    first = outs[0]
    firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
    done = all(o.finished for o in outs)
    return _replace(
        first, request_id=request_id, finished=done, finish_reason=first.finish_reason if done else None,
        first_token_time=min(firsts, default=None),
        finish_time=max(o.finish_time for o in outs) if done else None,
        num_preemptions=sum(o.num_preemptions for o in outs),
        error=next((o.error for o in outs if o.error), None),
        outputs=[o.outputs[0] for o in outs])


def _replace(out: RequestOutput, **changes) -> RequestOutput:
    fields = {name: getattr(out, name) for name in RequestOutput.__dataclass_fields__}
    return RequestOutput(**{**fields, **changes})
