"""A pytest plugin for ``make test-core``: ``import torch`` fails for the whole session, and the session
fails if torch got imported anyway. The core's tests passing under it proves the core needs no torch.

    PYTHONPATH=tests python -m pytest -p no_torch tests/core

Loaded with ``-p`` it is imported before any conftest or test module, so nothing can import torch
first. A blocked import raises ``ModuleNotFoundError``, as if torch were not installed.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

BLOCKED = "torch"


class _NoTorch(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {name!r} (make test-core blocks torch)", name=name)
        return None


if BLOCKED in sys.modules:
    raise RuntimeError("torch was imported before the no_torch plugin: load it with -p no_torch")
sys.meta_path.insert(0, _NoTorch())


def pytest_sessionfinish(session, exitstatus) -> None:
    if BLOCKED in sys.modules:
        session.exitstatus = 1
        raise RuntimeError("torch was imported during a no_torch session")
