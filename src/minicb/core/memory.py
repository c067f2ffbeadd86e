"""How much memory the machine can still give, asked *before* a large allocation. Torch-free.

A pool sized by the user (``num_blocks``, ``block_size``) can ask for more than any machine has:
``num_blocks=10**10`` is terabytes of KV cache, or billions of Python list entries for the block
manager's free list. Left alone, the allocator answers with a traceback, the kernel's OOM killer, or
minutes of swapping. So the pools compute their size first and compare it with what is available:

* CPU: ``MemAvailable`` from ``/proc/meminfo`` (what the kernel can hand out without swapping), and,
  inside a container, the cgroup's limit minus its usage, whichever is smaller;
* CUDA: ``torch.cuda.mem_get_info`` (free device memory), asked by the caller, which has torch.

Where the amount cannot be known (another OS) the check passes: it exists to turn an impossible
request into a clear ``InvalidArgument``, not to forbid what might work.
"""

from __future__ import annotations

import os

from minicb.core.errors import InvalidArgument


def available_cpu_bytes() -> int | None:
    """Bytes the kernel can still give this process (``None`` if unknown)."""
    found = [b for b in (_meminfo_available(), _cgroup_available()) if b is not None]
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            pass
    return min(found) if found else None


def check_fits(what: str, nbytes: int, available: int | None, where: str, hint: str) -> None:
    """Raise ``InvalidArgument`` if ``nbytes`` (what ``what`` needs) exceeds ``available``."""
    if available is not None and nbytes > available:
        raise InvalidArgument(f"{what} needs {format_bytes(nbytes)}, more than the {format_bytes(available)} "
                              f"available {where}; {hint}")


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; exabyte-scale requests stay readable, absurd ones become ``2**N``."""
    if n.bit_length() > 80:                   # beyond a million PiB (and beyond what a float holds)
        return f"about 2**{n.bit_length() - 1} bytes"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:,.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    raise AssertionError("unreachable")


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """cgroup v2 (``memory.max`` / ``memory.current``) or v1 (``limit_in_bytes`` / ``usage_in_bytes``)."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:         # "max" / a huge v1 value: no limit
            return max(int(limit) - usage, 0)
    return None
