"""Hypothesis profiles: ``thorough`` (the default, what CI runs) and ``quick`` (local runs).

    HYPOTHESIS_PROFILE=quick python -m pytest tests/core      # or: pytest --hypothesis-profile=quick

A property test states how many examples it wants under the thorough profile through ``examples(n)``;
a profile with ``max_examples = m`` runs ``n * m / 100`` of them (thorough: 100, so exactly ``n``;
quick: 10, a tenth). ``tests/conftest.py`` imports this module, so the profile is loaded before any
test module is.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("thorough", max_examples=100)       # hypothesis' own default
settings.register_profile("quick", max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "thorough"))


def examples(n: int) -> int:
    """``n`` examples under the thorough profile, scaled to the loaded one (at least 1)."""
    return max(1, round(n * settings().max_examples / 100))
