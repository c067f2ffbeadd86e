"""The checkers' one option, ``--solution FILE``: the file to check.

    python -m pytest tutorials/exercises/check_slot.py --solution my_slot.py

Without it a checker checks minicb's own code (``_reference.py`` adapts it to
the exercise's signature), which is how the checkers themselves are tested.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption("--solution", default=None, metavar="FILE",
                     help="your solution file (default: minicb's own code)")


def pytest_report_header(config):
    path = config.getoption("--solution")
    return f"checking: {path}" if path else \
        "checking: minicb's own code (no --solution given)"


@pytest.fixture(scope="session")
def solution(request):
    """Your module, or None: then the checker uses minicb's code."""
    path = request.config.getoption("--solution")
    if path is None:
        return None
    file = pathlib.Path(path).resolve()
    if not file.is_file():
        pytest.exit(f"--solution {path}: no such file", returncode=4)
    spec = importlib.util.spec_from_file_location("solution", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
