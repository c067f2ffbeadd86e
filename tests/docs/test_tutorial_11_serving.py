"""Chapter 11 (serving) runs as a reader would run it, and what it prints is true.

The chapter's grid comes from the live page's feed; the facts checked here are the invariants of
continuous batching, recomputed from the grid itself: a request keeps one slot, its prompt rows come
before its decode rows, and a request that waited took its slot at the very step after the previous
holder's last one. The metrics and the disconnect are checked against what the run reports elsewhere.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tutorials" / "11_serving.py"


def run(*flags: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def grid(out: str, slots: int) -> dict[int, str]:
    """slot -> its row of the text grid, all chunks of steps joined."""
    rows: dict[int, str] = {s: "" for s in range(slots)}
    for m in re.finditer(r"^  slot (\d+)  (\S+)$", out, re.M):
        rows[int(m.group(1))] += m.group(2)
    return rows


@pytest.mark.parametrize("clients, slots", [(6, 4), (5, 2)])
def test_chapter_11(clients, slots):
    out = run("--clients", str(clients), "--slots", str(slots))
    assert f"served {clients} requests" in out
    rows = grid(out, slots)
    width = {len(r) for r in rows.values()}
    assert len(width) == 1 and width.pop() > 0
    letters = {ch.lower() for r in rows.values() for ch in r if ch != "."}
    assert letters == {chr(ord("a") + k) for k in range(clients)}
    span = {}
    for ch in letters:
        held = [s for s, row in rows.items() if ch in row.lower()]
        assert len(held) == 1, (ch, held)                                                # one slot
        slot, row = held[0], rows[held[0]]
        cells = [i for i, c in enumerate(row) if c.lower() == ch]
        assert cells == list(range(cells[0], cells[-1] + 1)), (ch, row)                 # contiguous
        kinds = "".join(row[i] for i in cells)
        assert re.fullmatch(f"{ch.upper()}+{ch}+", kinds), kinds                        # prefill, decode
        span[ch] = (slot, cells[0], cells[-1])
    waited = re.search(r"^waited for a slot: \[(.*)\]$", out, re.M).group(1)
    waited = [w.strip(" '") for w in waited.split(",") if w.strip()]
    assert len(waited) >= clients - slots  # load-independent: counts of requests, steps of the printed grid
    # load-independent: counts of requests
    assert f"{len(waited)} of {clients} requests waited for a slot" in out
    assert "each took its slot the step after the holder left: True" in out  # load-independent: steps
    for ch, slot, step, prev, left in re.findall(r"^  (\w) took slot (\d+) at step (\d+): (\w) left it at "
                                                 r"step (\d+)$", out, re.M):
        assert int(step) == int(left) + 1                           # refilled at the very next step
        # load-independent: grid columns (steps), not time
        assert span[ch][0] == span[prev][0] == int(slot) and ch in waited
        # load-independent: grid columns (steps)
        assert span[ch][1] == span[prev][2] + 1                     # and so the grid says
    # load-independent: a count of samples
    assert re.search(rf"^vllm:time_to_first_token_seconds_count\s+{clients}$", out, re.M)
    m = re.search(r"after the client left: free blocks (\d+) of (\d+), free slots (\d+)", out)
    assert m and m.group(1) == m.group(2) and int(m.group(3)) == slots
    m = re.search(r"while streaming: free blocks (\d+) of (\d+)", out)
    assert m and int(m.group(1)) < int(m.group(2))
    assert out.rstrip().endswith("server stopped")
    assert max(map(len, out.splitlines())) <= 80
