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
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopMatcher:
    """Incremental stop-string matching with hold-back; one per request."""

    stops: tuple[str, ...]
    held: str = ""
    stopped: bool = False
    _prefixes: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)          # "" would match everywhere: ignore it
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))

    def push(self, text: str) -> str:
        """Add newly decoded text; return what may be sent now. After a match ``stopped`` is True
        and the return value ends right before the stop string."""
        if self.stopped:
            return ""
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return buf
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)]
        keep = self._held_suffix(buf)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The request ended without a match: the held text is ordinary text after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        longest = max(map(len, self.stops)) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            if buf[len(buf) - k:] in self._prefixes:
                return k
        return 0
