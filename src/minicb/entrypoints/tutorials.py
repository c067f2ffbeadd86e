"""``minicb tutorials DIR``: the twelve tutorial chapters and the build-it exercises, copied out of the
installed package into ``DIR`` to run and edit (``python DIR/00_why_batch.py``).

In the repository they live in ``tutorials/``; the package reaches them through the link
``src/minicb/tutorials -> ../../tutorials``, which a build follows, so the wheel carries the same files
(package data) and a wheel user, who has no checkout, gets the chapters the checkout has.
"""

from __future__ import annotations

import importlib.resources
import shutil
from pathlib import Path

from minicb.core.errors import InvalidArgument

FIRST = "00_why_batch.py"
# ruff.toml extends the repository's pyproject.toml, which a copy does not have
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "ruff.toml", ".pytest_cache")


def shipped() -> Path:
    """The tutorials as this install has them (a checkout's ``tutorials/``, or the wheel's copy)."""
    return Path(str(importlib.resources.files("minicb") / "tutorials"))


def add_parser(sub) -> None:
    p = sub.add_parser("tutorials", help="copy the tutorial chapters and exercises into DIR, to run and edit",
                       description="Copy the twelve tutorial chapters (00-11) and the build-it exercises "
                                   "into DIR; then run them one by one, starting with "
                                   f"python DIR/{FIRST}.")
    p.add_argument("dir", nargs="?", default="minicb-tutorials",
                   help="directory to create (must be absent or empty; default minicb-tutorials)")
    p.set_defaults(run=cmd_tutorials)


def cmd_tutorials(args) -> int:
    dest = Path(args.dir)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidArgument(f"{dest} exists and is not an empty directory: name a new one")
    src = shipped()
    if not (src / FIRST).is_file():
        raise InvalidArgument(f"this install has no tutorials ({src} is missing): reinstall minicb")
    shutil.copytree(src, dest, ignore=SKIP, dirs_exist_ok=True)
    chapters = sorted(p.name for p in dest.glob("[0-9][0-9]_*.py"))
    print(f"copied {len(chapters)} chapters ({chapters[0]} ... {chapters[-1]}) and the exercises "
          f"into {dest}/")
    print(f"start with: python {dest / FIRST}")
    return 0
