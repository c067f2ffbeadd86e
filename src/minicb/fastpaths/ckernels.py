"""Compile one of minicb's C files on first use and cache the shared library: the build machinery of
the ``cpu-paged`` decode kernel (``backends/paged_decode.c``) and the fused elementwise ops
(``fused_ops.c``).

No build step at install time and no new dependency: the machine's C compiler (``$CC``, else the one
Python was built with, else ``cc``) compiles the file the first time it is needed (about a second),
into ``~/.cache/minicb/kernels`` (``$MINICB_CACHE_DIR`` overrides), under a name keyed by the source,
the compiler, the flags and the CPU (``-march=native``), so an edit or another machine rebuilds it.
The caller loads the result with ``ctypes``. A compiler that rejects ``-fopenmp`` still builds the
file single-threaded (with ``-fopenmp-simd`` where it takes that: the same vectorised sums, so the
same bits); any other failure is a ``KernelUnavailable`` carrying the compiler's message.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

from minicb.fastpaths.settings import Settings

# a call to an undeclared function is an error here as in GCC 14 and later, so that no older compiler
# builds a kernel that those refuse (layer_stack.c called syscall() undeclared until the 26th session)
FLAGS = ("-O3", "-march=native", "-std=c11", "-shared", "-fPIC", "-Werror=implicit-function-declaration")
OPENMP = "-fopenmp"     # work split over torch's thread count; without it (no OpenMP) one thread


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here; the message says why."""


def compiler() -> list[str]:
    """The C compiler command: ``$CC``, else the one Python was built with, else ``cc``."""
    for cmd in (Settings.from_env().cc, sysconfig.get_config_var("CC"), "cc"):
        if cmd and shutil.which(shlex.split(cmd)[0]):
            return shlex.split(cmd)
    raise KernelUnavailable("no C compiler found (set $CC, or install gcc)")


def cache_dir() -> Path:
    """Where built kernels are kept: ``$MINICB_CACHE_DIR``, else ``$XDG_CACHE_HOME/minicb`` or
    ``~/.cache/minicb``; a temporary folder when that cannot be created (a read-only home)."""
    root = Path(Settings.from_env().cache_dir) / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        root = Path(tempfile.gettempdir()) / f"minicb-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"
        root.mkdir(parents=True, exist_ok=True)
    return root


def _machine_key() -> str:
    """What ``-march=native`` depends on: the architecture and the CPU's model and feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    lines.append(line.strip())
                if len(lines) == 2:
                    break
    except OSError:
        pass
    return "\n".join([platform.machine(), *lines])


def cpu_flags() -> list[str]:
    """The CPU's matrix-relevant feature flags (``/proc/cpuinfo``): what a speed figure must name, and
    what chooses between the kernels' loops and oneDNN (``skinny_gemm.choose_rows``)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return [w for w in wanted if w in flags]


def _local_headers(source: Path) -> list[str]:
    """The text of the headers ``source`` includes with quotes (``#include "bf16.h"``), so that an edit
    to one rebuilds every kernel that includes it."""
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.M)
    return [(source.parent / name).read_text() for name in names]


def build(source: Path, cc: list[str] | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile ``source`` into the cache (once per source, compiler, flags and CPU); its path."""
    cc = cc or compiler()
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256("\0".join([source.read_text(), *_local_headers(source), *cc, *flags, OPENMP,
                                    _machine_key()]).encode())
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)    # same filesystem: atomic rename
    os.close(fd)
    try:
        # a compiler without OpenMP still builds it: with its `omp simd` pragmas where it takes them
        # (-fopenmp-simd: the same vector sums, so the same bits as with OpenMP), else without
        for attempt in ((*flags, OPENMP), (*flags, "-fopenmp-simd"), flags):
            try:
                proc = subprocess.run([*cc, *attempt, str(source), "-o", tmp, "-lm"], capture_output=True,
                                      text=True)
            except OSError as e:                      # not executable, vanished since `which`, ...
                raise KernelUnavailable(f"{shlex.join(cc)} cannot be run: {e}") from e
            if proc.returncode == 0:
                break
        else:
            raise KernelUnavailable(f"{shlex.join(cc)} failed to compile {source.name}: "
                                    f"{proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)      # two processes building at once both end with a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def open_library(path: Path, what: str) -> ctypes.CDLL:
    """``ctypes.CDLL(path)``, a ``KernelUnavailable`` naming ``what`` if it does not load."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"{what} does not load: {e}") from e


def why_not(load) -> str | None:
    """None when ``load()`` (a module's cached loader) succeeds, else its ``KernelUnavailable`` message;
    a failure is not cached, so it is tried again on the next call."""
    try:
        load()
    except KernelUnavailable as e:
        return str(e)
    return None
