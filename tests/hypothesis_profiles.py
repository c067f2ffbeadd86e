"""Hypothesis profiles: ``thorough`` (the default, what CI runs) and ``quick`` (local runs).

    HYPOTHESIS_PROFILE=quick python -m pytest tests/core      # or: pytest --hypothesis-profile=quick

A property test states how many examples it wants under the thorough profile through ``examples(n)``;
a profile with ``max_examples = m`` runs ``n * m / 100`` of them (thorough: 100, so exactly ``n``;
quick: 10, a tenth). ``tests/conftest.py`` imports this module, so the profile is loaded before any
test module is.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# No wall clock in any profile: hypothesis' default 200 ms ``deadline`` per example and its ``too_slow``
# health check (on the time spent generating data) both fail a correct test on a busy machine, so they
# are off everywhere (tests/test_load_independence.py checks it).
NO_CLOCK = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=100, **NO_CLOCK)       # hypothesis' own default count
settings.register_profile("quick", max_examples=10, **NO_CLOCK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "thorough"))


def examples(n: int) -> int:
    """``n`` examples under the thorough profile, scaled to the loaded one (at least 1)."""
    return max(1, round(n * settings().max_examples / 100))
