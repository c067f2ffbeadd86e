"""The live feed's frames, without a server: the token rate when steps are slower than its window."""

from __future__ import annotations

import json

from minicb.core.stats import SchedulerSnapshot
from minicb.entrypoints.serve.live import RATE_WINDOW_S, Column, LiveFeed, _Watcher


def snapshot(step: int) -> SchedulerSnapshot:
    return SchedulerSnapshot(step=step, slots=(None,) * 4, block_tables=(), host_tables=(), num_blocks=8,
                             num_free_blocks=8, num_cached_blocks=2, num_host_blocks=0,
                             num_free_host_blocks=0, waiting=(), running=(), swapped=(), arrivals_open=True,
                             cached_blocks=(5, 1))


def frame(durations: list[float], sampled: int) -> dict:
    feed, t = LiveFeed({"model": "m"}), 100.0
    for k, d in enumerate(durations):
        feed._publish(Column(k, k + 1, t, t + d, (), sampled, 0), snapshot(k + 1))
        t += d
    text = feed._frame(_Watcher())
    return json.loads(text.removeprefix("data: "))


def test_steps_longer_than_the_window_still_give_a_rate():
    slow = 1.5 * RATE_WINDOW_S                       # 256 slots of a real model on a CPU: seconds a step
    # load-independent: step times passed in
    assert frame([slow, slow, slow], 256)["tps"] == 2 * 256 / (2 * slow)      # the last two steps
    # load-independent: step times passed in
    assert frame([0.5] * 10, 8)["tps"] == 5 * 8 / 2.5                         # the window: 5 steps


def test_the_cached_blocks_are_sent_sorted():
    assert frame([0.1], 1)["state"]["cached"] == [1, 5]
