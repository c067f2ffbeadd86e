"""``RequestOutput``: what a request has produced so far, as the engine hands it out.

The scheduler keeps token ids; a user wants text that grows as tokens arrive. Byte-level BPE makes
that subtle: one character can span several tokens (an emoji is four bytes, often three tokens), so
text is produced by an incremental decoder that holds back an unfinished character until its last
byte arrives, and is flushed when the request ends (a request cut off by ``max_tokens`` in the
middle of a character still shows its bytes, as the tokenizer's ``decode`` would: U+FFFD).

``OutputTracker`` is the engine's per-request bookkeeping for that: the sequence, its decoder, the
text so far and how many tokens were already handed out (``new_token_ids`` / ``new_text`` are the
difference since the previous output of the same request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minicb.core.sequence import Sequence


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far (complete once ``finished``)."""

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


@dataclass(slots=True)
class OutputTracker:
    """One live request's output state: its sequence, incremental decoder, text and tokens handed out."""

    seq: Sequence
    decoder: object | None            # the tokenizer's incremental decoder, or None (token ids only)
    text: str = ""
    emitted: int = 0

    def output(self) -> RequestOutput:
        """The request's output now; advances what counts as already handed out."""
        s = self.seq
        new = s.output_token_ids[self.emitted:]
        self.emitted = s.num_output_tokens
        new_text = ""
        if self.decoder is not None:
            new_text = "".join(self.decoder.push(t) for t in new)
            if s.is_finished:
                new_text += self.decoder.flush()        # a trailing partial character is not lost
            self.text += new_text
        return RequestOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_token_ids,
            token_ids=list(s.output_token_ids), text=self.text, finished=s.is_finished,
            finish_reason=s.finish_reason.value if s.finish_reason else None, new_token_ids=list(new),
            new_text=new_text, error=s.error, arrival_time=s.arrival_time,
            first_scheduled_time=s.first_scheduled_time, first_token_time=s.first_token_time,
            token_times=list(s.token_times), finish_time=s.finish_time,
            num_preemptions=s.num_preemptions, num_cached_tokens=s.num_cached_tokens,
        )
