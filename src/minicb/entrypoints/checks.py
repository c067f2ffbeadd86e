"""The command line's checks that come before torch is imported: every number is named by its flag
(``--max-tokens must be >= 1, got 0``, in a fraction of a second rather than after torch's import),
and a model that is not here fails at once, a Hugging Face Hub id with "minicb never downloads"
(``minicb.model.weights.paths``). The library checks the same values again, by their Python names
(``max_tokens must be in [1, inf]``): this module only makes the command line's answer fast and
phrased in its own terms. Torch-free."""

from __future__ import annotations

import math
import os

from minicb.core.errors import InvalidArgument
from minicb.measure.flags import MAX_SEED


def at_least(flag: str, value, lo: int) -> None:
    if value is not None and value < lo:
        raise InvalidArgument(f"{flag} must be >= {lo}, got {value}")


def number(flag: str, value, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    bad = (not math.isfinite(value) or (value <= lo if lo_open else value < lo)
           or (hi is not None and value > hi))
    if bad:
        rng = f"{'(' if lo_open else '['}{lo:g}, {'inf' if hi is None else f'{hi:g}'}]"
        raise InvalidArgument(f"{flag} must be a finite number in {rng}, got {value}")


def check_engine_flags(args) -> None:
    """The flags ``_add_engine_args`` adds, before torch: ranges and a model path that exists."""
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--num-blocks", "--tp"):
        at_least(flag, getattr(args, flag[2:].replace("-", "_")), 1)
    at_least("--max-prefill-tokens-while-decoding", args.max_prefill_tokens_while_decoding, 0)
    if args.kv_cache_memory is not None:
        from minicb.core.kv_budget import gib_flag  # torch-free: "a positive number of GiB"

        gib_flag(args.kv_cache_memory)
    check_model_flag(args.model)


def check_model_flag(model: str | None, flag: str = "--model") -> None:
    """A model that is not here fails now, in a fraction of a second, and a Hub id is told that minicb
    never downloads (``minicb.model.weights.paths``)."""
    if model is not None:
        from minicb.model.weights.paths import check_model_path

        check_model_path(model, flag)


def check_generate_flags(args) -> None:
    at_least("--max-tokens", args.max_tokens, 1)
    number("--temperature", args.temperature, 0.0)
    at_least("--top-k", args.top_k, 0)
    number("--top-p", args.top_p, 0.0, 1.0, lo_open=True)
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        raise InvalidArgument(f"--seed must be in [0, 2**63 - 1], got {args.seed}")
    check_engine_flags(args)


def model_name(model: str | None) -> str:
    """How a progress line names the model: the file or directory name, or the default's."""
    return "SmolLM2-135M-Instruct" if model is None else os.path.basename(os.path.normpath(model))
