"""Wrong: asks for the logits of every row's last token, even of a prompt
chunk that does not reach its last token and samples nothing."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import pack as right_pack  # noqa: E402


def pack(plan):
    out = right_pack(plan)
    cu = out["cu_seqlens_q"]
    out["logits_indices"] = [cu[i + 1] - 1 for i in range(len(plan.seqs))]
    out["sample_request_ids"] = [s.request_id for s in plan.seqs]
    return out
