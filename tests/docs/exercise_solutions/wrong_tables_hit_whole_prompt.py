"""Wrong: a hit may cover the whole request (every full block), leaving no
token to compute and so no logits to sample from."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import BlockTables as Right  # noqa: E402


class BlockTables(Right):
    def hits(self, token_ids):
        found, parent = [], None
        for i in range(len(token_ids) // self.block_size):
            parent = self.cache.lookup(parent, self.block(token_ids, i))
            if parent is None:
                break
            found.append(parent)
        return found
