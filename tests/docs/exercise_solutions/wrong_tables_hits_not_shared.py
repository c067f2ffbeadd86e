"""Wrong: a hit is put in the new table without taking a reference to it
(no pool.share), so its ref count says one table names it when two do."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from right_all import BlockTables as Right  # noqa: E402


class BlockTables(Right):
    def allocate(self, request_id, num_tokens, hits=()):
        if not self.can_allocate(request_id, num_tokens, hits):
            raise ValueError(f"no room for {request_id}")
        need = self.lacking(request_id, num_tokens, hits)
        table = self.tables.setdefault(request_id, [])
        table += hits
        new = [self.pool.take() for _ in range(need)]
        table += new
        return new
