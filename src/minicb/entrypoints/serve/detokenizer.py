"""Each request's text, made on the event loop from the token ids the engine thread sends.

``RequestText.push(delta)``: ids -> the tokenizer's ``IncrementalDecoder`` -> text -> ``StopMatcher``
-> the text that may be sent now; a stop string found cuts the text there and aborts the request
(``abort(request_id, "stop")``). The engine thread only steps (``detokenize = False``), as vLLM V1's
engine core; this is one table lookup and one incremental UTF-8 decode per token plus the stop
automata: microseconds per step, nothing that grows with a prompt.

Why not ``tokenizers``' ``DecodeStream``: it never emits the bytes of a character split at a request's
end (``"h" + the first byte of "é"`` streams as ``"h"`` where ``decode`` gives ``"h\ufffd"``); ours
flushes them as U+FFFD, as ``decode`` does (``python bench/serve_libraries.py --only detok``;
``test_serve_detokenizer.py``).

The contract (``docs/errors.md``): the ids a client is sent concatenate to the final ``token_ids``; a
request that ends without a stop string has ``text == tokenizer.decode(token_ids)``, less the last
token's text when one of ``stop_token_ids`` ended it (vLLM's rule, unless
``include_stop_str_in_output``; ``stop_reason`` is then that id). A stop string cuts the text right
before it, and what the engine made after it is dropped, never sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from minicb.entrypoints.serve.stops import StopMatcher


class RequestText:
    """One request's decoder and stop strings; ``push`` turns the engine thread's token-only ``Delta``
    into the ``Delta`` a client is sent (``None``: nothing more is sent for this request)."""

    __slots__ = ("decoder", "stops", "abort", "done", "num_output_tokens", "min_tokens", "stop_ids")

    def __init__(self, decoder, stops: StopMatcher, abort: Callable[[], None], min_tokens: int = 0,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        self.decoder = decoder                # the tokenizer's IncrementalDecoder, or None (ids only)
        self.stops = stops
        self.abort = abort                    # ends the request on the engine thread ("stop")
        self.done = False                     # the last Delta went out (a stop, or the engine's end)
        self.num_output_tokens = 0
        self.min_tokens = min_tokens          # vLLM's min_tokens: no stop string ends it before that many
        self.stop_ids = stop_ids              # stop_token_ids (less EOS, when EOS ends it): their text is cut

    def push(self, d):
        """``d`` is an ``engine_thread.Delta`` without text; returns it with its text, or None."""
        if self.done:
            return None                       # after a stop: the rest of the engine's output is dropped
        if d.finished:
            self.done = True
        clean = d.failure is None and d.finish_reason in ("stop", "length")
        ids, stop_reason = d.token_ids, None
        if d.finished and d.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            stop_reason = ids[-1]             # a stop token id ended it: vLLM leaves its text out
            if not self.stops.include:        # (unless include_stop_str_in_output); the id stays
                ids = ids[:-1]
        text = "" if self.decoder is None else self.decoder.push_many(ids, final=d.finished)
        self.num_output_tokens += len(d.token_ids)
        sent = self.stops.push(text, self.num_output_tokens >= self.min_tokens)
        if self.stops.stopped:
            if not d.finished:                # end it now on the engine thread; drop what it still makes
                self.done = True
                self.abort()
            return dataclasses.replace(d, text=sent, finished=True, finish_reason="stop", error=None,
                                       failure=None, num_output_tokens=self.num_output_tokens,
                                       stop_reason=self.stops.matched)
        if d.finished and clean:              # no stop string appeared: the held-back text is text
            sent += self.stops.flush()
        return dataclasses.replace(d, text=sent, stop_reason=stop_reason)
