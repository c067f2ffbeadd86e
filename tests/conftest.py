"""Shared pytest fixtures. The src/ layout is put on the path so the suite also runs uninstalled."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
