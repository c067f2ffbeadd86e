"""Wrong: preempts the MOST important running request (the oldest admission)
instead of the least important (the newest)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import ContinuousPolicy as Right  # noqa: E402


class ContinuousPolicy(Right):
    def victim(self):
        return next(iter(self.running.values()))
