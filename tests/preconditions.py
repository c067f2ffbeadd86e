"""What a test does when something it needs is missing from the machine.

Locally a missing optional tool (the real model, mkdocs, Chromium, the transformers API a test compares
with) skips the test with the reason. In CI (``CI`` set) it fails: ``make setup`` installs all of them,
so there a missing one is a broken set-up, and a skip would turn it into a green run that tested less.
"""

from __future__ import annotations

import os

import pytest


def unavailable(reason: str):
    """Skip (locally) or fail (in CI) the calling test because ``reason``; never returns."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)
