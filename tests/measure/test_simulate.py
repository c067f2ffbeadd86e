"""The cost-model simulator: same Scheduler class as the engine, deterministic, calibrated, and the
benchmark table's qualitative result (continuous ahead of static) at LLaMA-3-70B scale. Also the workloads."""

from __future__ import annotations

import json

import pytest

from drain import drain
from minicb.core import scheduler as scheduler_module
from minicb.core.config import SchedulerConfig
from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.measure.workloads import (
    make_requests,
    poisson_arrivals,
    scale_lengths,
    trace_lengths,
    trace_timestamps,
)
from minicb.simulate.simulator import (
    LLAMA_3_8B,
    LLAMA_3_70B,
    SMOLLM2_135M,
    CostModel,
    SimulatedEngine,
    allreduce_table,
    preset,
    profile_errors,
    simulate,
)


def _cfg(policy="continuous", **kw):
    base = dict(max_num_seqs=32, max_num_batched_tokens=2048, long_prefill_chunk=512, block_size=16,
                num_blocks=4096, max_model_len=4096, policy=policy)
    return SchedulerConfig(**{**base, **kw})


# --- the same scheduler ---------------------------------------------------------------------------
def test_the_simulator_drives_the_engines_scheduler_class():
    from minicb.measure.bench_cli import build_model
    from minicb.runtime.runner import engine_for

    engine = engine_for(build_model("tiny", "float32")[0], _cfg())
    sim = SimulatedEngine(_cfg(), lambda plan: 1.0)
    assert type(sim.scheduler) is type(engine.scheduler) is scheduler_module.Scheduler


def test_the_simulator_is_the_engines_loop_with_aborts_outputs_and_failures():
    """SimulatedEngine is an LLMEngine over a clock-driven runner: it streams outputs stamped on the
    simulated clock, aborts, and fails a step whose "tensor work" (here: the cost model) raises."""
    from minicb.core.sampling_params import SamplingParams
    from minicb.engine.llm_engine import LLMEngine

    fail_at = {3}
    steps = []

    def step_time(plan):
        steps.append(plan.step)
        if len(steps) in fail_at:
            raise RuntimeError("cost model broke")
        return 0.5

    sim = SimulatedEngine(_cfg(max_num_seqs=2), step_time, token=7, start=10.0)
    assert isinstance(sim, LLMEngine)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sim.add_request("a", [5, 6, 7], params)
    sim.add_request("b", [8, 9], params)
    first = sim.step()                                  # both prompts, one step: 10.0 -> 10.5
    assert sim.now == 10.5  # load-independent: simulated time: 0.5 s a step from 10.0
    # load-independent: simulated time (a cost model), no wall clock
    assert [(o.request_id, o.new_token_ids, o.token_times) for o in first] == [("a", [7], [10.5]),
                                                                                ("b", [7], [10.5])]
    assert sim.abort_request("b").finish_reason == "abort"
    sim.step()                                          # a's 2nd token at 11.0
    failed = sim.step()                                 # the 3rd step_time call raises
    assert [(o.request_id, o.finish_reason, o.error) for o in failed] == [
        ("a", "error", "RuntimeError: cost model broke")]
    assert failed[0].token_ids == [7, 7] and not sim.has_unfinished_requests()
    sim.add_request("c", [1], params)                   # the engine serves on
    outs = drain(sim)
    assert outs[-1].finished and outs[-1].token_ids == [7] * 4
    # load-independent: simulated time (a cost model), no wall clock
    assert outs[-1].token_times == [11.5, 12.0, 12.5, 13.0]


def test_simulate_calls_scheduler_schedule_and_update(monkeypatch):
    calls = {"schedule": 0, "update": 0}
    real_schedule, real_update = scheduler_module.Scheduler.schedule, scheduler_module.Scheduler.update

    def schedule(self, now=0.0):
        calls["schedule"] += 1
        return real_schedule(self, now)

    def update(self, plan, sampled, now):
        calls["update"] += 1
        return real_update(self, plan, sampled, now)

    monkeypatch.setattr(scheduler_module.Scheduler, "schedule", schedule)
    monkeypatch.setattr(scheduler_module.Scheduler, "update", update)
    reqs = make_requests("sharegpt", 20, rate=50.0, seed=3, max_total=2048)
    res = simulate(reqs, _cfg(), preset("llama-3-8b"))
    assert calls["update"] == len(res.steps) > 0 and calls["schedule"] >= calls["update"]


# --- deterministic --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["static", "dynamic", "continuous"])
def test_simulation_is_deterministic_for_a_seed(policy):
    cm = preset("llama-3-70b")
    runs = [simulate(make_requests("sharegpt", 40, rate=8.0, seed=7, min_len=4, max_total=2048),
                     _cfg(policy), cm) for _ in range(2)]
    assert runs[0].summary.to_dict() == runs[1].summary.to_dict()
    assert runs[0].steps == runs[1].steps
    # load-independent: simulated time (a cost model), no wall clock
    assert [r.token_times for r in runs[0].requests] == [r.token_times for r in runs[1].requests]
    other = simulate(make_requests("sharegpt", 40, rate=8.0, seed=8, min_len=4, max_total=2048),
                     _cfg(policy), cm)
    assert other.summary.to_dict() != runs[0].summary.to_dict()


