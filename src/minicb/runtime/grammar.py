"""Structured outputs: a grammar's token mask on one row of the flat batch (the llguidance engine).

A request with ``SamplingParams.structured_outputs`` (a JSON schema, a regex, a choice, a Lark /
GBNF grammar) owns a *matcher*: a parser state over the text generated so far. Before the request's
row is sampled, the matcher says which tokens of the vocabulary may come next (a bitmask, one bit per
token); the row's other logits become ``-inf``; after the draw the matcher consumes the token::

    logits [num_sample_rows, V]       row i: request r_i
      row 0  (no grammar)    ─────────────────────────────────► sample as always
      row 1  (JSON schema)   ── & mask_1 (its matcher) ───────► sample ── matcher_1.consume(token)
      row 2  (no grammar)    ─────────────────────────────────► sample as always
      row 3  (regex)         ── & mask_3 ─────────────────────► sample ── matcher_3.consume(token)

The mask is per row because the state is per request: rows of the same step are different requests
at different points of different grammars, and a row without a grammar is not touched at all (the
sampler keeps its batched greedy ``argmax`` for such rows: token-exact with the mask off, and no cost).

**EOS is allowed only where the grammar is complete.** The matcher is built with the engine's EOS as
its stop token: while the output is an unfinished JSON object, EOS is masked; once it is complete EOS
is allowed (and, when nothing may follow, it is the only token allowed), so the request finishes with
``finish_reason == "stop"`` exactly when the grammar terminates. ``max_tokens`` can still cut it short
(``"length"``), as in vLLM.

**What is compiled where.** Three costs, measured by ``bench/grammar_engines.py``:

* the engine's view of the vocabulary (``LLTokenizer``: every token's bytes, ~1 s for 49,152 tokens):
  built once per tokenizer (``engine_tokenizer``, cached);
* a grammar's compile (JSON schema -> grammar, checked; ``compiled``): once per distinct constraint,
  cached (LRU, ``CACHE_SIZE``), so the hundredth request with the same schema compiles nothing. ``minicb
  serve`` compiles in its frontend workers at admission, so a bad grammar is a 400 before the engine
  thread sees it and the engine thread only copies the compiled matcher;
* a request's matcher: a copy of the compiled one (``deep_copy``, microseconds), made when the request
  is registered with the runner; its masks (microseconds each) are computed in the step, per token.

**Why llguidance** (vLLM supports it beside xgrammar): one dependency-free wheel (xgrammar requires
torch, transformers and triton), a mask in ~10 us here (xgrammar's is faster still, but both are
well under 0.1% of a step's forward), a grammar error is a matcher state instead of an exception in
the middle of a step, and the matcher is exactly a per-request object. ``bench/grammar_engines.py``
measures both on this CPU; ``docs/structured_outputs.md`` has the figures.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch

from minicb.core.errors import InvalidArgument, RowFailed
from minicb.core.structured_outputs import StructuredOutputsParams

CACHE_SIZE = 256                  # compiled constraints kept (an LRU: a new schema evicts the oldest)

# A fixed JSON layout (json.dumps's own): no free whitespace, which a small model could repeat until
# max_tokens; unimplemented schema keywords are ignored rather than refused (pydantic adds some).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}

def ascii_digits(regex: str) -> str:
    """``regex`` with ``\\d`` meaning ``[0-9]`` (and ``\\D`` ``[^0-9]``), as in Python's ``re`` with
    ASCII, JavaScript and OpenAI's regex constraints. llguidance's regexes are Rust's, where ``\\d`` is
    any Unicode digit: a model constrained to digits wrote "segmented digit" characters (U+1FBF0..).
    An escaped backslash stays as it is; inside a class ``[\\d_]`` becomes ``[0-9_]``."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            for lead in ("^", "]"):             # "[]..." and "[^]...": that "]" is a literal
                if regex.startswith(lead, i):
                    out.append(lead)
                    i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar definition (not yet checked: ``compiled`` does that)."""
    import llguidance
    from llguidance import LLMatcher

    kind = spec.kind
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(spec.json, overrides=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(ascii_digits(spec.regex))
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:                                   # Lark, or GBNF (llguidance converts it)
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise InvalidArgument(f"structured_outputs.grammar is not a grammar: {e}") from None


@functools.lru_cache(maxsize=4)
def engine_tokenizer(tokenizer, vocab_size: int, eos_token_id: int):
    """llguidance's view of ``tokenizer`` (every token's bytes, special tokens marked), with
    ``eos_token_id`` as the stop token and ``vocab_size`` mask bits (the model's logits width)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer._tk.to_str(), n_vocab=vocab_size, eos_token=eos_token_id)


@functools.lru_cache(maxsize=CACHE_SIZE)
def compiled(spec: StructuredOutputsParams, tokenizer, vocab_size: int, eos_token_id: int):
    """A pristine matcher for ``spec`` (checked: a bad grammar raises ``InvalidArgument`` here, naming
    the engine's complaint). Requests get copies (``new_matcher``)."""
    from llguidance import LLMatcher

    lltok = engine_tokenizer(tokenizer, vocab_size, eos_token_id)
    try:
        matcher = LLMatcher(lltok, grammar_text(spec), log_level=0)
    except InvalidArgument:
        raise
    except Exception as e:  # noqa: BLE001 - the engine's errors have no common class; all mean "bad grammar"
        raise InvalidArgument(f"structured_outputs.{spec.kind} cannot be compiled: {e}") from None
    if not matcher.is_error():          # the first mask: where a schema that only refers to itself fails
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            matcher = probe
    if matcher.is_error():
        raise InvalidArgument(f"structured_outputs.{spec.kind} cannot be compiled: {matcher_error(matcher)}")
    return matcher


def new_matcher(spec: StructuredOutputsParams, tokenizer, vocab_size: int, eos_token_id: int):
    """A fresh matcher for one request: a copy of the cached compiled one."""
    if tokenizer is None:
        raise InvalidArgument("structured_outputs needs the model's tokenizer (the grammar is over text)")
    if eos_token_id is None:
        raise InvalidArgument("structured_outputs needs an EOS token (a complete grammar ends with it)")
    # the caches are shared by the frontend's workers and the engine thread: lru_cache is thread-safe
    # (two threads may compile the same constraint once each), and deep_copy only reads the pristine one
    return compiled(spec, tokenizer, vocab_size, eos_token_id).deep_copy()


def matcher_error(matcher) -> str:
    """The first line of the matcher's error (llguidance appends a dump of its parser state)."""
    return (matcher.get_error() or "unknown error").strip().splitlines()[0][:300]


class GrammarProcessor:
    """One request's grammar as a ``RowProcessor``: ``process`` masks its row, ``accept`` advances.

    **A broken matcher is an error, never a normal end.** llguidance reports what goes wrong while it
    computes a mask (a grammar without any finite string, ``start: "a" start``, runs into "Too many
    items"; a schema that only refers to itself is "NoExtensionBias") as an error *state*, not an
    exception. ``process`` then raises ``RowFailed`` with the matcher's message, so the request ends
    with ``finish_reason == "error"`` (the other rows of the step go on); allowing only EOS instead
    would end it with "stop", a wrong answer that looks like a right one. If the row has no usable
    logit among the allowed tokens, the allowed tokens share the probability equally."""

    def __init__(self, matcher, vocab_size: int, eos_token_id: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._words = np.full(((vocab_size + 31) // 32,), -1, dtype=np.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: a ``[V]`` bool tensor (``RowFailed`` if the matcher
        is, or goes, into its error state)."""
        if not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self.matcher.is_error():
            raise RowFailed(f"structured output failed: {matcher_error(self.matcher)}")
        words = torch.from_numpy(self._words)
        bits = (words.unsqueeze(1) >> self._shifts) & 1      # [V/32, 32]: bit j of word i is token 32i+j
        return bits.reshape(-1)[: self.vocab_size].bool()

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed().to(logits.device)
        out = logits.masked_fill(~allowed, float("-inf"))
        if not bool((out > float("-inf")).any()):       # nothing usable left: the allowed tokens, evenly
            out = torch.zeros_like(out).masked_fill(~allowed, float("-inf"))
        return out

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(int(token_id))    # a refused token puts it in its error state

    @property
    def finished(self) -> bool:
        """The grammar accepts nothing more (its output is complete; EOS is all it allows)."""
        return self.matcher.is_stopped()
