"""One loop for requests that arrive over time: ``drive(engine, arrivals)``.

Continuous batching is about requests that arrive *while* others run. Every way minicb replays a
workload (``minicb bench``, ``minicb trace``, ``minicb simulate``, the tutorials, ``minicb generate``)
is this one loop::

    while arrivals remain or the engine has work:
        add every request whose arrival time has come      (engine.add_request)
        if none remain to come: engine.close_arrivals()     (static may run a short batch now)
        outputs = engine.step()                             (one iteration of the batch)
        idle, and the next arrival is in the future?  ->  wait for it

What "time" is depends on the caller, through ``now`` and ``wait``:

* ``now=None`` (default): time is counted **in steps**. Request ``i`` joins before step
  ``arrivals[i].time``, and the loop calls ``step()`` every iteration, idle ones too, so a gap
  between arrivals shows as idle steps (the tutorials and ``minicb trace``).
* ``now=clock, wait=sleep_until``: **wall-clock** time (``minicb bench``): an idle engine sleeps until
  the next arrival instead of spinning.
* ``now=engine.now, wait=engine.advance_to``: a **simulated** clock (``minicb simulate``), which jumps.

The engine is anything with ``add_request(request_id, prompt, params, arrival_time=...)``, ``step()``,
``has_unfinished_requests()``, ``close_arrivals()`` and ``last_plan``: ``LLMEngine`` is, whatever its
runner (the simulator's ``SimulatedEngine`` is an ``LLMEngine`` too). This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from minicb.core.errors import InvalidArgument
from minicb.core.sampling_params import SamplingParams


class NoProgress(RuntimeError):
    """The engine stepped idle with requests unfinished and none left to arrive: it would spin forever."""


@dataclass(slots=True, frozen=True)
class Arrival:
    """One request and the time it arrives (in steps, or in the caller's clock units)."""

    time: float
    request_id: str
    prompt: Any                      # token ids, or text for an engine with a tokenizer
    params: SamplingParams

    def __post_init__(self) -> None:
        if isinstance(self.time, bool) or not isinstance(self.time, (int, float)) \
                or not math.isfinite(self.time) or self.time < 0:
            raise InvalidArgument(f"arrival time must be a finite number >= 0, got {self.time!r}")


def drive(engine, arrivals: Iterable[Arrival], *, now: Callable[[], float] | None = None,
          wait: Callable[[float], None] | None = None,
          on_step: Callable[[list], None] | None = None, close: bool = True) -> list:
    """Serve ``arrivals`` with ``engine`` until every one has finished; return the final outputs in the
    order the requests finished. ``on_step(outputs)`` sees every step's outputs (progress, streaming).
    ``close=False`` never calls ``close_arrivals`` (more requests may come from elsewhere)."""
    order = sorted(arrivals, key=lambda a: a.time)
    if now is not None and wait is None:
        raise InvalidArgument("drive: a clock (now) needs a wait(until) function too")
    done: list = []
    k = step = 0
    while k < len(order) or engine.has_unfinished_requests():
        t = step if now is None else now()
        while k < len(order) and order[k].time <= t:
            a = order[k]
            engine.add_request(a.request_id, a.prompt, a.params,
                               arrival_time=None if now is None else a.time)
            k += 1
        if close and k == len(order):
            engine.close_arrivals()
        idle = True
        if now is None or engine.has_unfinished_requests():
            outs = engine.step()
            step += 1
            done += [o for o in outs if o.finished]
            if on_step is not None:
                on_step(outs)
            idle = engine.last_plan is None or engine.last_plan.is_empty
        if idle and now is not None and k < len(order):
            wait(order[k].time)                 # nothing runnable: wait for the next arrival
        elif idle and close and k == len(order) and engine.has_unfinished_requests():
            raise NoProgress(f"the scheduler made no progress at step {step} with requests unfinished "
                             "and no arrivals left")
    return done
