"""Wrong: drops a preempted victim's grant from the step but never gives its
tokens back to the budget, so the requests after it get less than is left."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import ContinuousPolicy as Right  # noqa: E402


class ContinuousPolicy(Right):
    def drop(self, victim, work, budget):
        work.scheduled.pop(victim.request_id, None)       # but no budget.give_back
        work.copy_blocks.pop(victim.request_id, None)
        work.swap_out += self.sched.preempt(victim).swap_out
        work.preempted.append(victim.request_id)
