"""Progress for the steps a person waits for: loading a model, a simulation, a benchmark, a tutorial.

Progress goes to stderr, so that stdout stays the command's output (a table, generated text) and can
be piped or redirected. How it shows depends on where stderr goes:

* **a terminal**: one line, redrawn in place (``\\r``) a few times a second, replaced at the end by
  ``what: done in 12.3 s``;
* **anything else** (a pipe, a log file, CI): a line when the wait has lasted ``after`` seconds, then
  a *heartbeat* line every ``every`` seconds while it lasts, and the ``done in`` line. A log never goes
  quiet for minutes, and a person who piped stdout into ``less`` still sees that work goes on.

A wait shorter than ``after`` (1 s by default) prints nothing at all, so a quick command keeps an
empty stderr. ``MINICB_PROGRESS=0`` turns progress off everywhere (the test suite sets it: its
checks of stderr must not depend on how loaded the machine is); ``--no-progress`` on ``minicb bench``
and ``minicb simulate`` does the same for one command.

    with Progress("loading SmolLM2-135M-Instruct"):      # a wait with no count: elapsed time only
        llm = LLM()

    with Progress("simulate", total=1000, unit="requests") as p:
        for ...:
            p.update(done=n, info="sim 12.5 s")

A long wait made of steps (a model load: reading the weights, packing them, the KV cache) names
each step with ``phase``: every phase after the first line gets a line of its own, so a log reads
one plain line per phase. Code deep inside a wait finds the progress line it runs under with
``Progress.current()`` (``LLM()`` names its load phases on the command's line, or makes its own).

A daemon thread draws the line (the work may be one call that never returns control, like a model
load); ``update`` only stores the numbers. Torch-free. ``tick(now)`` is what the thread calls, so a
test drives it with a fake clock and no thread (``thread=False``).
"""

from __future__ import annotations

import os
import sys
import threading
import time

# A model load's line shows sooner than other waits': a load is never short with a real model, and a
# person who just typed a command should see within a second or two that it is on its way.
LOAD_AFTER = 0.5


def enabled_by_default() -> bool:
    """False when ``MINICB_PROGRESS`` is ``0`` (or ``false``, ``no``, ``off``)."""
    return os.environ.get("MINICB_PROGRESS", "1").strip().lower() not in ("0", "false", "no", "off")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """One task's progress line on stderr (see the module docstring for what shows where).

    ``what``: the task, as a person reads it. ``total`` / ``unit``: a count to show (``12/40
    requests``), or None for a wait with no count. ``after``: seconds of silence before the first
    line; ``every``: seconds between heartbeat lines when stderr is not a terminal. ``tty`` overrides
    the terminal check (tests)."""

    _active: list[Progress] = []           # the started, not yet stopped ones, innermost last

    @classmethod
    def current(cls) -> Progress | None:
        """The innermost progress line now being shown (started, not stopped), or None."""
        return cls._active[-1] if cls._active else None

    def __init__(self, what: str, total: int | None = None, unit: str = "", *, stream=None,
                 after: float = 1.0, every: float = 5.0, enabled: bool | None = None,
                 tty: bool | None = None, clock=time.monotonic, thread: bool = True) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self.info = ""
        self.after, self.every = after, every
        self._stream = sys.stderr if stream is None else stream
        self._enabled = (enabled_by_default() if enabled is None else enabled) and self._stream is not None
        self._tty = _isatty(self._stream) if tty is None else tty
        self._clock = clock
        self._use_thread = thread
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0: float | None = None
        self._last_line: float | None = None     # when the last (non-TTY) line was written
        self._drawn = False                      # a TTY line is on screen
        self.lines = 0                           # lines written (TTY redraws count once)

    # --- the caller's side --------------------------------------------------------------------------
    def start(self) -> Progress:
        self._t0 = self._clock()
        Progress._active.append(self)
        if self._enabled and self._use_thread:
            self._thread = threading.Thread(target=self._run, name="minicb-progress", daemon=True)
            self._thread.start()
        return self

    def update(self, done: int | None = None, info: str | None = None, total: int | None = None) -> None:
        """Record how far the task is; the line shows it at its next redraw or heartbeat."""
        with self._lock:
            if done is not None:
                self.done = done
            if info is not None:
                self.info = info
            if total is not None:
                self.total = total

    def phase(self, info: str, now: float | None = None) -> None:
        """The wait moves on to its next step, ``info`` (``"packing the weights for this CPU"``).
        Once a line has been shown, the step gets a line of its own at once: on a terminal the live
        line of the step before stays on screen, with its time, and a new one starts below it."""
        with self._lock:
            if self._enabled and self._t0 is not None and info != self.info and (self._drawn or self.lines):
                now = self._clock() if now is None else now
                if self._tty:
                    self._write(self.line(now), final=True)    # the step before, as it ended
                self.info = info
                if not self._tty:
                    self._write(self.line(now))
                    self._last_line = now
            self.info = info

    def stop(self, ok: bool = True) -> float:
        """End the task; if anything was shown, end with ``what: done in N s`` (``ok``) or erase the
        live line (an error follows, and says what happened). Returns the elapsed seconds."""
        if self in Progress._active:
            Progress._active.remove(self)
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elapsed = self.elapsed()
        with self._lock:
            if self._enabled and (self._drawn or self.lines):
                if ok:
                    self._write(f"{self.what}: done in {elapsed:.1f} s", final=True)
                elif self._drawn:
                    self._erase()
        return elapsed

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(ok=exc_type is None)

    def elapsed(self, now: float | None = None) -> float:
        if self._t0 is None:
            return 0.0
        return (self._clock() if now is None else now) - self._t0

    # --- the drawing side -------------------------------------------------------------------------------
    def line(self, now: float | None = None) -> str:
        """The progress line as it reads now: ``what: 12/40 requests, info (7 s)``."""
        parts = []
        if self.total is not None:
            parts.append(f"{self.done:,}/{self.total:,}{' ' + self.unit if self.unit else ''}")
        if self.info:
            parts.append(self.info)
        body = ", ".join(parts)
        return f"{self.what}: {body + ' ' if body else ''}({self.elapsed(now):.0f} s)"

    def tick(self, now: float | None = None) -> None:
        """Draw if it is time to: on a TTY every call past ``after``; otherwise the first line at
        ``after`` and one every ``every`` seconds after the last."""
        if not self._enabled or self._t0 is None:
            return
        now = self._clock() if now is None else now
        if now - self._t0 < self.after:
            return
        with self._lock:
            if self._tty:
                self._write(self.line(now))
            elif self._last_line is None or now - self._last_line >= self.every:
                self._write(self.line(now))
                self._last_line = now

    def _run(self) -> None:
        period = 0.25 if self._tty else min(self.every, max(self.after, 0.05)) / 4
        while not self._stopped.wait(period):
            self.tick()

    def _write(self, text: str, final: bool = False) -> None:
        try:
            if self._tty:
                self._stream.write(f"\r\x1b[2K{text}" + ("\n" if final else ""))
                self.lines += not self._drawn or final
                self._drawn = not final
            else:
                self._stream.write(text + "\n")
                self.lines += 1
            self._stream.flush()
        except (OSError, ValueError):       # stderr closed or gone: progress is never worth an error
            self._enabled = False

    def _erase(self) -> None:
        try:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()
        except (OSError, ValueError):
            pass
        self._drawn = False
