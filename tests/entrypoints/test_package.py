"""minicb as a package a stranger installs (issue 45): the licence ships, the metadata is an SPDX
string, the sdist carries no tests (none of them could run from it), the wheel has the C sources it
compiles on first use, an installed wheel's help names nothing the wheel lacks, and ``minicb
completion`` completes what the parser accepts.

The wheel and sdist are built with setuptools' own PEP 517 hooks (``setuptools.build_meta``, what
``python -m build`` calls), so the test needs no build tool beyond setuptools."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile

import pytest

from minicb.entrypoints import demo
from minicb.entrypoints.cli import build_parser
from minicb.entrypoints.completion import bash_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
# what only a source checkout has: a wheel user's help text must not send them there
CHECKOUT_ONLY = re.compile(r"(?<![\w-])tutorials/|\bmake (docs|demo|test)|\bbench/|\bdocs/|\btests/")


def _all_help(parser) -> str:
    import argparse

    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [sub.format_help() for sub in action.choices.values()]
    return "\n".join(texts)


def test_the_licence_file_is_apache_2_and_the_metadata_says_so_in_spdx():
    meta = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', meta, re.M)     # a string (SPDX), not a table
    assert re.search(r'^license-files = \["LICENSE"\]$', meta, re.M)
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text                 # the full text, not a stub


def test_help_in_a_checkout_points_to_the_tutorials():
    assert demo.source_checkout() == ROOT
    assert "tutorials/00_why_batch.py" in build_parser().format_help()


def test_help_of_an_installed_wheel_names_no_file_the_wheel_lacks(monkeypatch):
    monkeypatch.setattr(demo, "source_checkout", lambda: None)
    text = _all_help(build_parser())
    assert CHECKOUT_ONLY.findall(text) == []
    assert "minicb tutorials DIR" in demo.where_to_learn()


def _complete(script: str, words: list[str]) -> list[str]:
    """What bash completes for the last of ``words`` (the word being typed) after ``minicb``."""
    words_sh = " ".join(f"'{w}'" for w in ["minicb", *words])
    cmd = (f'{script}\nCOMP_WORDS=({words_sh}); COMP_CWORD={len(words)}; _minicb; '
           'printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout
    return [w for w in out.split("\n") if w]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash completion needs bash")
def test_completion_completes_commands_flags_and_choices():
    parser = build_parser()
    script = bash_script(parser)
    assert _complete(script, ["gen"]) == ["generate"]
    assert _complete(script, ["s"]) == ["simulate", "serve"]
    assert _complete(script, ["generate", "--max-t"]) == ["--max-tokens"]
    assert _complete(script, ["generate", "--policy", ""]) == ["continuous", "dynamic", "static"]
    assert _complete(script, ["bench", "--policy", "a"]) == ["all"]
    # every flag of every command is offered once its command is typed
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        flags = {o for a in p._actions for o in a.option_strings if o.startswith("--")}
        assert flags <= set(_complete(script, [name, "--"])), name


def test_the_completion_command_prints_the_script(capsys):
    from minicb.entrypoints.cli import main

    assert main(["completion"]) == 0
    out = capsys.readouterr().out
    assert out == bash_script(build_parser()) and "complete -o default -F _minicb minicb" in out


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """The sdist and the wheel, built by setuptools' PEP 517 hooks from a copy of this checkout (a
    build in place would leave build/ and egg-info behind, and reuse a stale build/ next time)."""
    out = tmp_path_factory.mktemp("dist")
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    built = []
    for hook in ("build_sdist", "build_wheel"):
        code = f"import sys; from setuptools import build_meta as b; print(b.{hook}(sys.argv[1]))"
        run = subprocess.run([sys.executable, "-c", code, str(out)], cwd=tree, capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Warning" not in run.stderr, run.stderr[-3000:]   # e.g. a licence table's deprecation
        built.append(out / run.stdout.split()[-1])
    return tuple(built)


@pytest.mark.slow
def test_the_sdist_carries_no_tests_and_the_wheel_carries_licence_and_c_sources(dists):
    sdist, wheel = dists
    with tarfile.open(sdist) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    assert "LICENSE" in names and "pyproject.toml" in names
    assert [n for n in names if n.startswith(("tests/", "tutorials/", "docs/", "bench/"))] == []
    with zipfile.ZipFile(wheel) as z:
        wnames = z.namelist()
        meta = z.read(next(n for n in wnames if n.endswith(".dist-info/METADATA"))).decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wnames)
    assert "License-Expression: Apache-2.0" in meta
    shipped_c = {n for n in wnames if n.endswith((".c", ".h"))}
    in_tree = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "minicb").rglob("*.[ch]")}
    assert shipped_c == in_tree                                 # every kernel source compiles on first use
    shipped_tut = {n.removeprefix("minicb/tutorials/") for n in wnames if n.startswith("minicb/tutorials/")}
    tut = ROOT / "tutorials"
    assert shipped_tut == {str(p.relative_to(tut)) for p in [*tut.glob("*.py"), *tut.glob("exercises/*.py")]}


@pytest.fixture(scope="module")
def wheel_venv(dists, tmp_path_factory):
    """A fresh venv with only the wheel installed: ``(python, env, cwd)``. Its dependencies come from
    this interpreter's site-packages through a .pth line, so torch is not installed again; the editable
    minicb there is not seen, since a path added by a .pth file has its own .pth files ignored."""
    _, wheel = dists
    tmp = tmp_path_factory.mktemp("wheel")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    vsite = subprocess.run([py, "-c", "import site; print(site.getsitepackages()[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(vsite, "zz_deps.pth").write_text(site.getsitepackages()[0] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", vsite, str(wheel)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([py, "-c", "import minicb; print(minicb.__file__)"], cwd=tmp, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(vsite), where                       # the wheel's minicb, not this checkout's
    return py, env, tmp


@pytest.mark.slow
def test_an_installed_wheel_runs_help_and_names_nothing_it_lacks(wheel_venv):
    py, env, cwd = wheel_venv
    helps = []
    for cmd in ["", "demo", "generate", "trace", "bench", "simulate", "serve", "export-hf", "completion"]:
        run = subprocess.run([py, "-m", "minicb", *cmd.split(), "--help"], cwd=cwd, env=env,
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        helps.append(run.stdout)
    text = "\n".join(helps)
    assert CHECKOUT_ONLY.findall(text) == []
    assert "minicb tutorials DIR copies the twelve chapters" in text


@pytest.mark.slow
def test_an_installed_wheel_copies_out_its_tutorials_and_they_run(wheel_venv):
    """What the wheel's help promises: ``minicb tutorials DIR``, then a chapter and an exercise checker
    run from the copy (no checkout anywhere: the wheel's own files)."""
    py, env, cwd = wheel_venv
    run = subprocess.run([py, "-m", "minicb", "tutorials", "learn"], cwd=cwd, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "copied 12 chapters (00_why_batch.py ... 11_serving.py) and the exercises into learn/",
        "start with: python learn/00_why_batch.py"]
    env = {**env, "MINICB_PROGRESS": "0"}
    chapter = subprocess.run([py, "learn/03_slot_table.py"], cwd=cwd, env=env, capture_output=True, text=True)
    assert chapter.returncode == 0, chapter.stderr[-3000:]
    assert "after the run: free slots 3 of 3" in chapter.stdout
    again = subprocess.run([py, "-m", "minicb", "tutorials", "learn"], cwd=cwd, env=env, capture_output=True,
                           text=True)
    assert again.returncode == 2 and "learn exists and is not an empty directory" in again.stderr


@pytest.mark.slow
@pytest.mark.model
def test_an_installed_wheel_generates_compiling_its_kernels(wheel_venv, smollm2_path, tmp_path):
    """``minicb generate`` from the wheel: the C kernels compile from the sources the wheel carries
    (into a fresh cache, so nothing compiled from the checkout is reused)."""
    py, env, cwd = wheel_venv
    env = {**env, "MINICB_CACHE_DIR": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path), "MINICB_PROGRESS": "0"}
    run = subprocess.run([py, "-m", "minicb", "generate", "The capital of France is", "--max-tokens", "3"],
                         cwd=cwd, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()
    assert CHECKOUT_ONLY.findall(run.stdout + run.stderr) == []


@pytest.mark.slow
def test_an_installed_wheel_serves(wheel_venv, tmp_path):
    """``minicb serve`` from the wheel starts and says where it listens (a tiny GGUF: no model
    package needed); Ctrl-C stops it with exit 0."""
    import signal

    from tiny_files import write_gguf

    py, env, cwd = wheel_venv
    gguf = write_gguf(tmp_path / "tiny.gguf")
    env = {**env, "MINICB_CACHE_DIR": str(tmp_path / "cache"), "MINICB_PROGRESS": "0"}
    p = subprocess.Popen([py, "-m", "minicb", "serve", "--model", str(gguf), "--port", "0", "--threads", "1"],
                         cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()                   # "minicb serve: tiny on http://127.0.0.1:PORT ..."
        assert " on http://127.0.0.1:" in line, (line, p.stderr.read() if p.poll() is not None else "")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)        # a bound on a hang, not a speed
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-2000:]
    assert CHECKOUT_ONLY.findall(line + out + err) == []
