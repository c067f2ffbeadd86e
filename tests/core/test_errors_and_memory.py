"""The argument checks every module uses (``core/errors.py``) and the memory arithmetic
(``core/memory.py``), on their own: each boundary on both sides, each kind of value, written out."""

from __future__ import annotations

import math

import numpy as np
import pytest

import minicb.core.memory as memory
from minicb.core.errors import InvalidArgument, as_int, as_real, check_float, check_int, describe
from minicb.core.memory import check_fits, format_bytes


# --- describe ---------------------------------------------------------------------------------------------
def test_describe_cuts_long_values_and_names_huge_integers_by_their_size():
    assert describe(5) == "5" and describe("ab") == "'ab'"
    assert describe("x" * 58) == repr("x" * 58)                     # 60 characters: kept
    assert describe("x" * 59) == repr("x" * 59)[:57] + "..."        # 61: cut to 60
    assert len(describe(list(range(100)))) == 60
    assert describe(2**199) == str(2**199)                          # 200 bits: still printed
    assert describe(2**200) == "an integer of about 61 digits"      # 201 bits; 2**200 has 61 digits
    assert describe(-(2**300)) == "-an integer of about 91 digits"
    assert describe(True) == "True"

    class Hostile:
        def __repr__(self):
            raise RuntimeError("no")

    assert describe(Hostile()) == "<Hostile>"


# --- as_int / check_int -----------------------------------------------------------------------------------
def test_as_int_takes_one_integer_of_any_kind_and_nothing_else():
    assert as_int(3) == 3 and as_int(np.int64(4)) == 4
    assert as_int(np.array(6)) == 6
    for no in (True, np.bool_(True), 2.0, "3", None, [1], np.array([1])):
        assert as_int(no) is None, no


def test_check_int_bounds_are_inclusive():
    assert check_int("n", 1, lo=1) == 1 and check_int("n", 5, hi=5) == 5 and check_int("n", -7) == -7
    assert type(check_int("n", np.int32(3), lo=0)) is int
    with pytest.raises(InvalidArgument, match=r"n must be in \[1, inf\], got 0"):
        check_int("n", 0, lo=1)
    with pytest.raises(InvalidArgument, match=r"n must be in \[-inf, 5\], got 6"):
        check_int("n", 6, hi=5)
    with pytest.raises(InvalidArgument, match=r"n must be in \[0, 2\]"):
        check_int("n", 3, lo=0, hi=2)
    with pytest.raises(InvalidArgument, match="n must be an integer, got float 1.0"):
        check_int("n", 1.0)
    with pytest.raises(InvalidArgument, match="must be an integer, got bool"):
        check_int("n", True)


# --- as_real / check_float --------------------------------------------------------------------------------
def test_as_real_takes_one_real_number_of_any_kind():
    assert as_real(2) == 2.0 and as_real(0.5) == 0.5 and as_real(np.float32(0.25)) == 0.25
    assert as_real(np.array(1.5)) == 1.5
    assert as_real(10**400) == math.inf and as_real(-(10**400)) == -math.inf
    for no in (True, np.bool_(False), "1", None, 1j, [1.0], np.array([1.0])):
        assert as_real(no) is None, no


def test_check_float_bounds_open_closed_and_finite():
    assert check_float("t", 0.0, lo=0.0) == 0.0
    assert check_float("t", 1.0, hi=1.0) == 1.0
    assert check_float("t", math.inf) == math.inf                  # not finite=True: allowed
    with pytest.raises(InvalidArgument, match=r"t must be in \(0.0, inf\], got 0.0"):
        check_float("t", 0.0, lo=0.0, lo_open=True)
    assert check_float("t", 1e-9, lo=0.0, lo_open=True) == 1e-9
    with pytest.raises(InvalidArgument, match=r"t must be in \[0.0, inf\]"):
        check_float("t", -1e-9, lo=0.0)
    with pytest.raises(InvalidArgument, match=r"\[-inf, 1.0\]"):
        check_float("t", 1.5, hi=1.0)
    with pytest.raises(InvalidArgument, match="t must be a finite number in"):
        check_float("t", math.inf, finite=True)
    with pytest.raises(InvalidArgument, match="t must be a finite number in"):
        check_float("t", -math.inf, finite=True)
    with pytest.raises(InvalidArgument, match="got nan"):
        check_float("t", math.nan)
    with pytest.raises(InvalidArgument, match="t must be a number, got str"):
        check_float("t", "1")
    with pytest.raises(InvalidArgument, match="about 401 digits"):
        check_float("t", 10**400, hi=1.0)                          # shown by size, not as inf


