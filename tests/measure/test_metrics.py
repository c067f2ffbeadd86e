"""Metrics on hand-built timelines with known answers, through the simulator and through the engine.

Every aggregate of ``minicb.measure.metrics`` is checked against a number worked out by hand here:
percentiles,
queueing delay, TTFT, inter-token latency, throughput, padding waste (a static batch with known
lengths), slot occupancy, KV block utilisation, compute utilisation and useful FLOPs. The same static
batch is then run through the real engine (tiny random model) with the ``StepRecorder`` on the
``on_plan`` hook, and ``minicb bench --model tiny`` is run end to end.
"""

from __future__ import annotations

import json

import pytest

from drain import drain
from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.plan import ScheduledSeq, StepPlan
from minicb.measure.metrics import (
    RequestRecord,
    StepRecord,
    StepRecorder,
    causal_pairs,
    format_table,
    layer_matmul_params,
    percentile,
    step_flops,
    summarize,
)
from minicb.measure.workloads import Request
from minicb.simulate.simulator import simulate

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)


# --- statistics -----------------------------------------------------------------------------------
def test_percentile_interpolates_linearly():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 99) == pytest.approx(1 + 3 * 0.99)     # position 2.97 between 3 and 4
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be in"):
        percentile(xs, 101)


def test_request_record_timeline():
    r = RequestRecord("a", arrival=10.0, first_scheduled=11.0, first_token=12.0,
                      token_times=[12.0, 12.5, 13.5], finish=13.5, num_prompt_tokens=4)
    assert r.queueing_delay == 1.0 and r.ttft == 2.0 and r.latency == 3.5  # load-independent: a fake clock
    assert r.inter_token_latencies == [0.5, 1.0]  # load-independent: a fake clock (times passed in)
    assert r.num_output_tokens == 3 and r.finished_ok
    waiting = RequestRecord("b", arrival=0.0)
    # load-independent: a fake clock
    assert waiting.queueing_delay is None and waiting.ttft is None and waiting.inter_token_latencies == []


# --- the table on a hand-built timeline -----------------------------------------------------------
def _timeline():
    """Two requests, four 1-second steps, 2 slots, 8 KV blocks, peak 25 FLOP/s (worked out below)."""
    reqs = [RequestRecord("r1", 0.0, 0.0, 1.0, [1.0, 2.0, 3.0], 3.0, num_prompt_tokens=4),
            RequestRecord("r2", 1.0, 2.0, 3.0, [3.0, 4.0], 4.0, num_prompt_tokens=3, num_preemptions=1)]
    # (step, start, end, slots computing, real tokens, padding tokens), then blocks in use and FLOPs
    steps = [StepRecord(0, 0.0, 1.0, 1, 4, 0, num_blocks_used=2, flops=10),
             StepRecord(1, 1.0, 2.0, 1, 1, 0, num_blocks_used=2, flops=20),
             StepRecord(2, 2.0, 3.0, 2, 4, 2, num_blocks_used=4, flops=30),
             StepRecord(3, 3.0, 4.0, 1, 1, 1, num_blocks_used=4, flops=40)]
    return reqs, steps


