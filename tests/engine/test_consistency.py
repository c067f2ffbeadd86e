"""The consistency contract, attacked from outside the engine's own seams.

The functions under attack are not hand-picked: a tracer records every function of ``src/minicb``
that a workload calls through ``step()``, ``abort_request()`` and the failure path (a runner failure
and an abort are part of the workload), and each of them in turn gets a fault injected at its 1st,
2nd or 3rd call:

* ``sigint``: a real SIGINT (``signal.raise_signal``), as if Ctrl-C was pressed at that moment; the
  user's loop catches the ``KeyboardInterrupt`` and goes on stepping;
* ``double``: that, and a second SIGINT at the very next call of any of the traced functions;
* ``error``: a ``RuntimeError`` raised at that call.

The workload runs with a real byte-level tokenizer (so text goes through the incremental decoder),
in swap and recompute mode, small enough that preemption happens. Whatever was injected:

* every request ends exactly once: with the padded baseline's tokens, or with
  ``finish_reason == "error"``, a reason, and a prefix of the baseline's tokens;
* the tokens it streamed concatenate to its final ``token_ids``, and its text is their decode;
* a Ctrl-C never kills the engine (it is deferred out of the bookkeeping), and afterwards the engine
  drains: every slot and block is free and the scheduler's integrity check passes;
* an exception in the runner fails only that step's requests; one anywhere else (the bookkeeping,
  the detokenizer) ends every request with an error and leaves the engine dead (``EngineDeadError``).
"""

from __future__ import annotations

import functools
import signal
import sys
import types
from pathlib import Path

import pytest

from helpers import assert_drained, baseline_tokens, tiny_model
from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.errors import EngineDeadError
from minicb.core.sampling_params import SamplingParams
from minicb.runtime.runner import ModelRunner, engine_for
from tokenizer_fixtures import tiny_tokenizer

SRC = Path(__import__("minicb").__file__).resolve().parent
# A vocabulary past 0x80 bytes, so that tokens end inside multi-byte characters and the decoder holds.
MODEL = ModelConfig(vocab_size=266, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    max_position_embeddings=4096, eos_token_id=2)
PROMPTS = [[40 + 7 * i + j for j in range(n)] for i, n in enumerate([3, 11, 6, 9, 2, 13])]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in [6, 3, 8, 5, 7, 4]]
ABORT = ("r3", 4)                  # the workload aborts r3 before its 4th step
RUNNER_FAILS_AT = 6                # ... and the runner fails once, at its 6th call


def config(mode: str) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, long_prefill_chunk=8, block_size=4,
                           num_blocks=9, num_host_blocks=8 if mode == "swap" else 0, preemption_mode=mode,
                           max_model_len=64)


@functools.cache
def expected() -> tuple[list[int], ...]:
    return tuple(baseline_tokens(tiny_model(MODEL), PROMPTS, PARAMS, eos=2))


def make_engine(model, cfg, tok):
    return engine_for(model, cfg, tokenizer=tok)


class _RunnerFault(RuntimeError):
    """The workload's own runner failure (always there, so the failure path is always traversed)."""


ARMED = [False]                    # faults and the tracer act only once the requests are queued


def workload(mode: str) -> tuple[object, dict, dict, int]:
    """Serve the prompts like a user who presses Ctrl-C and goes on; returns the engine, the final
    outputs, the streamed tokens and text per request, and the number of KeyboardInterrupts seen."""
    tok = tiny_tokenizer()
    eng = make_engine(tiny_model(MODEL), config(mode), tok)
    real_run, calls = eng.runner.run, [0]

    def run(plan, params):
        calls[0] += 1
        if calls[0] == RUNNER_FAILS_AT:
            raise _RunnerFault("the workload's runner failure")
        return real_run(plan, params)

    eng.runner.run = run
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(f"r{i}", p, sp)
    eng.close_arrivals()
    finals, streamed = {}, {}
    ARMED[0] = True
    try:
        interrupts = _serve(eng, finals, streamed)
    finally:
        ARMED[0] = False
    return eng, finals, streamed, interrupts


def _serve(eng, finals: dict, streamed: dict) -> int:
    interrupts = steps = 0
    while True:
        try:
            if not eng.has_unfinished_requests():
                break
            steps += 1
            assert steps < 500, "the engine does not drain"
            if steps == ABORT[1]:
                out = eng.abort_request(ABORT[0])
                if out is not None:
                    _take(out, finals, streamed)
            for out in eng.step():
                _take(out, finals, streamed)
        except EngineDeadError:                # the final outputs still come out of step()
            if not eng.has_unfinished_requests():
                break
        except KeyboardInterrupt:
            interrupts += 1
        except RuntimeError as e:              # an injected error that reached the caller: go on
            assert "injected" in str(e), e
    return interrupts


