"""Wrong: free drops a table's first block first, so a cached head would be
evicted before its tail (a parent before its children)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import BlockTables as Right  # noqa: E402


class BlockTables(Right):
    def free(self, request_id):
        table = self.tables.pop(request_id, [])
        for b in table:
            self.pool.drop(b)
        return len(table)
