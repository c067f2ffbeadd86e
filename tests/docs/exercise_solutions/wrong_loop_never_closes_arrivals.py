"""Wrong: never tells the scheduler that no more requests will come, so a
static batch waits for a full batch forever."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import generate as right_generate  # noqa: E402


def generate(scheduler, runner, requests):
    class Open:
        def __getattr__(self, name):
            return getattr(scheduler, name)

        def close_arrivals(self):
            pass
    return right_generate(Open(), runner, requests)
