"""The errors minicb raises on purpose.

Errors are part of the interface (DESIGN.md section 4): bad input raises ``ValueError`` (or one of the
subclasses below, which *are* ``ValueError``s) with a message that names the argument and the accepted
range. One bad request never takes the engine or the other requests down.
"""


class MinicbError(Exception):
    """Base class of every error minicb raises deliberately."""


class InvalidArgument(MinicbError, ValueError):
    """An argument is outside its accepted range; the message names both."""


class RequestRejected(InvalidArgument):
    """A request can never be served (e.g. it needs more KV blocks than the whole pool holds)."""


class ModelLoadError(MinicbError, ValueError):
    """A model path could not be loaded: missing, not a model, unsupported architecture or type."""


class DistributedError(MinicbError, RuntimeError):
    """Tensor-parallel ranks disagree, or a rank died: raised on every rank instead of hanging."""


def check_int(name: str, value, *, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[lo, hi]``, else raise ``InvalidArgument``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise InvalidArgument(f"{name} must be in {rng}, got {value}")
    return value


def check_float(name: str, value, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> float:
    """Return ``float(value)`` if it is a real number in the range, else raise ``InvalidArgument``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    if v != v or bad_lo or (hi is not None and v > hi):      # v != v: NaN is in no range
        left = "(" if lo_open else "["
        rng = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise InvalidArgument(f"{name} must be in {rng}, got {value}")
    return v
