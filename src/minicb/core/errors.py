"""The errors minicb raises on purpose.

Errors are part of the interface (docs/design.md, Conventions): bad input raises ``ValueError`` (or one of the
subclasses below, which *are* ``ValueError``s) with a message that names the argument and the accepted
range. One bad request never takes the engine or the other requests down.
"""

import math
import numbers
import operator


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


class RowFailed(MinicbError):
    """One request's row of a step cannot be sampled (a logits processor raises it: a grammar's matcher
    broke). The sampler catches it and ends that request alone with ``finish_reason == "error"`` and
    this message; it never leaves the step."""


class EngineDeadError(MinicbError, RuntimeError):
    """The engine's own bookkeeping failed (a bug, not a request's fault): every request it held has
    ended with ``finish_reason == "error"`` and the reason, and it refuses further work (vLLM V1's name)."""


def describe(value) -> str:
    """A short, always printable rendering of ``value`` for an error message.

    ``repr`` is not enough: a 10**400 has 401 digits (and Python refuses to print an int of more than
    4,300), and a prompt may be megabytes long. Anything longer than 60 characters is cut.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"{'-' if value < 0 else ''}an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_bool(value) -> bool:
    """``True``, ``numpy.True_`` and a boolean tensor are flags, never counts or token ids."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def as_int(value) -> int | None:
    """``value`` as a plain ``int`` if it is one integer: an ``int``, a numpy integer, a 0-d integer
    array or tensor (anything with ``__index__``); ``None`` otherwise (bools included, and arrays or
    tensors with a shape: a list of one token is not a token)."""
    if _is_bool(value) or getattr(value, "ndim", 0) != 0:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_real(value) -> float | None:
    """``value`` as a plain ``float`` if it is one real number: ``int``, ``float``, a numpy scalar
    (``float32`` as much as ``float64``), a 0-d float or integer array or tensor; ``None`` otherwise
    (bools, strings, complex numbers). An integer too large for a float becomes +-inf, so a range
    check reports it instead of an ``OverflowError``."""
    if _is_bool(value):
        return None
    if not isinstance(value, numbers.Real):
        kind = str(getattr(value, "dtype", ""))
        if getattr(value, "ndim", None) != 0 or not ("float" in kind or "int" in kind):
            return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        return None


def check_int(name: str, value, *, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as a plain int if it is an integer (``as_int``: numpy and torch integers
    welcome, bools not) in ``[lo, hi]``, else raise ``InvalidArgument``."""
    v = as_int(value)
    if v is None:
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__} {describe(value)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise InvalidArgument(f"{name} must be in {rng}, got {describe(v)}")
    return v


def check_float(name: str, value, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, finite: bool = False) -> float:
    """Return ``float(value)`` if it is a real number (``as_real``) in the range, else raise
    ``InvalidArgument``. NaN is in no range; ``finite`` also refuses +-inf."""
    v = as_real(value)
    if v is None:
        raise InvalidArgument(f"{name} must be a number, got {type(value).__name__} {describe(value)}")
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    if v != v or bad_lo or (hi is not None and v > hi) or (finite and math.isinf(v)):
        left = "(" if lo_open else "["
        rng = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        what = "a finite number in " if finite else ""
        shown = value if isinstance(value, int) else v      # 10**400 by its digits, np.float32 as a float
        raise InvalidArgument(f"{name} must be {what or 'in '}{rng}, got {describe(shown)}")
    return v
