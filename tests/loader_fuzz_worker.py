"""Run by ``test_loader_fuzz`` in a child process: load every model path listed in a file and report,
one JSON line per case, how it ended. Running them in a child is what lets the test tell a clean error
from a crash of the interpreter (the child dies), a hang (the child is killed at the timeout; the last
"start" line names the case) or a huge allocation (the child's data segment is capped at its size
after the imports plus ``MINICB_FUZZ_HEADROOM_MB``, so one raises ``MemoryError``, which is reported).

    python tests/loader_fuzz_worker.py CASES_FILE
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def _vm_data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_mb() -> int:
    """This process's own peak resident memory. ``ru_maxrss`` is not it on Linux: it keeps the
    high-water mark of the address space the process was forked with (here pytest's, which holds
    whole models), across ``exec``. ``VmHWM`` in /proc/self/status belongs to the new image alone."""
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def main(cases_file: str) -> None:
    import torch  # noqa: F401  - imported before the cap, so its own reservations are not counted

    from minicb.core.errors import ModelLoadError
    from minicb.model.weights.loader import load_model

    headroom = int(os.environ.get("MINICB_FUZZ_HEADROOM_MB", "512")) << 20
    capped = False
    if os.path.exists("/proc/self/status"):
        limit = _vm_data_bytes() + headroom
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard == resource.RLIM_INFINITY or hard >= limit:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
            capped = True
    print(json.dumps({"capped": capped}), flush=True)
    with open(cases_file) as f:
        cases = [line.rstrip("\n") for line in f if line.strip()]
    for path in cases:
        print(json.dumps({"start": path}), flush=True)
        t0 = time.perf_counter()
        try:
            load_model(path)
            result = {"case": path, "outcome": "ok"}
        except ModelLoadError as e:
            result = {"case": path, "outcome": "ModelLoadError", "message": str(e)}
        except BaseException as e:   # noqa: BLE001 - exactly what the test wants to see
            result = {"case": path, "outcome": type(e).__name__, "message": str(e)[:300]}
        result["seconds"] = round(time.perf_counter() - t0, 3)
        result["maxrss_mb"] = _peak_rss_mb()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
