"""``minicb demo``: continuous batching in one screen (``make demo`` runs it after the set-up).

1. The same six requests on three batch slots, first under **static batching** (a batch runs until
   its longest member ends; a finished request's slot computes padding) and then under **continuous
   batching** (the slot is refilled at the very next step), drawn side by side as slot diagrams with
   their step counts and padding. A tiny random model computes them: the schedule, not the text, is
   the point, and it takes a second.
2. SmolLM2-135M-Instruct answers four prompts on three slots with continuous batching, on this CPU
   (the fourth joins when the first answer ends), and the slots of that run are drawn the same way.
3. Three lines: what just happened, the next command to run, where the tutorials are.

Everything it shows comes from the code the rest of minicb runs: ``minicb.measure.trace`` records the
engine's plan events (``minicb trace --policy static`` draws one diagram at a time) and
``minicb.engine.arrivals.drive`` serves the requests.
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

DEMO_PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.",
                "Name three colours of the rainbow.", "Say hello in French.")
DEMO_SLOTS = 3                  # one prompt more than slots: the fourth takes the first slot that frees
TRACE = dict(num_requests=6, num_slots=3, prompt_len=(4, 12), output_len=(2, 14), seed=0)


def source_checkout() -> Path | None:
    """The repository minicb runs from (an editable install, ``PYTHONPATH=src``), or None for an
    installed wheel, which has no tutorials, docs or Makefile: what to read next is said accordingly."""
    root = Path(__file__).resolve().parents[3]          # entrypoints -> minicb -> src -> the repository
    return root if (root / "tutorials" / "01_static_batching.py").is_file() else None


def where_to_learn() -> str:
    """One line pointing to the tutorials, naming only what this install has."""
    if source_checkout() is not None:
        return ("Tutorials: python tutorials/00_why_batch.py, then 01 ... 11: twelve chapters "
                "(the site: make docs)")
    return ("Tutorials: minicb tutorials DIR copies the twelve chapters (00-11) out of this package; "
            "then python DIR/00_why_batch.py")


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="start here: static vs continuous batching side by side, then SmolLM2",
                       description="The same six requests under static and continuous batching as slot "
                                   "diagrams side by side, then SmolLM2 answering with continuous "
                                   "batching, then what to run next.")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory for part 2 (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer in part 2 (default 24)")
    p.add_argument("--no-model", action="store_true",
                   help="only the diagrams (part 1): no model is loaded")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="colour the diagrams (auto: on a terminal, unless NO_COLOR is set)")
    p.set_defaults(run=cmd_demo)


def side_by_side(left: list[str], right: list[str], left_plain: list[str], gap: int = 4) -> list[str]:
    """Two columns of lines; ``left_plain`` is ``left`` without colour codes, which sets the padding."""
    width = max(map(len, left_plain), default=0) + gap
    n = max(len(left), len(right))
    left, right = left + [""] * (n - len(left)), right + [""] * (n - len(right))
    left_plain = left_plain + [""] * (n - len(left_plain))
    return [(a + " " * (width - len(p)) + b).rstrip()
            for a, p, b in zip(left, left_plain, right, strict=True)]


def batching_traces(num_requests: int = 6, num_slots: int = 3, prompt_len=(4, 12), output_len=(2, 14),
                    seed: int = 0) -> dict:
    """``{"static": SlotTrace, "continuous": SlotTrace}`` of one random workload on the tiny model."""
    import torch

    from minicb.measure.trace import build_engine, make_workload, run_trace

    torch.set_num_threads(1)   # tiny matmuls: a second thread costs more in sync than it computes
    out = {}
    for policy in ("static", "continuous"):
        engine = build_engine("tiny", seed=0, policy=policy, max_num_seqs=num_slots,
                              max_num_batched_tokens=64, block_size=4, num_blocks=256)
        wl = make_workload(num_requests, seed, engine.runner.vocab_size, prompt_len=prompt_len,
                           output_len=output_len)
        out[policy] = run_trace(engine, wl)
    return out


def describe(trace) -> list[str]:
    """A trace's step count and padding, in two short lines under its diagram."""
    s = trace.summary()
    return [f"{s.num_steps} steps, {s.padding_slot_steps} of {s.slot_steps} slot-steps padding",
            f"{s.real_tokens} real + {s.padding_tokens} padding tokens"]


