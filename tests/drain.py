"""The one way a test runs an engine or a scheduler to its end: ``drain``.

A drain that never ends is a bug (a request the scheduler can never serve, a leaked slot), and a
hand-written ``while engine.has_unfinished_requests(): engine.step()`` turns that bug into a test
that hangs. ``drain`` steps at most ``max_steps`` times and then fails, saying what is left. It is
torch-free, so the core's tests use it too (with a ``step`` that runs a fake model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def drain(target: Any, step: Callable[[Any], Any] | None = None, *, max_steps: int = 10_000,
          more: Callable[[], bool] | None = None, check: bool = False) -> list:
    """Step ``target`` until nothing is unfinished; return every step's outputs, in order.

    ``target`` is an engine (``has_unfinished_requests()``; ``step()`` returns its outputs) or a
    scheduler (``has_unfinished()``); ``step(target)`` replaces ``target.step()`` (a scheduler needs
    one: schedule, run a model, update) and returns that step's outputs, or None. While ``more()`` is
    true the loop goes on even with nothing unfinished (requests still to arrive; ``step`` adds them).
    ``check``: the scheduler's ``check_integrity()`` after every step. Raises ``AssertionError`` after
    ``max_steps`` steps instead of spinning.
    """
    unfinished = getattr(target, "has_unfinished_requests", None) or target.has_unfinished
    advance = step if step is not None else (lambda t: t.step())
    outputs: list = []
    for _ in range(max_steps):
        if not (unfinished() or (more is not None and more())):
            return outputs
        outputs.extend(advance(target) or ())
        if check:
            getattr(target, "scheduler", target).check_integrity()
    if unfinished() or (more is not None and more()):
        raise AssertionError(f"not drained after {max_steps} steps: {_left(target)}")
    return outputs


def finals(outputs: list) -> dict:
    """The finished ones of ``outputs`` (engine outputs, or a scheduler's finished sequences) by
    request id; fails if a request finished twice."""
    done: dict = {}
    for o in outputs:
        if getattr(o, "finished", None) is True or getattr(o, "is_finished", False):
            assert o.request_id not in done, f"request {o.request_id!r} finished twice"
            done[o.request_id] = o
    return done


def _left(target: Any) -> str:
    snap = getattr(target, "snapshot", None)
    if snap is None:
        return repr(target)
    s = snap()
    return f"waiting={list(s.waiting)} running={list(s.running)} swapped={list(s.swapped)}"
