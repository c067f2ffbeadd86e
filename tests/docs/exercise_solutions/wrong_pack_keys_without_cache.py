"""Wrong: cu_seqlens_k counts only the new tokens (it copies cu_seqlens_q),
forgetting the cached context every row's queries also attend over."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import pack as right_pack  # noqa: E402


def pack(plan):
    out = right_pack(plan)
    out["context_lens"] = [b - a for a, b in zip(out["cu_seqlens_q"],
                                                 out["cu_seqlens_q"][1:])]
    out["cu_seqlens_k"] = list(out["cu_seqlens_q"])
    return out
