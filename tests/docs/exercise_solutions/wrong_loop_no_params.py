"""Wrong: runs every plan without sampling parameters (``params`` None)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import generate as right_generate  # noqa: E402


def generate(scheduler, runner, requests):
    class Bare:
        def run(self, plan, params):
            return runner.run(plan, None)
    return right_generate(scheduler, Bare(), requests)