def test_every_request_finishes_with_its_tokens():
    reqs = make_requests("sharegpt", 60, rate=20.0, seed=1, min_len=4, max_total=2048, output_div=4)
    for policy in ("static", "dynamic", "continuous"):
        res = simulate(reqs, _cfg(policy, max_num_seqs=16, num_blocks=600), preset("llama-3-70b"))
        got = {r.request_id: r.num_output_tokens for r in res.requests}
        assert got == {r.request_id: r.output_len for r in reqs}
        assert res.summary.num_finished == 60


def test_preemption_happens_in_simulation_when_kv_is_short():
    reqs = make_requests("sharegpt", 60, rate=1000.0, seed=2, min_len=4, max_total=2048)
    res = simulate(reqs, _cfg(num_blocks=300), preset("llama-3-8b"))
    assert res.summary.num_preemptions > 0 and res.summary.num_finished == 60


# --- the benchmark table's shape at 70B ----------------------------------------------------------
def test_continuous_beats_static_at_70b_scale():
    # output lengths / 4 keep the test quick; 16 slots, 6 req/s: static's batches queue
    reqs = make_requests("sharegpt", 120, rate=6.0, seed=0, min_len=4, max_total=2048, output_div=4)
    cm = preset("llama-3-70b")
    s = {p: simulate(reqs, _cfg(p, max_num_seqs=16, num_blocks=cm.num_kv_blocks(16)), cm).summary
         for p in ("static", "continuous")}
    st, co = s["static"], s["continuous"]
    # load-independent: simulated time (a cost model), no wall clock
    assert co.output_tokens_per_s > st.output_tokens_per_s
    assert co.compute_utilisation > st.compute_utilisation
    # load-independent: simulated time (a cost model), no wall clock
    assert co.queueing_delay_mean < st.queueing_delay_mean
    assert co.padding_waste < 0.001 < 0.3 < st.padding_waste
    assert co.ttft_p99 < st.ttft_p99  # load-independent: simulated time (a cost model)


# --- the cost model -------------------------------------------------------------------------------
def _decode(n, ctx=500):
    return StepPlan(0, tuple(ScheduledSeq(str(i), i, (1,), ctx, (), True) for i in range(n)))


def test_cost_model_basics():
    cm = preset("llama-3-70b")
    assert cm.peak_flops == 8 * 312e12
    t = [cm.step_time(_decode(n)) for n in (1, 16, 64, 256)]
    # load-independent: simulated time (a cost model), no wall clock
    assert t == sorted(t) and 0.010 < t[0] < 0.030          # one decode: 17.6 GB of weights per GPU
    assert cm.step_time(StepPlan(0)) == 0.0  # load-independent: simulated time (a cost model), no wall clock
    parts = cm.breakdown(_decode(8))
    # load-independent: simulated time (a cost model), no wall clock
    assert sum(parts.values()) == pytest.approx(cm.step_time(_decode(8)))
    assert parts["allreduce"] > 0 and preset("llama-3-8b").breakdown(_decode(8))["allreduce"] == 0
    # padding rows cost linear work like real ones but no KV reads of a context
    pad = StepPlan(0, _decode(4).seqs, padding=(1,) * 4)
    # load-independent: simulated time (a cost model), no wall clock
    assert cm.step_time(_decode(4)) < cm.step_time(pad) < cm.step_time(_decode(8))


def test_kv_capacity_of_the_presets():
    # 70B, tp 8: 40 KB of K/V per token per GPU; 8B on one GPU: 128 KB per token
    assert preset("llama-3-70b").kv_bytes_per_token() == 2 * 80 * 1 * 128 * 2
    assert preset("llama-3-8b").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert 60_000 < preset("llama-3-70b").num_kv_blocks(16) < 90_000
    assert 20_000 < preset("llama-3-8b").num_kv_blocks(16) < 30_000
    assert LLAMA_3_70B.num_params == pytest.approx(70.6e9, rel=0.01)
    assert LLAMA_3_8B.num_params == pytest.approx(8.03e9, rel=0.01)
    assert SMOLLM2_135M.num_params == pytest.approx(134.5e6, rel=0.01)


def test_allreduce_table_is_monotone_and_interpolates():
    pts = allreduce_table(8)
    assert [p[1] for p in pts] == sorted(p[1] for p in pts)
    cm = preset("llama-3-70b")
    (x0, y0), (x1, y1) = pts[100], pts[101]
    assert cm._allreduce(x0) == pytest.approx(y0)
    assert y0 - 1e-12 <= cm._allreduce((x0 + x1) / 2) <= y1 + 1e-12
    assert cm._allreduce(2 * pts[-1][0]) == pytest.approx(2 * pts[-1][1])
    with pytest.raises(ValueError, match="all-reduce"):
        allreduce_table(3)


