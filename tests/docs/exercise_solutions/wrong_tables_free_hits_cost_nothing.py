"""Wrong: can_allocate counts only the new blocks, forgetting that a hit
sitting on the free list (ref count 0) is taken off it too."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import BlockTables as Right  # noqa: E402


class BlockTables(Right):
    def can_allocate(self, request_id, num_tokens, hits=()):
        return self.lacking(request_id, num_tokens, hits) <= self.pool.num_free
