"""``/proc/self/smaps``, read back: what Linux made of a tensor's memory (shared by the host-memory tests)."""

from __future__ import annotations


def mapping_of(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` entry of the mapping that holds ``address``: its ``range`` ("start-end")
    and every field (``Rss``, ``AnonHugePages``, ``VmFlags``, ...) as its text after the colon."""
    entry, found = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:            # a new mapping: "start-end perms ..."
                if found:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
                entry = {"range": head}
            elif found:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert found, hex(address)
    return entry
