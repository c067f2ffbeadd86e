"""The engine's logprobs (vLLM's ``{token_id: Logprob}`` per token) in OpenAI's three answer shapes.

::

    completions   "logprobs": {"tokens": ["The", " cat"], "token_logprobs": [null, -2.3],
                               "top_logprobs": [null, {" cat": -2.3, " dog": -1.9}], "text_offset": [0, 3]}
    chat          "logprobs": {"content": [{"token": " cat", "logprob": -2.3, "bytes": [32, 99, 97, 116],
                                            "top_logprobs": [{"token": " dog", "logprob": -1.9, ...}]}]}
    vLLM's        "prompt_logprobs": [null, {"4": {"logprob": -2.3, "rank": 2, "decoded_token": " cat"}}]

Completions' ``top_logprobs`` holds the token itself and the ``k`` most likely (vLLM's and OpenAI's
legacy shape, what lm-eval reads: it calls a continuation greedy when each token's logprob is the
largest of its ``top_logprobs``); chat's ``top_logprobs`` is exactly the ``k`` most likely. A token's
text is its own decode (a byte-level piece of a character shows as U+FFFD, as in vLLM); ``bytes`` are
that text's UTF-8. JSON has no ``-inf``: a token of probability 0 gets ``MIN_LOGPROB``, vLLM's floor.
"""

from __future__ import annotations

from minicb.engine.logprobs import Logprob

MIN_LOGPROB = -9999.0


def number(x: float) -> float:
    """A logprob JSON can carry: ``-inf`` (and NaN) become ``MIN_LOGPROB``."""
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def text(token_id: int, lp: Logprob, as_id: bool = False) -> str:
    """A token's text in an answer: its decode, or ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``,
    or a token without text)."""
    return lp.decoded_token if lp.decoded_token is not None and not as_id else f"token_id:{token_id}"


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of an entry, best first (those of rank <= k)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)[:k]


class CompletionLogprobs:
    """Builds completions' ``logprobs`` object chunk by chunk (``text_offset`` runs on across chunks)."""

    def __init__(self, k: int, as_ids: bool = False) -> None:
        self.k = k
        self.as_ids = as_ids      # return_tokens_as_token_ids
        self.offset = 0

    def add(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], names=None) -> dict:
        """``entries[i]`` scores ``token_ids[i]`` (``None``: the first prompt token, which nothing
        scores; ``names(id)`` then gives its text)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in zip(token_ids, entries):
            if entry is None:
                name = names(tid) if names is not None else f"token_id:{tid}"
                lp, top = None, None
            else:
                name = text(tid, entry[tid], self.as_ids)
                lp = number(entry[tid].logprob)
                top = {text(t, e, self.as_ids): number(e.logprob) for t, e in entry.items()
                       if t == tid or e.rank <= self.k}
            out["tokens"].append(name)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(name)
        return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                  as_ids: bool = False) -> dict:
    """Chat's ``logprobs`` object for ``token_ids`` (each scored by its entry)."""
    def one(t: int, lp: Logprob) -> dict:
        name = text(t, lp, as_ids)
        return {"token": name, "logprob": number(lp.logprob), "bytes": list(name.encode("utf-8", "replace"))}

    return {"content": [one(t, e[t]) | {"top_logprobs": [one(u, x) for u, x in _top(e, k)]}
                        for t, e in zip(token_ids, entries)]}


def prompt_logprobs(entries: list[dict[int, Logprob] | None], k: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or ``{str(id): {logprob, rank,
    decoded_token}}`` holding the token and the ``k`` most likely."""
    return [None if e is None else
            {str(t): {"logprob": number(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for i, (t, lp) in enumerate(e.items()) if i == 0 or lp.rank <= k}
            for e in entries]
