"""Wrong: positions restart at 0 in every row (the slots are right), as if
no row had anything in the cache: RoPE rotates a decode by the wrong angle."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import pack as right_pack  # noqa: E402


def pack(plan):
    out = right_pack(plan)
    cu = out["cu_seqlens_q"]
    out["positions"] = [i - cu[r] for r in range(len(cu) - 1)
                        for i in range(cu[r], cu[r + 1])]
    return out
