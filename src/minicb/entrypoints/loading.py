"""What the commands say about a model load, in words a newcomer reads.

Every CPU load logs which matrix-product path the linear layers got, and why, as one INFO record on
the ``minicb.load`` logger (``cpu_fast_paths``): ``minicb: float32 linear layers on onednn-f32:
packed oneDNN 1.56x MKL on a 16x576x960 float32 product (flags: ...); steps of up to 4096 rows on
the skinny kernel (its AVX-512 path)``. That is the record a benchmark wants beside its figures
(``minicb bench`` prints it as it is), but to someone who typed ``minicb generate`` it says little,
so ``minicb generate`` and ``minicb serve`` print it reworded::

    minicb: linear layers on oneDNN, their weights repacked once for this CPU; decode steps on a
    small C kernel that reads each weight once (-v: which path and why)

and the record itself with ``-v``. Torch-free: only ``logging``.
"""

from __future__ import annotations

import contextlib
import logging
import sys

LOAD_LOGGER = "minicb.load"       # the logger cpu_fast_paths writes its one line to

PATHS = {                         # cpu_linear's path names, in plain words
    "onednn-f32": "oneDNN, their weights repacked once for this CPU",
    "onednn-bf16": "oneDNN in bfloat16, their weights repacked once for this CPU's bfloat16 instructions",
    "mkl": "PyTorch's default matrix library (MKL)",
    "torch": "PyTorch's own code",
}


def plain(record: logging.LogRecord) -> str:
    """The load record in plain words; the record's own text if it is not the shape expected
    (``"minicb: %s linear layers on %s: %s%s"``: dtype, path, why, what the skinny kernel does)."""
    args = record.args if isinstance(record.args, tuple) else ()
    if len(args) != 4 or str(args[1]) not in PATHS:
        return record.getMessage()
    _, path, _, skinny = (str(a) for a in args)
    kernel = ("; decode steps on a small C kernel that reads each weight once"
              if "on the skinny kernel" in skinny else "")
    return f"minicb: linear layers on {PATHS[path]}{kernel} (-v: which path and why)"


class _LoadLineHandler(logging.Handler):
    """Writes each load record to whatever ``sys.stderr`` is when it is emitted (a test's captured
    stream; a closed one: then nothing), reworded unless ``verbose``."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if sys.stderr is not None:
                sys.stderr.write((record.getMessage() if self.verbose else plain(record)) + "\n")
                sys.stderr.flush()
        except (OSError, ValueError):
            pass


@contextlib.contextmanager
def load_lines(verbose: bool = False):
    """While a command runs, show the ``minicb.load`` record on stderr, reworded (or as it is,
    ``verbose``); the one stderr handler of the record meanwhile (another one, such as the one
    ``minicb bench`` adds, is set aside and put back after)."""
    log = logging.getLogger(LOAD_LOGGER)
    others = [h for h in log.handlers if type(h).__name__ in ("_StderrHandler", "_LoadLineHandler")]
    for h in others:
        log.removeHandler(h)
    mine, level = _LoadLineHandler(verbose), log.level
    log.addHandler(mine)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(mine)
        log.setLevel(level)
        for h in others:
            log.addHandler(h)