def diagrams(traces: dict, colour: bool | None = None) -> list[str]:
    from minicb.measure.trace import render_ascii

    titles = {"static": "STATIC batching", "continuous": "CONTINUOUS batching"}
    cols, plain = {}, {}
    for policy, tr in traces.items():
        kw = dict(width=200, legend=False, summary=False, title=titles[policy])
        cols[policy] = render_ascii(tr, colour=colour, **kw).splitlines() + describe(tr)
        plain[policy] = render_ascii(tr, colour=False, **kw).splitlines() + describe(tr)
    return side_by_side(cols["static"], cols["continuous"], plain["static"])


def cmd_demo(args) -> int:
    from minicb.entrypoints.checks import at_least, check_model_flag

    at_least("--max-tokens", args.max_tokens, 1)
    check_model_flag(args.model)
    colour = {"auto": None, "always": True, "never": False}[args.color]
    say = print
    t0 = time.perf_counter()
    say("== 1. The same 6 requests on 3 batch slots: one row per slot, one column per step ==")
    say("   A-F are the requests (UPPER = its prompt's step, lower = one generated token each);")
    say("   '.' = padding: a slot whose request has ended, computing throw-away tokens; ' ' = free.")
    say("")
    traces = batching_traces(**TRACE)
    for line in diagrams(traces, colour):
        say("   " + line)
    st, ct = traces["static"].summary(), traces["continuous"].summary()
    say("")
    say("   Static batching starts the next batch only when the longest request of this one ends;")
    say("   continuous batching gives a freed slot to the next request at the very next step:")
    say(f"   {st.num_steps} -> {ct.num_steps} steps for the same {st.real_tokens} tokens, and no padding. "
        f"({time.perf_counter() - t0:.1f} s)")
    sys.stdout.flush()
    if not args.no_model:
        say("")
        _real_model(args, colour)
    say("")
    say(f"What just happened: {st.num_steps} steps of padded static batches became {ct.num_steps} steps "
        "of continuous batching,")
    say("  and SmolLM2 answered with each request joining and leaving the batch on its own.")
    say("Next: minicb trace --policy continuous --num-requests 12 --arrival-gap 2   (arrivals over time)")
    say(where_to_learn())
    return 0


def _real_model(args, colour) -> None:
    from minicb.entrypoints.checks import model_name
    from minicb.measure.progress import Progress

    name = model_name(args.model)
    print(f"== 2. {name} answers {len(DEMO_PROMPTS)} prompts on {DEMO_SLOTS} slots, continuous batching, "
          "this CPU ==", flush=True)
    t0 = time.perf_counter()
    with Progress(f"loading {name}"):
        from minicb.core.sampling_params import SamplingParams
        from minicb.engine.arrivals import Arrival, drive
        from minicb.entrypoints.llm import LLM
        from minicb.measure.trace import TraceRecorder, render_ascii

        llm = LLM(args.model, max_num_seqs=DEMO_SLOTS, policy="continuous")
    loaded = time.perf_counter() - t0
    try:
        rec = TraceRecorder(DEMO_SLOTS).attach(llm.engine)
        params = SamplingParams(max_tokens=args.max_tokens)
        arrivals = [Arrival(0, str(i), llm.tokenizer.apply_chat_template(p), params)
                    for i, p in enumerate(DEMO_PROMPTS)]
        t1 = time.perf_counter()
        with Progress("generating", total=len(arrivals), unit="answers") as prog:
            outs = drive(llm.engine, arrivals,
                         on_step=lambda o: prog.update(done=prog.done + sum(x.finished for x in o)))
        ran = time.perf_counter() - t1
    finally:
        llm.shutdown()
    by_id = {o.request_id: o for o in outs}
    trace = rec.trace
    for i, prompt in enumerate(DEMO_PROMPTS):
        out = by_id[str(i)]
        text = " ".join(out.text.split()) + (" ..." if out.finish_reason == "length" else "")
        print(f"   {trace.label(str(i))}: {prompt}")
        for line in textwrap.wrap(text, 92, initial_indent="      -> ", subsequent_indent="         "):
            print(line)
    print("")
    for line in render_ascii(trace, width=96, colour=colour, legend=False, summary=False,
                             title=f"the slots of this run ({trace.num_steps} steps):").splitlines():
        print("   " + line)
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"   {tokens} tokens in {trace.num_steps} steps, {ran:.1f} s (the model loaded in {loaded:.1f} s)")
