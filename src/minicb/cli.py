"""``minicb``: the command line.

    minicb generate "The capital of France is" --max-tokens 8
    minicb generate --chat "Write a haiku" --temperature 0.7 --seed 1
    minicb generate --file prompts.txt --policy static

Errors a user can make (a missing model, a bad flag value, an empty prompt file) end with exit code 2
and one line on stderr, never a traceback; Ctrl-C ends with 130.
"""

from __future__ import annotations

import argparse
import sys

from minicb.errors import MinicbError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # one line and exit 2; no usage dump (``--help`` shows it)
        self.exit(EXIT_USAGE, f"minicb: error: {_one_line(message)}\n")


def _one_line(message) -> str:
    """The contract is one line on stderr: fold any newline a message carries."""
    return " ".join(str(message).split())


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--attn-backend", default="auto",
                   choices=["auto", "reference", "cpu-paged", "flash-attn", "torch-varlen"],
                   help="attention kernel; auto = flash-attn, else torch-varlen on CUDA in float16/bfloat16, "
                        "else reference; cpu-paged = reference with a C decode kernel (CPU, compiles on "
                        "first use)")
    p.add_argument("--policy", default="continuous", choices=["continuous", "dynamic", "static"])
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share the KV blocks of common prompt prefixes (continuous policy only; "
                        "the padded policies never share them)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: processes started here, or WORLD_SIZE under torchrun")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minicb", description="Continuous batching for LLM inference, small and tested.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="*", help="prompt text (repeat for several)")
    g.add_argument("--file", help="a file with one prompt per line")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _add_engine_args(g)
    from minicb.measure import trace  # torch-free import; the engine is imported when the command runs

    trace.add_parser(sub)
    from minicb.measure import bench_cli
    from minicb.simulate import cli as simulate_cli  # torch-free imports, like trace

    bench_cli.add_parser(sub)
    simulate_cli.add_parser(sub)
    from minicb.serve import cli as serve_cli  # argparse only; FastAPI and torch load when it runs

    serve_cli.add_parser(sub, _add_engine_args)
    x = sub.add_parser("export-hf", help="write the model as a Hugging Face directory (transformers, vLLM)")
    x.add_argument("out", help="directory to create (must be absent or empty, unless --force)")
    x.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)")
    x.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    x.add_argument("--force", action="store_true", help="write into a non-empty directory")
    return parser


def cmd_export_hf(args) -> int:
    from minicb.model.export import export_hf

    out = export_hf(args.out, args.model, args.dtype, overwrite=args.force)
    print(f"wrote {out}")
    return 0


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                lines = [ln.rstrip("\n") for ln in f if ln.strip()]
        except OSError as e:
            raise MinicbError(f"cannot read --file {args.file}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise MinicbError(f"cannot read --file {args.file}: it is not UTF-8 text "
                              f"(byte {e.start})") from e
        if not lines:
            raise MinicbError(f"--file {args.file} contains no prompts")
        prompts += lines
    if not prompts:
        raise MinicbError("give at least one prompt (as an argument or with --file)")
    return prompts


def cmd_generate(args) -> int:
    prompts = _read_prompts(args)
    from minicb.arrivals import Arrival, drive
    from minicb.llm import LLM
    from minicb.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype, policy=args.policy, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              num_blocks=args.num_blocks, preemption_mode=args.preemption_mode, device=args.device,
              attn_backend=args.attn_backend, tensor_parallel_size=args.tp,
              enable_prefix_caching=args.prefix_caching)
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template(p) for p in prompts]
    single = len(prompts) == 1
    failed = []

    def show(outs) -> None:
        for out in outs:
            if single:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
            elif out.finished:
                sys.stdout.write(f"[{int(out.request_id) + 1}] {out.text}\n")
                sys.stdout.flush()
            if out.finished and out.error:
                failed.append(out.request_id)
                sys.stderr.write(f"minicb: request {int(out.request_id) + 1} failed: {out.error}\n")

    try:
        drive(llm.engine, [Arrival(0, f"{i}", p, params) for i, p in enumerate(prompts)], on_step=show)
    finally:
        llm.shutdown()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "trace":
            from minicb.measure.trace import cmd_trace

            return cmd_trace(args)
        if args.command in ("bench", "simulate", "serve"):
            return args.run(args)
        return {"generate": cmd_generate, "export-hf": cmd_export_hf}[args.command](args)
    except KeyboardInterrupt:
        sys.stderr.write("minicb: interrupted\n")
        return EXIT_INTERRUPTED
    except (MinicbError, ValueError) as e:
        sys.stderr.write(f"minicb: error: {_one_line(e)}\n")
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
