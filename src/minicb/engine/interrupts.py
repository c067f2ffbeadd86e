"""Ctrl-C at a safe point: the engine's bookkeeping is never interrupted half way.

In Python a ``KeyboardInterrupt`` is raised by the SIGINT handler, between any two bytecodes of the
main thread. Inside the engine's bookkeeping (the scheduler's ``schedule`` and ``update``, finishing,
aborting, failing a step: plain Python that moves requests between queues and blocks between lists)
that is the worst possible moment: a request can be in no queue, a block can be freed twice, an
output can be made and then dropped. Snapshotting everything to undo it afterwards is expensive
and easy to get wrong (every new field must join the snapshot). So minicb does what a kernel does
with a critical section: it *defers* the signal::

    with DeferredInterrupts() as ctrl_c:        # SIGINT now only sets a flag
        plan = scheduler.schedule()             # bookkeeping: never interrupted
        with ctrl_c.allowed():                  # the forward: Ctrl-C acts at once here, and a
            sampled = runner.run(plan, params)  #   pending one is delivered on entry
        scheduler.update(plan, sampled)         # bookkeeping again
    # leaving the block: a Ctrl-C still pending is raised here, at the step boundary

So a Ctrl-C is delivered at the next safe point: inside the forward (the step's requests then end
with ``finish_reason == "error"``, as for any failure of the tensor work) or at the step boundary
(no request is harmed: the step's outputs come out of the next ``step()``).

Only the main thread receives signals, and only there can a handler be installed, so in any other
thread (``minicb serve`` steps the engine in one) this is a no-op, and so it is when the program has
its own SIGINT handler (it is left alone) or ignores the signal. A second Ctrl-C while one is pending
changes nothing: it is the same request to stop, delivered once. This module imports no torch.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class DeferredInterrupts:
    """A context in which SIGINT is recorded instead of raised (see the module docstring)."""

    __slots__ = ("pending", "_active", "_previous")

    def __init__(self) -> None:
        self.pending = False          # a Ctrl-C arrived while deferred and is not delivered yet
        self._active = False          # our recording handler is installed
        self._previous = None         # the handler it replaced (Python's default_int_handler)

    def __enter__(self) -> DeferredInterrupts:
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._record)
            self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._active:
            signal.signal(signal.SIGINT, self._previous)
            self._active = False
        if self.pending and exc_type is None:
            self.pending = False
            raise KeyboardInterrupt          # delivered at the safe point: the end of the block

    def _record(self, signum, frame) -> None:
        self.pending = True

    @contextmanager
    def allowed(self):
        """A window in which Ctrl-C acts at once (the tensor work); a pending one is raised on entry."""
        if not self._active:
            yield
            return
        signal.signal(signal.SIGINT, self._previous)
        try:
            if self.pending:
                self.pending = False
                raise KeyboardInterrupt
            yield
        finally:
            signal.signal(signal.SIGINT, self._record)
