"""Wrong: adds every request before the first step, whatever its arrival."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import generate as right_generate  # noqa: E402


def generate(scheduler, runner, requests):
    return right_generate(scheduler, runner,
                          [(r, p, s, 0) for r, p, s, _ in requests])
