"""``minicb trace``: draw which request held which slot at every step (``measure.trace`` draws it;
``measure.replay`` records a step-by-step page with ``--replay``). Torch-free to import: the engine is
imported when the command runs."""

from __future__ import annotations

import os

from minicb.core.errors import InvalidArgument, check_int
from minicb.measure.trace import (
    Workload,
    build_engine,
    make_workload,
    render_ascii,
    render_image,
    run_trace,
)


def read_prompts(path: str) -> list[str]:
    """The prompts of ``--prompts FILE``: one a line, blank lines skipped (UTF-8)."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"--prompts: cannot read {path!r}: {exc}") from None
    if not prompts:
        raise InvalidArgument(f"--prompts: {path!r} has no prompt (one a line)")
    return prompts


def prompts_workload(prompts: list[str], tokenizer, max_tokens: int, arrival_gap: int) -> Workload:
    """Your prompts as a workload: each tokenized (no special tokens), ``max_tokens`` at most, arriving
    ``arrival_gap`` steps apart."""
    ids = [tuple(tokenizer.encode(p)) for p in prompts]
    for k, t in enumerate(ids):
        if not t:
            raise InvalidArgument(f"--prompts: line {k + 1} encodes to no token")
    return Workload(prompts=tuple(ids), max_tokens=(max_tokens,) * len(ids),
                    arrivals=tuple(arrival_gap * i for i in range(len(ids))))


# --- the command line ------------------------------------------------------------------------------
def add_parser(sub) -> None:
    """Register ``minicb trace`` on the CLI's subparsers."""
    p = sub.add_parser("trace", help="draw which request held which slot at every step (space-time diagram)",
                       description="Run a random workload and draw the slot timeline: ASCII in the "
                                   "terminal, or PNG/SVG with --out (needs matplotlib).")
    p.add_argument("--policy", default="continuous", choices=["continuous", "dynamic", "static"],
                   help="continuous (default), dynamic or static batching")
    p.add_argument("--num-requests", type=int, default=8, help="requests in the random workload (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and lengths")
    p.add_argument("--out", default=None, help="write a .png or .svg (matplotlib) besides the ASCII")
    p.add_argument("--replay", default=None, metavar="OUT.html",
                   help="also record the run step by step into one self-contained HTML page (the docs' "
                        "replay player, offline: no network)")
    p.add_argument("--model", default=None,
                   help="'tiny' (random, instant; the default), 'default' (SmolLM2; the default with "
                        "--prompts) or a GGUF file / HF dir")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="run your own prompts (a text file, one prompt a line) on a real model, greedy, "
                        "instead of a random workload; with --replay the page shows each prompt and its "
                        "text so far")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="with --prompts: tokens to generate at most for each prompt (default 32)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="slots")
    p.add_argument("--max-num-batched-tokens", type=int, default=64,
                   help="token budget of a step (default 64)")
    p.add_argument("--long-prefill-chunk", type=int, default=None,
                   help="prompt tokens one request may prefill in a step (default: no limit)")
    p.add_argument("--block-size", type=int, default=4, help="tokens per KV block (default 4)")
    p.add_argument("--num-blocks", type=int, default=256,
                   help="KV blocks (default 256; fewer forces preemptions)")
    p.add_argument("--num-host-blocks", type=int, default=0,
                   help="host-memory blocks for --preemption-mode swap (default 0)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="a preempted request recomputes its KV (default) or swaps it to host blocks")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(4, 24), metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] tokens (default 4 24)")
    p.add_argument("--output-len", type=int, nargs=2, default=(2, 24), metavar=("MIN", "MAX"),
                   help="output lengths, uniform in [MIN, MAX] tokens (default 2 24)")
    p.add_argument("--arrival-gap", type=int, default=0, help="steps between arrivals (0: all at once)")
    p.add_argument("--width", type=int, default=None, help="characters per line (default: terminal)")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="colour the diagram (auto: on a terminal, unless NO_COLOR is set)")


def cmd_trace(args) -> int:
    """``minicb trace``: run, print the ASCII diagram, optionally write the image."""
    from minicb.measure.flags import MAX_SEED, check_out_file, check_plots_possible

    if args.out is not None and os.path.splitext(args.out)[1].lower() not in (".png", ".svg"):
        raise InvalidArgument(f"--out must end in .png or .svg, got {args.out!r}")
    check_out_file("--out", args.out)                    # before the run, not after it
    check_plots_possible("--out", args.out is not None, skip_flag=None)
    if args.replay is not None and os.path.splitext(args.replay)[1].lower() not in (".html", ".htm"):
        raise InvalidArgument(f"--replay must end in .html, got {args.replay!r}")
    check_out_file("--replay", args.replay)
    check_int("--seed", args.seed, lo=0, hi=MAX_SEED)
    if args.width is not None:
        check_int("--width", args.width, lo=20, hi=100_000)
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    if args.model is None:
        args.model = "default" if prompts is not None else "tiny"
    if prompts is not None:
        if args.model == "tiny":
            raise InvalidArgument("--prompts needs a model with a tokenizer: --model default (SmolLM2) "
                                  "or a GGUF file / HF dir, not the tiny random model")
        check_int("--max-tokens", args.max_tokens, lo=1, hi=100_000)
    if args.model not in ("tiny", "default"):
        from minicb.model.weights.paths import check_model_path

        check_model_path(args.model, "--model")           # before torch; "never downloads" for hub ids
    if args.model == "tiny":
        import torch

        torch.set_num_threads(1)   # tiny matmuls: a second thread costs more in sync than it computes
    wl_kwargs = dict(prompt_len=tuple(args.prompt_len), output_len=tuple(args.output_len),
                     arrival_gap=args.arrival_gap)
    engine = build_engine(args.model, seed=0, policy=args.policy, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          long_prefill_chunk=args.long_prefill_chunk, block_size=args.block_size,
                          num_blocks=args.num_blocks, num_host_blocks=args.num_host_blocks,
                          preemption_mode=args.preemption_mode)
    if prompts is None:
        workload = make_workload(args.num_requests, args.seed, engine.runner.vocab_size, **wl_kwargs)
    else:
        workload = prompts_workload(prompts, engine.tokenizer, args.max_tokens, args.arrival_gap)
    recorder = None
    if args.replay is not None:
        from minicb.measure.replay import ReplayRecorder

        recorder = ReplayRecorder(record_text=prompts is not None).attach(engine)
    trace = run_trace(engine, workload, ignore_eos=prompts is None)
    colour = {"auto": None, "always": True, "never": False}[args.color]
    print(render_ascii(trace, width=args.width, colour=colour))
    if args.out is not None:
        render_image(trace, args.out)
        print(f"wrote {args.out}")
    if recorder is not None:
        from minicb.measure.replay import write_html

        data = recorder.to_json()
        data["arrivals"] = {f"r{i}": t for i, t in enumerate(workload.arrivals)}
        if prompts is not None:
            data["prompts"] = {f"r{i}": text for i, text in enumerate(prompts)}
        write_html(data, args.replay, title=f"minicb trace --policy {args.policy}: "
                                            f"{len(workload.prompts)} requests, {args.max_num_seqs} slots, "
                                            f"{args.num_blocks} blocks")
        print(f"wrote {args.replay} ({len(data['frames'])} steps; open it in a browser)")
    return 0
