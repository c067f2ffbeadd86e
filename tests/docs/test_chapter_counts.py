"""What the project says about its chapters is what is on disk (how many, which first), and chapter
00's noise rule: a timing run whose repeats spread too far, or whose larger batch beat batch 1, is
called too noisy to read. The rule is checked on given numbers; nothing here measures time."""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
WORDS = {10: "ten", 11: "eleven", 12: "twelve", 13: "thirteen", 14: "fourteen", 15: "fifteen"}


def _common():
    saved = os.environ.get("MINICB_PROGRESS")
    os.environ["MINICB_PROGRESS"] = "0"              # no heartbeat thread in the test process
    sys.path.insert(0, str(TUTORIALS))
    try:
        import _common

        return _common
    finally:
        sys.path.remove(str(TUTORIALS))
        if saved is None:
            del os.environ["MINICB_PROGRESS"]
        else:
            os.environ["MINICB_PROGRESS"] = saved


def test_the_chapter_count_is_stated_right():
    chapters = sorted(p.name for p in TUTORIALS.glob("[0-9][0-9]_*.py"))
    first, last, word = chapters[0][:2], chapters[-1][:2], WORDS[len(chapters)]
    assert int(last) - int(first) + 1 == len(chapters)                     # numbered without a gap
    readme = (ROOT / "README.md").read_text()
    assert f"python tutorials/{chapters[0]}" in readme
    assert f"{word} numbered chapters ({first}-{last})" in readme
    demo = (ROOT / "src/minicb/entrypoints/demo.py").read_text()
    assert f"python tutorials/{chapters[0]}, then {chapters[1][:2]} ... {last}: {word} chapters" in demo
    wrong = [w for n, w in WORDS.items() if n != len(chapters)]
    for text in (readme, demo):
        assert not any(f"{w} numbered chapters" in text or f"{w} chapters" in text for w in wrong)
    index = (ROOT / "docs/tutorials/index.md").read_text()
    assert all(f"]({c[:-3]}.md)" in index for c in chapters)


def test_a_noisy_timing_run_is_called_noisy():
    noise = _common().noise
    quiet = {1: [30.0, 31.0, 30.5], 4: [31.0, 32.0, 31.5], 64: [90.0, 95.0, 92.0]}
    assert noise(quiet, 0.25) == []
    spread = {**quiet, 4: [31.0, 60.0, 32.0]}                              # one run 94% slower
    assert noise(spread, 0.25) == ["batch 4's 3 runs spread 94% (over 25%)"]
    faster = {1: [40.0, 41.0, 40.5], 4: [28.0, 28.5, 28.2]}               # batch 4 "cheaper" than 1
    assert noise(faster, 0.25) == ["batch 4 took 0.70x batch 1's time"]
    assert noise({1: [30.0, 36.0]}, 0.25) == [] and noise({1: [30.0, 38.0]}, 0.25) != []   # the limit