def test_presets_fit_the_vidur_profile():
    err = profile_errors(preset("llama-3-70b"))
    assert err["num_linear"] == 1824 * 4
    assert err["linear_median"] < 0.08 and err["linear_p90"] < 0.25
    assert err["elementwise_median"] < 0.08


@pytest.mark.slow
def test_preset_efficiencies_are_the_fit():
    from minicb.simulate.simulator import fit_vidur_linear

    fit = fit_vidur_linear()
    cm = preset("llama-3-70b")
    assert (fit["compute_eff"], fit["memory_eff"]) == (cm.compute_eff, cm.memory_eff)
    assert fit["op_launch_s"] == pytest.approx(cm.op_launch_s)  # load-independent: a fit to shipped data


def test_smollm2_preset_loads_the_shipped_calibration():
    cm = preset("smollm2-135m")
    assert cm.attention == "grouped" and not cm.device.overlap and cm.dtype_bytes == 4
    assert 0.01 < cm.step_time(_decode(8, 128)) < 5.0  # load-independent: the shipped calibration


def test_cost_model_validation():
    with pytest.raises(ValueError, match="compute_eff"):
        CostModel("x", LLAMA_3_8B, preset("llama-3-8b").device, compute_eff=1.5)
    with pytest.raises(ValueError, match="all-reduce"):
        CostModel("x", LLAMA_3_8B, preset("llama-3-8b").device, tp=2)
    with pytest.raises(ValueError, match="preset"):
        preset("gpt-5")


# --- workloads ------------------------------------------------------------------------------------
def test_trace_files_ship_with_the_package():
    assert len(trace_lengths("sharegpt")) == 84226
    assert len(trace_lengths("azure-conv")) == 19366 and len(trace_lengths("azure-code")) == 8819
    ts = trace_timestamps("azure-conv")
    assert ts[0] == 0.0 and ts == sorted(ts) and 3000 < ts[-1] < 3700       # one hour
    with pytest.raises(ValueError, match="no timestamps"):
        trace_timestamps("sharegpt")


def test_make_requests_poisson_and_replay():
    a = make_requests("sharegpt", 50, rate=4.0, seed=1)
    assert a == make_requests("sharegpt", 50, rate=4.0, seed=1)
    assert a != make_requests("sharegpt", 50, rate=4.0, seed=2)
    gaps = [y.arrival - x.arrival for x, y in zip(a, a[1:])]
    # load-independent: simulated arrival times from a seeded generator
    assert a[0].arrival == 0.0 and min(gaps) >= 0 and 0.1 < sum(gaps) / len(gaps) < 0.5
    r = make_requests("azure-code", 10, replay=True, time_scale=2.0)
    # load-independent: a shipped trace's timestamps
    assert [x.arrival for x in r] == pytest.approx([t / 2 for t in trace_timestamps("azure-code")[:10]])
    f = make_requests("sharegpt", 300, rate=1.0, min_len=4, max_total=2048)
    assert all(x.prompt_len >= 4 and x.output_len >= 4 and x.prompt_len + x.output_len <= 2048 for x in f)
    with pytest.raises(ValueError, match="exactly one"):
        make_requests("sharegpt", 5)
    with pytest.raises(ValueError, match="trace"):
        make_requests("nope", 5, rate=1.0)


def test_length_scaling_matches_bench_throughput():
    assert scale_lengths(1000, 517, max_prompt=256, output_div=4, max_output=128) == (256, 128)
    assert scale_lengths(10, 2, max_prompt=256, output_div=4, max_output=128) == (10, 1)
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]  # load-independent: generated times


def test_bench_workloads_reads_the_package_data():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    try:
        import workloads as bench_workloads
    finally:
        sys.path.pop(0)
    assert bench_workloads.trace_lengths("sharegpt").shape == (84226, 2)
    w = bench_workloads.w2(num=8)
    assert len(w.prompts) == 8 and all(1 <= n <= 128 for n in w.output_lens)


# --- the command line -----------------------------------------------------------------------------
def test_minicb_simulate_cli(tmp_path, capsys):
    from minicb.entrypoints.cli import main

    rc = main(["simulate", "--preset", "llama-3-8b", "--num-requests", "30", "--rates", "4,16",
               "--output-div", "8",
               "--max-num-seqs", "16", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "continuous @ 16/s" in out and "static @ 4/s" in out
    blob = json.loads((tmp_path / "simulate.json").read_text())
    assert len(blob["runs"]) == 6 and blob["meta"]["cost_model"]["name"] == "llama-3-8b"
    for png in ("curve.png", "throughput.png", "latency_cdf.png", "occupancy.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_minicb_simulate_rejects_bad_rates(capsys):
    from minicb.entrypoints.cli import main

    assert main(["simulate", "--rates", "1,x", "--no-progress"]) == 2
    assert "--rates" in capsys.readouterr().err