# --- memory -----------------------------------------------------------------------------------------------
def test_check_fits_refuses_only_what_exceeds_a_known_amount():
    check_fits("x", 100, 100, "here", "less")                       # exactly fits
    check_fits("x", 10**30, None, "here", "less")                   # unknown: no refusal
    with pytest.raises(InvalidArgument, match="x needs 101 B, more than the 100 B available here; less"):
        check_fits("x", 101, 100, "here", "less")


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (1024**2, "1.0 MiB"),
    (5 * 1024**3, "5.0 GiB"), (1024**4, "1.0 TiB"), (1024**5, "1.0 PiB"), (3 * 1024**6, "3,072.0 PiB"),
    (2**80 - 1, "1,073,741,824.0 PiB"), (2**80, "about 2**80 bytes"), (2**81 + 5, "about 2**81 bytes"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_available_memory_is_the_smallest_known_figure(monkeypatch):
    # the page count is the last resort: consulted only when nothing else is known
    monkeypatch.setattr(memory.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 1, "SC_PAGE_SIZE": 4096}[name])
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 5000)
    monkeypatch.setattr(memory, "_cgroup_available", lambda: 3000)
    assert memory.available_cpu_bytes() == 3000
    monkeypatch.setattr(memory, "_cgroup_available", lambda: None)
    assert memory.available_cpu_bytes() == 5000
    monkeypatch.setattr(memory, "_meminfo_available", lambda: None)
    monkeypatch.setattr(memory.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 7, "SC_PAGE_SIZE": 4096}[name])
    assert memory.available_cpu_bytes() == 7 * 4096


def test_cgroup_limits_are_read_from_the_first_file_pair_that_exists(monkeypatch, tmp_path):
    files = {"/sys/fs/cgroup/memory.max": "1000\n", "/sys/fs/cgroup/memory.current": "400\n"}
    real_open = open

    def fake_open(path, *a, **k):
        if path in files:
            target = tmp_path / path.replace("/", "_")
            target.write_text(files[path])
            return real_open(target, *a, **k)
        if str(path).startswith("/sys/fs/cgroup"):
            raise OSError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    assert memory._cgroup_available() == 600
    files["/sys/fs/cgroup/memory.current"] = "1500\n"              # over the limit: none left, not < 0
    assert memory._cgroup_available() == 0
    files["/sys/fs/cgroup/memory.max"] = "max\n"                   # no limit
    assert memory._cgroup_available() is None
    del files["/sys/fs/cgroup/memory.max"]
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "2000"  # cgroup v1
    files["/sys/fs/cgroup/memory/memory.usage_in_bytes"] = "500"
    assert memory._cgroup_available() == 1500
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = str(2**62)   # v1's "no limit"
    assert memory._cgroup_available() is None


def test_meminfo_gives_mem_available_in_bytes(monkeypatch, tmp_path):
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:  8000 kB\nMemFree:  100 kB\nMemAvailable:  1000 kB\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        fake if path == "/proc/meminfo" else path, *a, **k))
    assert memory._meminfo_available() == 1000 * 1024
    fake.write_text("MemTotal:  8000 kB\n")                      # an old kernel: no MemAvailable
    assert memory._meminfo_available() is None
    fake.write_text("MemAvailable: lots\n")
    assert memory._meminfo_available() is None
