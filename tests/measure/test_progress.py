"""``minicb.measure.progress``: what a person waiting sees on stderr, on a terminal and in a pipe.

Driven by a fake clock and ``tick`` (no thread), so nothing here depends on the machine's speed; one
test runs the real thread and waits for its lines with no time limit but the test's."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from minicb.measure.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pipe_progress(**kw):
    clock, out = FakeClock(), io.StringIO()
    p = Progress("simulate", stream=out, clock=clock, thread=False, enabled=True, tty=False, **kw)
    return p, clock, out


def test_a_short_wait_prints_nothing():
    p, clock, out = pipe_progress(total=10, unit="requests")
    p.start()
    for t in (0.2, 0.5, 0.9):
        clock.now = 100 + t
        p.tick()
    p.stop()
    assert out.getvalue() == ""  # load-independent: a fake clock (times passed in)


def test_a_pipe_gets_a_first_line_then_a_heartbeat_every_few_seconds_then_the_time():
    p, clock, out = pipe_progress(total=40, unit="requests", after=1.0, every=5.0)
    p.start()
    for k in range(1, 121):                 # 12 s in ticks of 0.1 s
        clock.now = 100 + k / 10
        p.update(done=k // 3, info=f"sim {k / 10:.1f} s")
        p.tick()
    p.stop()
    lines = out.getvalue().splitlines()
    # at 1 s, 6 s, 11 s; then the final line at 12 s
    # load-independent: a fake clock (times passed in)
    assert lines == ["simulate: 3/40 requests, sim 1.0 s (1 s)",
                     "simulate: 20/40 requests, sim 6.0 s (6 s)",
                     "simulate: 36/40 requests, sim 11.0 s (11 s)",
                     "simulate: done in 12.0 s"]


def test_a_wait_with_no_count_shows_the_elapsed_time():
    p, clock, out = pipe_progress(every=3.0)
    p.start()
    for t in (0.5, 1.0, 2.0, 4.0, 4.5):
        clock.now = 100 + t
        p.tick()
    p.stop()
    # load-independent: a fake clock (times passed in)
    assert out.getvalue().splitlines() == ["simulate: (1 s)", "simulate: (4 s)", "simulate: done in 4.5 s"]


def test_a_terminal_line_is_redrawn_in_place_and_ends_with_the_time():
    clock, out = FakeClock(), io.StringIO()
    p = Progress("loading", stream=out, clock=clock, thread=False, enabled=True, tty=True).start()
    for t in (0.5, 1.5, 2.5):
        clock.now = 100 + t
        p.tick()
    p.stop()
    text = out.getvalue()
    # load-independent: a fake clock (times passed in)
    assert text.count("\n") == 1 and text.endswith("loading: done in 2.5 s\n")
    assert text.count("\r\x1b[2K") == 3                          # two redraws, then the final line
    # load-independent: a fake clock (times passed in)
    assert "loading: (2 s)" in text and "(0 s)" not in text      # nothing before `after`


def test_an_error_erases_the_terminal_line_and_adds_no_done_line():
    clock, out = FakeClock(), io.StringIO()
    p = Progress("loading", stream=out, clock=clock, thread=False, enabled=True, tty=True).start()
    clock.now = 103
    p.tick()
    p.stop(ok=False)
    assert out.getvalue().endswith("\r\x1b[2K") and "done" not in out.getvalue()


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("MINICB_PROGRESS", "0")
    clock, out = FakeClock(), io.StringIO()
    p = Progress("x", stream=out, clock=clock, thread=False, tty=False).start()
    clock.now = 200
    p.tick()
    p.stop()
    assert out.getvalue() == ""


def test_a_closed_stderr_is_not_an_error():
    clock, out = FakeClock(), io.StringIO()
    p = Progress("x", stream=out, clock=clock, thread=False, enabled=True, tty=False).start()
    out.close()
    clock.now = 110
    p.tick()
    p.stop()                                   # no ValueError from the closed stream


@pytest.mark.timing
def test_the_thread_writes_heartbeats_while_the_caller_blocks():
    """A real process whose main thread blocks until the progress thread has written two lines (no
    time limit but the test's: how fast that happens is the machine's business) with stderr piped:
    stderr gets the lines and the final one; what it prints to stdout is untouched."""
    code = ("import time; from minicb.measure.progress import Progress\n"
            "with Progress('loading', after=0.05, every=0.1) as p:\n"
            "    while p.lines < 2:\n"
            "        time.sleep(0.01)\n"
            "print('result')\n")
    env = dict(os.environ, MINICB_PROGRESS="1")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout == "result\n"
    lines = p.stderr.splitlines()
    # load-independent: waits for the lines (no time limit but a 60 s hang guard); no value read
    assert len(lines) >= 3 and lines[0].startswith("loading: (") and lines[-1].startswith("loading: done in")


# --- phases: one line per step of a long wait (issue 45) ----------------------------------------------
def test_phases_before_the_first_line_print_nothing_after_it_one_line_each():
    p, clock, out = pipe_progress(after=1.0, every=5.0)
    p.start()
    p.phase("importing torch")          # at 0 s: nothing is shown yet, so nothing is said
    clock.now = 101.0
    p.tick()                            # the first line, naming the phase it is in
    clock.now = 102.0
    p.phase("reading the weights")      # a line at once, not at the next heartbeat
    p.phase("reading the weights")      # the same phase again: nothing
    clock.now = 103.0
    p.phase("building the model")
    clock.now = 104.0
    p.tick()                            # a heartbeat is due only at 1 + 5 s... after the last line
    p.stop()
    assert out.getvalue().splitlines() == [
        "simulate: importing torch (1 s)", "simulate: reading the weights (2 s)",
        "simulate: building the model (3 s)", "simulate: done in 4.0 s"]


def test_on_a_terminal_each_phase_keeps_its_own_line():
    clock, out = FakeClock(), io.StringIO()
    p = Progress("loading", stream=out, clock=clock, thread=False, enabled=True, tty=True)
    p.start()
    p.phase("one")
    clock.now = 101.5
    p.tick()
    p.phase("two")                      # "one" ends with a newline, its time on it
    clock.now = 103.0
    p.tick()
    p.stop()
    shown = [ln.split("\x1b[2K")[-1] for ln in out.getvalue().split("\n") if ln]
    assert shown == ["loading: one (2 s)", "loading: done in 3.0 s"]
    assert out.getvalue().count("\n") == 2


def test_current_is_the_innermost_running_progress():
    assert Progress.current() is None
    with Progress("outer", enabled=False) as outer:
        assert Progress.current() is outer
        with Progress("inner", enabled=False) as inner:
            assert Progress.current() is inner
        assert Progress.current() is outer
    assert Progress.current() is None