def test_summary_of_a_known_timeline():
    reqs, steps = _timeline()
    s = summarize(reqs, steps, label="x", num_slots=2, num_blocks=8, peak_flops=25.0)
    # load-independent: a fake clock
    assert s.duration == 4.0                                   # first arrival 0 .. last finish 4
    # load-independent: a fake clock (times passed in)
    assert s.output_tokens == 5 and s.output_tokens_per_s == pytest.approx(5 / 4)
    # load-independent: a fake clock (times passed in)
    assert s.queueing_delay_mean == pytest.approx(0.5)         # delays 0 and 1
    assert s.queueing_delay_p50 == pytest.approx(0.5)  # load-independent: a fake clock (times passed in)
    # load-independent: a fake clock (times passed in)
    assert s.queueing_delay_p99 == pytest.approx(0.99)
    # load-independent: a fake clock
    assert s.ttft_mean == pytest.approx(1.5) and s.ttft_p99 == pytest.approx(1.99)   # TTFTs 1 and 2
    # load-independent: a fake clock
    assert s.itl_p50 == pytest.approx(1.0) and s.itl_p99 == pytest.approx(1.0)       # gaps 1, 1, 1
    assert s.latency_mean == pytest.approx((3 + 3) / 2)  # load-independent: a fake clock
    assert s.padding_waste == pytest.approx(3 / 13)            # 3 padding of 10 real + 3 padding
    assert s.slot_occupancy == pytest.approx((1 + 1 + 2 + 1) / (2 * 4))
    assert s.kv_block_utilisation == pytest.approx((2 + 2 + 4 + 4) / (8 * 4))
    assert s.compute_utilisation == pytest.approx(100 / 4 / 25)
    # load-independent: a fake clock (times passed in)
    assert s.num_preemptions == 1 and s.num_steps == 4 and s.step_time_mean == 1.0
    assert s.real_tokens_computed == 10 and s.padding_tokens_computed == 3


def test_summary_idle_gaps_count_in_the_duration():
    reqs = [RequestRecord("a", 0.0, 0.0, 1.0, [1.0], 1.0), RequestRecord("b", 9.0, 9.0, 10.0, [10.0], 10.0)]
    steps = [StepRecord(0, 0.0, 1.0, 1, 3, 0), StepRecord(1, 9.0, 10.0, 1, 3, 0)]
    s = summarize(reqs, steps, num_slots=1)
    assert s.duration == 10.0 and s.slot_occupancy == pytest.approx(0.2)  # load-independent: a fake clock
    assert s.compute_utilisation is None and s.kv_block_utilisation is None    # no peak / no capacity


def test_summary_errors_and_unfinished_requests():
    with pytest.raises(ValueError, match="at least one request"):
        summarize([])
    aborted = RequestRecord("a", 0.0, 0.5, 1.0, [1.0], 2.0, finish_reason="abort")
    s = summarize([aborted, RequestRecord("b", 0.0, 1.0, 2.0, [2.0, 3.0], 3.0)])
    assert s.num_finished == 1 and s.output_tokens == 2        # only finished requests' tokens count
    # load-independent: a fake clock (times passed in)
    assert s.queueing_delay_mean == pytest.approx(0.75)       # but every scheduled request waited


# --- FLOPs ----------------------------------------------------------------------------------------
def test_causal_pairs():
    assert causal_pairs(0, 3) == 1 + 2 + 3
    assert causal_pairs(5, 1) == 6
    assert causal_pairs(2, 3) == 3 + 4 + 5


def test_step_flops_matches_model_config_for_a_decode():
    ctx = 37
    plan = StepPlan(0, (ScheduledSeq("a", 0, (5,), ctx - 1, (0, 1, 2), True),))
    h, L = TINY.hidden_size, TINY.num_hidden_layers
    norms = 2 * h * L + h     # ModelConfig.num_params counts the RMSNorm weights, which do no matmul
    assert step_flops(plan, TINY) == pytest.approx(TINY.flops_per_token(ctx) - 2 * norms)


def test_step_flops_counts_chunks_heads_and_no_padding():
    body = 2 * layer_matmul_params(TINY)
    head = 2 * TINY.vocab_size * TINY.hidden_size
    attn = 4 * TINY.num_hidden_layers * TINY.num_attention_heads * TINY.head_dim
    chunk = ScheduledSeq("a", 0, (1, 2, 3), 2, (0,), False)       # 3 tokens after 2 cached, no sample
    dec = ScheduledSeq("b", 1, (9,), 10, (1, 2), True)
    plan = StepPlan(0, (chunk, dec), padding=(4, 4))
    expect = body * 3 + attn * (3 + 4 + 5) + body + attn * 11 + head
    assert step_flops(plan, TINY) == pytest.approx(expect)
    assert step_flops(StepPlan(1, (), padding=(8,)), TINY) == 0.0