def _take(out, finals: dict, streamed: dict) -> None:
    toks, text = streamed.setdefault(out.request_id, ([], []))
    toks.extend(out.new_token_ids)
    text.append(out.new_text)
    if out.finished:
        assert out.request_id not in finals, f"{out.request_id} ended twice"
        finals[out.request_id] = out


def check(eng, finals: dict, streamed: dict, *, may_die: bool, what: str) -> None:
    want, tok = expected(), tiny_tokenizer()
    assert set(finals) == {f"r{i}" for i in range(len(PROMPTS))}, f"{what}: a request was lost"
    for i in range(len(PROMPTS)):
        rid = f"r{i}"
        o = finals[rid]
        toks, texts = streamed[rid]
        assert toks == o.token_ids, f"{what}: {rid} streamed {toks}, ended with {o.token_ids}"
        assert o.text == tok.decode(o.token_ids), f"{what}: {rid}'s text is not the decode of its tokens"
        assert "".join(texts) == o.text, f"{what}: {rid}'s streamed text is not its final text"
        if o.finish_reason in ("error", "abort"):
            assert o.finish_reason == "abort" or o.error, f"{what}: {rid} failed without a reason"
            assert o.token_ids == want[i][:len(o.token_ids)], f"{what}: {rid} got wrong tokens"
        else:
            assert o.finish_reason == "length" and o.token_ids == want[i], f"{what}: {rid} got wrong tokens"
    if eng.dead is None:
        eng.scheduler.check_integrity()
        assert_drained(eng)
    else:
        assert may_die, f"{what}: the engine died: {eng.dead}"
        assert all(o.finish_reason in ("error", "abort", "length") for o in finals.values())
        with pytest.raises(EngineDeadError):
            eng.add_request("late", [5, 6], SamplingParams(max_tokens=2))


# --- the functions under attack, found by a tracer ------------------------------------------------------
@functools.cache
def traced() -> dict[tuple[str, str], dict]:
    """Every function in src/minicb that the served workload calls (once the requests are queued):
    (module or class, attribute) -> its number of calls per mode, and whether every call of it was
    made inside ``ModelRunner.run`` (the tensor work)."""
    calls: dict[types.CodeType, dict] = {}
    run_code = ModelRunner.run.__code__

    def tracer(frame, event, arg):
        if event != "call" or not ARMED[0] or not frame.f_code.co_filename.startswith(str(SRC)):
            return None
        entry = calls.setdefault(frame.f_code, {"recompute": 0, "swap": 0, "outside_run": False})
        entry[mode] += 1
        f = frame.f_back
        while f is not None and f.f_code is not run_code:
            f = f.f_back
        if f is None and frame.f_code is not run_code:
            entry["outside_run"] = True
        return None

    for mode in ("recompute", "swap"):
        sys.settrace(tracer)
        try:
            workload(mode)
        finally:
            sys.settrace(None)
    found = {}
    for code, entry in calls.items():
        target = _find(code)
        if target is not None:
            owner = target[0]
            key = (owner.__name__ if isinstance(owner, types.ModuleType)
                   else f"{owner.__module__}.{owner.__qualname__}", target[1])
            found[key] = entry
    return dict(sorted(found.items()))


def traced_functions() -> list[tuple[str, str]]:
    return list(traced())


def _find(code: types.CodeType):
    """The (owner, attribute name) through which ``code``'s function is called, or None for code that
    has no name of its own (comprehensions, lambdas, nested functions: part of their parent)."""
    if code.co_name.startswith("<") or "<locals>" in code.co_qualname:
        return None
    for name, mod in list(sys.modules.items()):
        if not name.startswith("minicb") or mod is None:
            continue
        for attr, value in vars(mod).items():
            if getattr(value, "__code__", None) is code:
                return mod, attr
            if isinstance(value, type) and value.__module__ == name:
                for cname, member in vars(value).items():
                    fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                    if getattr(fn, "__code__", None) is code:
                        return value, cname
    return None


