"""Stop strings: end a request when its *text* contains one, and never show the string itself.

The engine stops on token ids (EOS, ``stop_token_ids``); OpenAI's ``stop`` is text, and text does not
line up with tokens: ``"\\n\\n"`` may arrive as one token, as two, or as the end of ``".\\n"`` and the
start of ``"\\nThe"``. So the match runs on the decoded text, as it grows, and the server has to hold
text back: the tail of what it has that could still turn into a stop string is not sent yet::

    stop = ["END"]          received so far          sent      held back
    chunk "The"             "The"                    "The"     ""
    chunk " E"              " E"                     " "       "E"        (could become "END")
    chunk "N"               "EN"                     ""        "EN"
    chunk "D!"              "END!"                   stop: "END!" and everything after is dropped

Invariant (what ``tests/serve/test_serve_stops.py`` checks for arbitrary chunkings): take the text after
each chunk; the first of these that contains a stop string, cut before the earliest occurrence in
it, is everything ``push`` returns (plus ``flush()``: the whole text when no stop ever appears).
"The first stop to appear" is what streaming can know: ``["bcd", "c"]`` on ``"abc" + "d"`` stops at
``"c"``, before ``"bcd"`` exists. A stop string never straddles sent and held text, because any
suffix that is a prefix of a stop string is held.

**Cost.** One Knuth-Morris-Pratt automaton per stop string: its state is the length of the longest
prefix of the stop string that ends the text so far, which is both "has it appeared?" (the state
reaches the full length) and "how much must be held back?" (the largest state). Building one costs
its length once (the failure table); each new character moves every state in amortised constant
time. Nothing proportional to the *square* of a stop string is ever made (a set of every prefix of
4 stops x 30,000 characters is 1.8 billion characters), and the text held back is never longer than
the longest stop string. Building happens in the server's worker pool; the event loop only pushes.

Why not ``str.find`` over the held text plus the new: finding the least text to hold back that way
tries every candidate suffix, so one push costs up to the square of a stop string's length (on the
loop, which serves everyone); holding back a fixed ``len(longest stop) - 1`` instead (vLLM's way)
sends text later than needed (``test_the_docstring_example``). ``python bench/serve_libraries.py
--only stops`` runs the three side by side.
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    """KMP's table: ``fail[i]`` is the length of the longest proper prefix of ``s[:i + 1]`` that is
    also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Incremental stop-string matching with hold-back; one per request.

    ``include`` (vLLM's ``include_stop_str_in_output``) keeps the matched stop string in the text: the
    cut comes right after it instead of right before. ``push(text, can_stop=False)`` feeds text that
    may not end the request (vLLM's ``min_tokens``: no stop string is matched before that many tokens):
    a stop string completed there is passed over, and the automaton carries on as if it had not
    matched (its state falls back along the failure table), so a later occurrence is still found."""

    __slots__ = ("stops", "include", "stopped", "matched", "held", "_fail", "_state")

    def __init__(self, stops: tuple[str, ...] = (), include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)          # "" would match everywhere: ignore it
        self.include = include
        self.stopped = False
        self.matched: str | None = None                    # the stop string that matched (vLLM's stop_reason)
        self.held = ""
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    def push(self, text: str, can_stop: bool = True) -> str:
        """Add newly decoded text; return what may be sent now. After a match ``stopped`` is True
        and the return value ends right before the stop string (right after it with ``include``)."""
        if self.stopped:
            return ""
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return buf
        base = len(self.held)                # buf[:base] was fed before; feed only ``text``
        first = None                         # (start, end, j) of the earliest stop string this text completes
        for j, (s, fail) in enumerate(zip(self.stops, self._fail)):
            k, n = self._state[j], len(s)
            for i, ch in enumerate(text):
                while k and ch != s[k]:
                    k = fail[k - 1]
                if ch == s[k]:
                    k += 1
                if k == n:                   # s ends at buf[base + i]: its first occurrence
                    if not can_stop:         # too early to stop: go on as after a mismatch
                        k = fail[n - 1]
                        continue
                    span = (base + i + 1 - n, base + i + 1, j)
                    first = span if first is None else min(first, span)
                    break
            self._state[j] = k
        if first is not None:
            self.stopped, self.held, self.matched = True, "", self.stops[first[2]]
            return buf[:first[1] if self.include else first[0]]
        keep = max(self._state)              # the longest suffix that is a proper prefix of a stop
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The request ended without a match: the held text is ordinary text after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
