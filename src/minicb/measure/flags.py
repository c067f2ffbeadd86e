"""Checks of the measuring commands' flags (``minicb bench``, ``simulate``, ``trace``), done before any
work. Torch-free.

Every number a user types is checked to be finite, in range and bounded, because each unchecked one
had a way to go wrong late or never end: a NaN overhead stopped the simulated clock (an endless
loop), ``--rate 1e-300`` put arrivals at 1e300 seconds (an overflow in ``sleep``), ``--seed 1e23``
overflowed torch's generator, a huge ``--prompt-len`` built a prompt of 10**12 tokens before anything
rejected it. And every output path is checked before the run, not after an hour of it.
"""

from __future__ import annotations

import os

from minicb.core.errors import InvalidArgument, check_float, check_int

MAX_SEED = 2**63 - 1              # torch.Generator.manual_seed takes a signed 64-bit integer
MIN_RATE, MAX_RATE = 1e-3, 1e6    # requests/s: one every 17 minutes .. a million a second
MAX_REQUESTS = 1_000_000
MAX_LENGTH = 2**20                # any token length or length limit (a million tokens)
MAX_SCALE = 1e6                   # --time-scale, --output-div: factors in [1/MAX_SCALE, MAX_SCALE]


def check_workload_args(args) -> None:
    """The flags ``add_workload_args`` adds (bench and simulate)."""
    check_int("--num-requests", args.num_requests, lo=1, hi=MAX_REQUESTS)
    check_int("--seed", args.seed, lo=0, hi=MAX_SEED)
    for flag, value, lo in (("--max-prompt", args.max_prompt, 1), ("--max-output", args.max_output, 1),
                            ("--min-len", args.min_len, 1), ("--max-total", args.max_total, 0)):
        if value is not None:
            check_int(flag, value, lo=lo, hi=MAX_LENGTH)
    check_scale("--output-div", args.output_div)


def check_rate(flag: str, value) -> float:
    """A Poisson arrival rate, requests per second."""
    return check_float(flag, value, lo=MIN_RATE, hi=MAX_RATE, finite=True)


def check_scale(flag: str, value) -> float:
    return check_float(flag, value, lo=1 / MAX_SCALE, hi=MAX_SCALE, finite=True)


def check_out_dir(flag: str, path: str | None) -> None:
    """``path`` is (now) a directory this process can write into: create it before the run, so that a
    bad ``--out`` (``/dev/null/x``, a file, no permission) fails in a second, not after the run."""
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise InvalidArgument(f"{flag} {path}: cannot create the directory: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{flag} {path}: the directory is not writable")


def check_out_file(flag: str, path: str | None) -> None:
    """``path`` can be written as a file: its directory exists and is writable, and it is no directory."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InvalidArgument(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise InvalidArgument(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{flag} {path}: the directory {folder} is not writable")


def check_plots_possible(flag: str, wanted: bool, skip_flag: str | None = "--no-plots") -> None:
    """``wanted`` plots need matplotlib, an optional dependency: say so before the run, not after it
    (the run may take minutes, and its figures would be lost with the plots)."""
    import importlib.util

    if wanted and importlib.util.find_spec("matplotlib") is None:
        skip = f", or leave the plots out with {skip_flag}" if skip_flag else ""
        raise InvalidArgument(f"{flag} draws plots with matplotlib, which is not installed: "
                              f"pip install 'minicb[plots]'{skip}")