def _resolve(module_or_class: str, attr: str):
    for name, mod in sys.modules.items():
        if name == module_or_class:
            return mod, attr
    mod_name, _, cls_name = module_or_class.rpartition(".")
    return getattr(sys.modules[mod_name], cls_name), attr


class Injector:
    """Wraps one function (and, for ``double``, every traced function) to inject the fault."""

    def __init__(self, kind: str, at: int) -> None:
        self.kind, self.at, self.calls, self.fired, self.second = kind, at, 0, False, False

    def target_called(self) -> None:
        if not ARMED[0]:
            return
        self.calls += 1
        if self.calls == self.at and not self.fired:
            self.fired = True
            if self.kind == "error":
                raise RuntimeError("injected")
            self.second = self.kind == "double"
            signal.raise_signal(signal.SIGINT)

    def any_called(self) -> None:
        if self.second and ARMED[0]:
            self.second = False
            signal.raise_signal(signal.SIGINT)


def _patch(mp, owner, attr: str, before) -> None:
    member = vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)
    fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        before()
        return fn(*args, **kwargs)

    if isinstance(member, property):
        new = property(wrapped, member.fset, member.fdel, member.__doc__)
    elif isinstance(member, staticmethod):
        new = staticmethod(wrapped)
    elif isinstance(member, classmethod):
        new = classmethod(wrapped)
    else:
        new = wrapped
    if isinstance(owner, type):
        mp.setattr(owner, attr, new)
        return
    for name, mod in list(sys.modules.items()):         # every module that imported it by name
        if name.startswith("minicb") and mod is not None and getattr(mod, attr, None) is fn:
            mp.setattr(mod, attr, new)


def _is_tensor_work(target: tuple[str, str]) -> bool:
    """Called only inside ``ModelRunner.run``: an exception there fails only the step's requests."""
    return not traced()[target]["outside_run"]


def inject(monkeypatch, target: tuple[str, str], kind: str, at: int, mode: str):
    inj = Injector(kind, at)
    with monkeypatch.context() as mp:
        if kind == "double":
            for other in traced_functions():
                if other != target:
                    _patch(mp, *_resolve(*other), inj.any_called)
        _patch(mp, *_resolve(*target), inj.target_called)
        result = workload(mode)
    return inj, result


def _cases():
    for f, entry in traced().items():
        for kind, ats in (("sigint", (1, 2, 3)), ("error", (1, 2, 3)), ("double", (1,))):
            for at in ats:
                mode = ("swap", "recompute")[(at + (kind == "error")) % 2]
                if entry[mode] < at:
                    mode = "swap" if mode == "recompute" else "recompute"
                if entry[mode] >= at:            # a call that happens: the fault is sure to fire
                    yield pytest.param(f, kind, at, mode, id=f"{f[0]}.{f[1]}-{kind}-{at}-{mode}")


def test_the_tracer_finds_the_step_abort_and_failure_paths():
    names = {f"{owner}.{attr}" for owner, attr in traced_functions()}
    for must in ("minicb.core.scheduler.Scheduler.schedule", "minicb.core.scheduler.Scheduler.update",
                 "minicb.core.scheduler.Scheduler.abort", "minicb.core.scheduler.Scheduler.fail_step",
                 "minicb.engine.outputs.OutputTracker.output", "minicb.runtime.runner.ModelRunner.run",
                 "minicb.model.text.tokenizer.IncrementalDecoder.push"):
        assert must in names, f"{must} is not on the traced path"
    assert len(names) > 40, names


def test_the_undisturbed_workload_meets_the_contract():
    eng, finals, streamed, interrupts = workload("swap")
    assert interrupts == 0
    check(eng, finals, streamed, may_die=False, what="no fault")
    assert finals[ABORT[0]].finish_reason == "abort"
    assert sum(o.finish_reason == "error" for o in finals.values()) >= 1     # the runner's failure
    assert eng.stats.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize(("target", "kind", "at", "mode"), list(_cases()))
def test_a_fault_in_any_function_keeps_the_contract(monkeypatch, target, kind, at, mode):
    inj, (eng, finals, streamed, interrupts) = inject(monkeypatch, target, kind, at, mode)
    what = f"{kind} at call {at} of {target[0]}.{target[1]} ({mode})"
    assert inj.fired, f"{what}: the fault did not fire"
    contained = kind != "error" or _is_tensor_work(target)
    check(eng, finals, streamed, may_die=not contained, what=what)
    if eng.dead is not None:
        assert "RuntimeError: injected" in eng.dead, f"{what}: the engine died of {eng.dead}"