# --- a static batch with known lengths, through the real Scheduler --------------------------------
class OneSecondPerStep:
    """A cost model stub: every step takes one simulated second."""

    model = TINY
    peak_flops = 1e9

    @staticmethod
    def breakdown(plan):
        return {"overhead": 1.0}


# prompts of 2 and 4 tokens, 1 and 3 output tokens:
#   step 0  A A . .   B B B B    prefill padded to 4: 2 padding; A samples its only token
#   step 1  .         B          A finished but keeps its row: 1 padding
#   step 2  .         B          1 padding; B has its 3 tokens
# real 2 + 4 + 1 + 1 = 8, padding 2 + 1 + 1 = 4: waste 4 / 12
STATIC_REQS = [Request("A", 2, 1, 0.0), Request("B", 4, 3, 0.0)]


@pytest.mark.parametrize("policy, waste", [("static", 4 / 12), ("dynamic", 4 / 12), ("continuous", 0.0)])
def test_static_batch_padding_waste_is_computable(policy, waste):
    cfg = SchedulerConfig(max_num_seqs=2, num_blocks=8, block_size=4, policy=policy)
    res = simulate(STATIC_REQS, cfg, OneSecondPerStep(), label=policy)
    s = res.summary
    assert s.padding_waste == pytest.approx(waste)
    assert [st.num_seqs for st in res.steps] == [2, 1, 1]
    # load-independent: a fake clock
    assert s.duration == 3.0 and s.output_tokens_per_s == pytest.approx(4 / 3)
    assert s.slot_occupancy == pytest.approx((2 + 1 + 1) / (2 * 3))
    assert s.queueing_delay_mean == 0.0 and s.ttft_mean == 1.0  # load-independent: a fake clock
    assert s.itl_p50 == 1.0 and s.itl_p99 == 1.0  # load-independent: a fake clock
    held = [st.num_slots_held for st in res.steps]
    assert held == ([2, 2, 2] if policy != "continuous" else [2, 1, 1])
    # KV, block size 4, counted when the step is planned. Padded policies reserve prompt + max_tokens up
    # front (A 3 tokens -> 1 block, B 7 -> 2); continuous allocates as it goes (A 2 -> 1, B 4 -> 1; then
    # A is gone and B's 5th token needs a second block)
    used = [st.num_blocks_used for st in res.steps]
    assert used == ([3, 3, 3] if policy != "continuous" else [2, 2, 2])


def test_static_waits_for_a_full_batch_and_queues():
    """Three requests, two slots: static runs A+B, then C alone once arrivals close."""
    reqs = [Request("A", 2, 1, 0.0), Request("B", 2, 1, 0.5), Request("C", 2, 1, 0.7)]
    cfg = SchedulerConfig(max_num_seqs=2, num_blocks=8, block_size=4, policy="static")
    res = simulate(reqs, cfg, OneSecondPerStep())
    rec = {r.request_id: r for r in res.requests}
    # load-independent: a simulated one-second-per-step clock
    assert rec["A"].queueing_delay == 0.5          # waits for B to fill the batch
    assert rec["B"].queueing_delay == 0.0  # load-independent: a simulated one-second-per-step clock
    # load-independent: a simulated one-second-per-step clock
    assert rec["C"].first_scheduled == 1.5 and rec["C"].queueing_delay == pytest.approx(0.8)
    cont = simulate(reqs, SchedulerConfig(max_num_seqs=2, num_blocks=8, block_size=4), OneSecondPerStep())
    # load-independent: a simulated one-second-per-step clock
    assert cont.summary.queueing_delay_mean < res.summary.queueing_delay_mean


# --- through the engine ---------------------------------------------------------------------------
def _tiny_model():
    from minicb.measure.bench_cli import build_model

    return build_model("tiny", "float32")[0]


