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
