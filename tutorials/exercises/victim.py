"""Exercise 4: which running request to preempt (``choose_victim``).

When the KV pool runs out, the scheduler preempts running requests until the
one that needs room fits. The victim is the LEAST important request:

* ``fcfs``: the most recently ADMITTED one (vLLM's ``running.pop()``). Note
  admitted, not arrived: a request that was preempted earlier and came back
  was admitted again, later than younger requests;
* ``priority``: the largest ``priority`` value (smaller = more important,
  vLLM's convention); among equals, the latest arrival.

Each running request is a dict: ``{"id": "r3", "arrival": 3, "admitted": 5,
"priority": 0}`` (arrival and admission counters: larger = later).

Write the function, then check it:

    cp tutorials/exercises/victim.py my_victim.py
    python -m pytest tutorials/exercises/check_victim.py --solution my_victim.py

minicb's answer: ``minicb.core.preemption.choose_victim`` (``importance_key``).
"""


def choose_victim(running: list[dict], policy: str = "fcfs") -> str:
    """The id of the request to preempt among ``running``."""
    raise NotImplementedError("exercise 4: choose_victim")
