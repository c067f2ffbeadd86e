"""Exercise 10 (the build-it track): the step loop.

Continuous batching is one loop: every step the scheduler plans who runs,
the runner computes it on the model, and the scheduler records what came
out, so that finished requests free their slot and blocks for the very next
step. You write that loop around a real ``Scheduler``
(``minicb.core.scheduler``) and a real ``ModelRunner``
(``minicb.runtime.runner``); the checker serves requests through it on a
tiny model and compares the tokens with a padded batch's.

What you have:

* ``scheduler.add(Sequence(request_id, prompt, params))`` queues a request
  (``minicb.core.sequence.Sequence``); ``scheduler.close_arrivals()`` says no
  more will come (a static batch waits for a full batch until it hears it);
  ``scheduler.has_unfinished()``;
* ``scheduler.schedule(now)`` returns this step's ``StepPlan``: its rows
  (``plan.seqs``, each with ``request_id`` and ``sample``: whether the row
  produces a token);
* ``runner.run(plan, params)`` runs the plan on the model and returns
  ``{request_id: token}`` for the sampling rows; ``params`` maps each
  sampling row's request id to its ``SamplingParams``;
* ``scheduler.update(plan, tokens, now)`` records the step and returns the
  requests (``Sequence``) that finished, with their ``output_token_ids``.

``requests`` is a list of ``(request_id, prompt, params, arrival)``: the
request arrives at the start of step ``arrival`` (steps count from 0; pass
the step number as ``now``). Serve them all; return ``{request_id: the
generated token ids}``.

    cp tutorials/exercises/step_loop.py my_loop.py
    python -m pytest tutorials/exercises/check_step_loop.py \\
        --solution my_loop.py

minicb's answer: ``minicb.engine.loop`` (``StepLoop._step``; read its
module docstring after you pass).
"""

from minicb.core.sequence import Sequence  # noqa: F401  (you need it)


def generate(scheduler, runner, requests: list[tuple]) -> dict[str, list]:
    """Serve ``requests`` through ``scheduler`` and ``runner`` to the end."""
    raise NotImplementedError("exercise 10: generate")
