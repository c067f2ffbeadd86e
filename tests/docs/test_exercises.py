"""The build-it exercises (``tutorials/exercises/``): every checker passes on minicb's own code (its
reference answers), passes on a right answer written apart from it, fails on the untouched stub, and
fails on known-wrong answers with a message that says what is wrong. The checkers run as a learner runs
them: ``python -m pytest tutorials/exercises/check_X.py --solution FILE``, in a subprocess."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXERCISES = ROOT / "tutorials" / "exercises"
ANSWERS = pathlib.Path(__file__).resolve().parent / "exercise_solutions"
NAMES = ("slot", "can_allocate", "chunk", "victim", "slot_mapping", "causal_mask",
         "continuous_policy", "block_tables", "pack", "step_loop")
# the build-it track: a whole piece each, with three known-wrong answers at least
BUILD_IT = ("continuous_policy", "block_tables", "pack", "step_loop")

# known-wrong answer -> (its checker, words the failure must say)
WRONG = {
    "wrong_slot_stack": ("slot", "The lowest free slot comes first"),
    "wrong_slot_no_full_check": ("slot", "on a full table of 2 returned 0: it must raise"),
    "wrong_can_allocate_floor": ("can_allocate", "9 positions need ceil(9/4) = 3 blocks"),
    "wrong_can_allocate_ignores_held": ("can_allocate", "Count only the blocks the table must GAIN"),
    "wrong_chunk_no_cap": ("chunk", "one chunk is at most long_prefill_chunk tokens"),
    "wrong_chunk_no_rows": ("chunk", "no row left in the batch (max_num_seqs reached)"),
    "wrong_victim_newest_arrival": ("victim", "fcfs preempts the newest ADMISSION, 'a', not 'c'"),
    "wrong_victim_priority_reversed": ("victim", "a larger value is LESS important"),
    "wrong_slot_mapping_from_zero": ("slot_mapping", "Start from the row's start position"),
    "wrong_slot_mapping_contiguous": ("slot_mapping", "The physical blocks need not be consecutive"),
    "wrong_causal_mask_top_left": ("causal_mask", "A top-left mask"),
    "wrong_causal_mask_strict": ("causal_mask", "a 4-token prompt: query i sees keys 0..i"),
    "wrong_policy_overtakes": ("continuous_policy", "admission must stop at the first that does not "
                               "fit (no overtaking)"),
    "wrong_policy_preempts_most_important": ("continuous_policy", "you preempted 'r0', the most "
                                             "important running request"),
    "wrong_policy_keeps_victims_budget": ("continuous_policy", "after preempting a victim its grant "
                                          "must be given back to the budget"),
    "wrong_tables_hit_whole_prompt": ("block_tables", "a hit is never the whole request"),
    "wrong_tables_hits_not_shared": ("block_tables", "each has ref count 2"),
    "wrong_tables_free_hits_cost_nothing": ("block_tables", "taking the hits off the free list"),
    "wrong_tables_free_head_first": ("block_tables", "free drops a table's last block first"),
    "wrong_pack_keys_without_cache": ("pack", "attend over its cached tokens AND its new ones"),
    "wrong_pack_logits_every_row": ("pack", "so it samples nothing and needs no logits"),
    "wrong_pack_positions_from_zero": ("pack", "start from each row's start_pos"),
    "wrong_loop_adds_all_at_once": ("step_loop", "add each request at the start of its arrival step"),
    "wrong_loop_while_running": ("step_loop", "loop while a request is still to arrive or the scheduler "
                                 "has unfinished ones"),
    "wrong_loop_no_params": ("step_loop", "runner.run got no SamplingParams"),
    "wrong_loop_never_closes_arrivals": ("step_loop", "call scheduler.close_arrivals()"),
}


def check(name: str, solution: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
           str(EXERCISES / f"check_{name}.py")]
    if solution is not None:
        cmd += ["--solution", str(solution)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), NO_COLOR="1")
    env.pop("CI", None)
    env.pop("PYTEST_ADDOPTS", None)         # the outer run's options are not the checker's
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_every_exercise_has_a_stub_and_a_checker():
    on_disk = {p.stem for p in EXERCISES.glob("check_*.py")}
    assert on_disk == {f"check_{name}" for name in NAMES}, "NAMES lists every checker"
    for name in NAMES:
        stub = (EXERCISES / f"{name}.py").read_text()
        assert "raise NotImplementedError" in stub and f"check_{name}.py" in stub and "--solution" in stub
    assert {checker for checker, _ in WRONG.values()} == set(NAMES)     # a wrong answer for every one
    for name in BUILD_IT:                                   # the build-it track: three at least
        assert sum(checker == name for checker, _ in WRONG.values()) >= 3, name


@pytest.mark.parametrize("name", NAMES)
def test_checker_passes_on_minicbs_code(name):
    r = check(name)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "checking: minicb's own code" in r.stdout and " passed" in r.stdout and "failed" not in r.stdout


@pytest.mark.parametrize("name", ["slot", "causal_mask", *BUILD_IT])
def test_checker_fails_on_the_stub(name):
    r = check(name, EXERCISES / f"{name}.py")
    assert r.returncode == 1 and "NotImplementedError" in r.stdout, r.stdout[-3000:]
    assert " passed" not in r.stdout.strip().splitlines()[-1]   # nothing passes while unwritten


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_checker_passes_on_a_right_answer_written_apart(name):
    r = check(name, ANSWERS / "right_all.py")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "checking: " + str(ANSWERS / "right_all.py") in r.stdout


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_checker_fails_on_a_wrong_answer_and_says_why(wrong):
    name, words = WRONG[wrong]
    r = check(name, ANSWERS / f"{wrong}.py")
    assert r.returncode == 1, f"{wrong} passed check_{name}.py:\n{r.stdout[-3000:]}"
    assert words in " ".join(r.stdout.split()), r.stdout[-4000:]


SAMPLE = ROOT / "docs" / "images" / "exercise-checker-output.txt"
_MACHINE = ("platform ", "benchmark:", "rootdir:", "configfile:", "plugins:", "cachedir:")


def sample_output() -> str:
    """What ``check_victim.py`` prints for a wrong answer (``my_victim.py``: newest arrival instead of
    newest admission), with the lines that name this machine left out: the docs page shows it."""
    import re
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ANSWERS / "wrong_victim_newest_arrival.py", pathlib.Path(tmp) / "my_victim.py")
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), NO_COLOR="1", COLUMNS="80")
        env.pop("CI", None)
        env.pop("PYTEST_ADDOPTS", None)     # the outer run's options (--durations...) would print too
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--tb=short",
                            str(EXERCISES / "check_victim.py"), "--solution", "my_victim.py"],
                           cwd=tmp, capture_output=True, text=True, env=env, timeout=300)
    text = r.stdout.replace(os.path.relpath(ROOT, tmp) + "/", "").replace(str(ROOT) + "/", "")
    # pytest padded the progress line for the path as it printed it, which depends on where the
    # checkout is: one space before the percentage, wherever the repository lies
    text = re.sub(r" +(\[ *\d+%\])", r" \1", text)
    lines = []
    for ln in text.splitlines():
        if not ln.startswith(_MACHINE):        # wrapped to the docs' 80-column code block
            indent = "E     " if ln.startswith("E ") else "    "
            lines += textwrap.wrap(ln, 80, subsequent_indent=indent, break_on_hyphens=False,
                                   drop_whitespace=True) or [""]
    return re.sub(r" in [0-9.]+s ", " in 0.00s ", "\n".join(lines)).strip() + "\n"


def test_the_docs_show_what_a_checker_prints_now():
    got = sample_output()
    assert "2 failed, 4 passed" in got and "fcfs preempts the newest ADMISSION" in got
    assert SAMPLE.read_text() == got, "python tests/docs/test_exercises.py writes it again"


def test_the_reference_answers_are_minicbs_code():
    text = (EXERCISES / "_reference.py").read_text()
    for piece in ("minicb.core.slot_table import SlotTable", "bm.can_allocate(", "budget.chunk(",
                  "_choose_victim(", "pack(plan).attn.slot_mapping", "ReferenceAttention(cache)",
                  "minicb.core.continuous import ContinuousPolicy", "self.bm.allocate(",
                  "from minicb.runtime.packer import pack as _pack", "scheduler.update(plan, sampled"):
        assert piece in text, piece


if __name__ == "__main__":
    SAMPLE.write_text(sample_output())
    print(f"wrote {SAMPLE}")