def test_engine_static_batch_padding_waste_and_records():
    from minicb.measure.bench_cli import make_prompts, run_policy

    model = _tiny_model()
    prompts = make_prompts(STATIC_REQS, model.config.vocab_size, seed=0)
    kw = dict(max_num_seqs=2, num_blocks=8, block_size=4, max_model_len=16)
    reqs, steps, stats, shapes = run_policy(model, "static", STATIC_REQS, prompts, kw)
    assert shapes == [[[[0, 2, 1], [0, 4, 1]], [2]], [[[4, 1, 1]], [1]], [[[5, 1, 1]], [1]]]
    s = summarize(reqs, steps, num_slots=2, num_blocks=8, peak_flops=1e9)
    assert s.padding_waste == pytest.approx(4 / 12)
    assert [(st.num_seqs, st.num_tokens, st.num_padding_tokens) for st in steps] == [(2, 6, 2), (1, 1, 1),
                                                                                      (1, 1, 1)]
    assert stats.num_padding_tokens == 4 and stats.num_batched_tokens == 8
    by = {r.request_id: r for r in reqs}
    assert by["A"].num_output_tokens == 1 and by["B"].num_output_tokens == 3
    # load-independent: orders timestamps only
    assert by["B"].first_token <= by["B"].token_times[1] <= by["B"].finish
    assert all(st.end >= st.start for st in steps) and all(st.flops > 0 for st in steps)


def test_step_recorder_listens_beside_other_listeners():
    from minicb.core.config import SchedulerConfig as SC
    from minicb.core.sampling_params import SamplingParams
    from minicb.runtime.runner import engine_for

    eng = engine_for(_tiny_model(), SC(max_num_seqs=2, num_blocks=8, block_size=4, max_model_len=16))
    seen = []
    eng.listen(on_plan=lambda ev: seen.append(ev.plan))
    rec = StepRecorder(TINY).attach(eng)
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    drain(eng)
    assert len(rec.steps) == 2 and len(seen) >= 2
    assert [s.num_tokens for s in rec.steps] == [3, 1]
    assert all(s.end >= s.start for s in rec.steps) and rec.steps[0].end <= rec.steps[1].start


def test_format_table_has_the_benchmark_table_columns():
    reqs, steps = _timeline()
    s = summarize(reqs, steps, label="continuous", num_slots=2, num_blocks=8, peak_flops=25.0)
    text = format_table([s])
    for col in ("throughput tok/s", "compute util", "queue mean ms", "ITL P99 ms", "padding waste"):
        assert col in text
    assert "continuous" in text and "1.2" in text          # 1.25 tokens/s
    md = format_table([s], markdown=True)
    assert md.startswith("| policy |") and md.count("\n") == 2


def test_minicb_bench_tiny_cli(tmp_path, capsys):
    from minicb.entrypoints.cli import main

    out = tmp_path / "b"
    rc = main(["bench", "--model", "tiny", "--num-requests", "6", "--rate", "200", "--max-prompt", "16",
               "--output-div", "32", "--max-output", "6", "--max-num-seqs", "3", "--num-blocks", "64",
               "--peak-gflops", "10", "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for policy in ("static", "dynamic", "continuous"):
        assert policy in text
    blob = json.loads((out / "bench.json").read_text())
    assert set(blob["runs"]) == {"static", "dynamic", "continuous"}
    for run in blob["runs"].values():
        assert run["summary"]["num_finished"] == 6
    assert blob["runs"]["continuous"]["summary"]["padding_waste"] == 0.0
    for png in ("throughput.png", "latency_cdf.png", "occupancy.png"):
        assert (out / png).stat().st_size > 1000


def test_minicb_bench_rejects_bad_arguments(capsys):
    from minicb.entrypoints.cli import main

    assert main(["bench", "--model", "tiny", "--replay", "--trace", "sharegpt"]) == 2
    assert "timestamps" in capsys.readouterr().err  # load-independent: an error message
    assert main(["bench", "--model", "tiny", "--num-requests", "0"]) == 2
