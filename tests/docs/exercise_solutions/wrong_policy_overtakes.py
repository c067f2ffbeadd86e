"""Wrong: admission skips a waiting request that does not fit and goes on to
the next one (overtaking), instead of stopping at the first that does not fit."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import ContinuousPolicy as Right  # noqa: E402


class ContinuousPolicy(Right):
    def run_waiting(self, work, budget):
        for seq in list(self.waiting):
            if not self.slots.num_free:
                break
            self.admit_one(seq, work, budget, self.blocks.block_size)
