"""xgrammar or llguidance? The two maintained grammar engines, compared on this CPU for minicb's use.

    python bench/grammar_engines.py            # ~1 minute on 2 shared cores
    python bench/grammar_engines.py --repeats 3

Both engines turn a grammar (a JSON schema, a regex, an EBNF/Lark grammar) into a *token mask*: for
the text generated so far, which of the vocabulary's tokens may come next. minicb applies the mask to
one row of the flat batch's logits (``minicb.runtime.grammar``). What matters for that:

* **compile time**, for a JSON schema (the LangChain ``with_structured_output`` case: a new schema per
  application, compiled once and cached) and for generic JSON (``response_format: json_object``);
* **per-token mask time** over SmolLM2's 49,152-token vocabulary: paid once per generated token of
  every constrained row, inside the step (the critical path), so it is the number that counts;
* **the API's fit** with a per-row processor: a matcher object per request that computes a bitmask
  into a buffer and consumes the sampled token, and what installing it pulls in.

The matcher is driven through a real document (the tokens SmolLM2's tokenizer gives a JSON object
that satisfies the schema), timing the mask at every position; reported are the median and the 90th
percentile over positions, medians over ``--repeats`` runs (the machine is shared: medians, not
means). The figures and the CPU they were measured on are printed; ``docs/structured_outputs.md``
quotes a run.

**The choice: llguidance.** On this CPU both compute a mask in tens of microseconds (far below a
step's ~30 ms forward), and both compile a schema in milliseconds; the differences that decide are
the ones of fit: llguidance is one 3 MB wheel with no dependencies (xgrammar requires torch,
transformers and triton: ``pip install xgrammar`` would pull triton's ~400 MB and, on a CPU machine,
risk a CUDA torch), reports grammar errors as an error state rather than by raising mid-step, takes
limits on a grammar's size and per-step work (``LLParserLimits``), and its matcher (``LLMatcher``)
is exactly the per-request object a ``RowProcessor`` wants. vLLM supports both (``--structured-
outputs-config.backend``); its default is xgrammar on GPUs, where the bitmask kernels matter more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

REPEATS = 3

SCHEMA = {   # the shape of a typical with_structured_output model: strings, numbers, an enum, a list
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string"},
        "mood": {"enum": ["happy", "sad", "neutral"]},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "city", "mood", "hobbies", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "city": "London", "mood": "happy",
            "hobbies": ["mathematics", "poetry", "engines"],
            "address": {"street": "12 St James's Square", "zip": "SW1Y 4JH"}}


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _mask_times(new_matcher, fill, accept, tokens: list[int], repeats: int) -> tuple[float, float, float]:
    """Median and p90 (microseconds) of one mask computation along ``tokens``, and the time from a new
    matcher to its first mask (milliseconds: what a request waits before its first constrained
    token, lazily built tables included), medians over repeats."""
    medians, p90s, firsts = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = new_matcher()
        fill(m)
        firsts.append((time.perf_counter() - t0) * 1e3)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            fill(m)
            times.append(time.perf_counter() - t0)
            assert accept(m, t), "the document must satisfy the grammar"
        times.sort()
        medians.append(statistics.median(times) * 1e6)
        p90s.append(times[int(0.9 * (len(times) - 1))] * 1e6)
    return statistics.median(medians), statistics.median(p90s), statistics.median(firsts)


def bench_llguidance(tok, tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok._tk.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_id)
    setup = (time.perf_counter() - t0) * 1e3
    schema = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    generic = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    # LLMatcher's constructor is the compile (it builds the lexer and the parser's tables)
    compile_schema = _median_ms(lambda: llguidance.LLMatcher(lltok, schema), repeats)
    compile_generic = _median_ms(lambda: llguidance.LLMatcher(lltok, generic), repeats)
    mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
    med, p90, first = _mask_times(lambda: llguidance.LLMatcher(lltok, schema),
                           lambda m: lnp.fill_next_token_bitmask(m, mask, 0),
                           lambda m, t: m.consume_token(t) and not m.is_error(), tokens, repeats)
    import importlib.metadata as md
    return {"engine": f"llguidance {md.version('llguidance')}", "tokenizer_ms": setup,
            "compile_schema_ms": compile_schema, "compile_generic_ms": compile_generic,
            "first_mask_ms": first, "mask_median_us": med, "mask_p90_us": p90}


def bench_xgrammar(tok, tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = tok._byte_table()
    special = tok.all_special_ids
    info = xgr.TokenizerInfo([b"" if i in special else b for i, b in enumerate(vocab)], xgr.VocabType.RAW,
                             vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_token_id])
    setup = (time.perf_counter() - t0) * 1e3
    text = json.dumps(SCHEMA)

    def fresh():   # the compiler caches by schema: a fresh one measures a first compile
        return xgr.GrammarCompiler(info, max_threads=2)
    compile_schema = _median_ms(lambda: fresh().compile_json_schema(text), repeats)
    compile_generic = _median_ms(lambda: fresh().compile_builtin_json_grammar(), repeats)
    compiled = fresh().compile_json_schema(text)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    med, p90, first = _mask_times(lambda: xgr.GrammarMatcher(compiled),
                                  lambda m: m.fill_next_token_bitmask(mask),
                           lambda m, t: m.accept_token(t), tokens, repeats)
    import importlib.metadata as md
    return {"engine": f"xgrammar {md.version('xgrammar')}", "tokenizer_ms": setup,
            "compile_schema_ms": compile_schema, "compile_generic_ms": compile_generic,
            "first_mask_ms": first, "mask_median_us": med, "mask_p90_us": p90}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=REPEATS)
    args = ap.parse_args(argv)
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from common import cpu_header

    from minicb.model.text.tokenizer import Tokenizer
    from minicb.model.weights.loader import default_model_path

    tok = Tokenizer.from_gguf(default_model_path())
    tokens = tok.encode(json.dumps(DOCUMENT)) + [tok.eos_token_id]
    print(cpu_header())
    print(f"vocabulary: {tok.vocab_size:,} tokens (SmolLM2); document: {len(tokens)} tokens; "
          f"medians of {args.repeats} runs")
    rows = []
    for bench in (bench_llguidance, bench_xgrammar):
        try:
            rows.append(bench(tok, tokens, args.repeats))
        except ImportError as e:
            print(f"{bench.__name__}: not installed ({e})")
    head = ("engine", "tokenizer setup ms", "compile schema ms", "compile generic JSON ms",
            "new matcher + first mask ms",
            "mask median us", "mask p90 us")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['engine']} | {r['tokenizer_ms']:.0f} | {r['compile_schema_ms']:.1f} | "
              f"{r['compile_generic_ms']:.1f} | {r['first_mask_ms']:.1f} | {r['mask_median_us']:.0f} | "
              f"{r['mask_p90_us']:.0f} |")


if __name__ == "__main__":
    main()
