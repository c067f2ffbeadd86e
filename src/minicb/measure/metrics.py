"""Serving metrics: the benchmark table (throughput, utilisation, queueing, inter-token latency, padding).

Two kinds of record, both plain values (no torch), filled the same way by the real engine
(``minicb bench``) and by the cost-model simulator (``minicb simulate``):

* ``RequestRecord``: one request's timeline (``RequestOutput`` and ``Sequence`` carry every stamp)::

      arrival ──queueing delay──► first scheduled ──► first token ──ITL──► token ... ──► finish
         └────────────────── time to first token (TTFT) ──┘

* ``StepRecord``: one forward step: when it ran, how many real and padding tokens it computed, how
  many slots computed real tokens, how many KV blocks were in use, its useful FLOPs.
  ``StepRecorder`` builds them from the engine's step events (``engine.listen(on_step=...)``; any
  other listener, e.g. a ``minicb trace`` recorder, is called too) or from explicit ``record`` calls.

``summarize(requests, steps, ...)`` turns them into a ``Summary``. Definitions (``duration`` runs
from the first arrival to the last finish, idle gaps included, so a lightly loaded server shows low
utilisation, as the static batch of the static-batching note does):

=========================  =============================================================================
output tokens/s            output tokens of finished requests / duration
queueing delay             first scheduled - arrival (mean, P50, P99 over requests)
TTFT                       first token - arrival
inter-token latency (ITL)  gaps between consecutive tokens of one request, pooled over requests
padding waste              padding tokens computed / (padding + real tokens computed)
slot occupancy             sum over steps of (slots computing real tokens x step time)
                           / (slots x duration)
KV block utilisation       sum over steps of (blocks in use x step time) / (blocks x duration)
compute utilisation        useful FLOPs / duration / peak FLOP/s (the measured matmul ceiling on the
                           CPU, the devices' peak in simulation)
=========================  =============================================================================

Useful FLOPs of a step (``step_flops``): every real token costs ``2 x`` the layers' matmul parameters,
every sampled row ``2 x vocab x hidden`` for the LM head, and causal attention ``4 x layers x heads x
head_dim`` per (query, key) pair. Padding tokens are not useful work. Percentiles interpolate linearly
between order statistics (numpy's default). This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from minicb.core.config import ModelConfig
from minicb.core.errors import InvalidArgument
from minicb.core.plan import StepPlan


# --- small statistics ---------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not 0 <= q <= 100:
        raise InvalidArgument(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# --- per request --------------------------------------------------------------------------------------
@dataclass(slots=True)
class RequestRecord:
    """One request's timeline (seconds, any clock: only differences are used)."""

    request_id: str
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None

    @classmethod
    def from_output(cls, out) -> RequestRecord:
        """From an engine ``RequestOutput``."""
        return cls(out.request_id, out.arrival_time, out.first_scheduled_time, out.first_token_time,
                   list(out.token_times), out.finish_time, len(out.prompt_token_ids), out.num_preemptions,
                   out.finish_reason)

    @classmethod
    def from_sequence(cls, seq) -> RequestRecord:
        """From a scheduler ``Sequence`` (what the simulator has)."""
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        return cls(seq.request_id, seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                   list(seq.token_times), seq.finish_time, seq.num_prompt_tokens, seq.num_preemptions,
                   reason)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def finished_ok(self) -> bool:
        return self.finish is not None and self.finish_reason in (None, "stop", "length")

    @property
    def queueing_delay(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        """End to end: finish - arrival."""
        return None if self.finish is None else self.finish - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


# --- per step -----------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class StepRecord:
    step: int
    start: float
    end: float
    num_seqs: int                 # rows computing real tokens = slots busy this step
    num_tokens: int               # real tokens computed
    num_padding_tokens: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_slots_held: int = 0       # slots held (padded batches keep finished members' slots)
    num_blocks_used: int = 0      # device KV blocks in use
    num_preempted: int = 0
    flops: float = 0.0            # useful FLOPs (step_flops)

    @property
    def duration(self) -> float:
        return self.end - self.start


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights multiplied per token in the decoder layers (q, k, v, o, gate, up, down)."""
    h, d = cfg.hidden_size, cfg.head_dim
    return cfg.num_hidden_layers * (h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                                    + 3 * h * cfg.intermediate_size)


def causal_pairs(start: int, n: int) -> int:
    """(query, key) pairs of ``n`` new tokens after ``start`` cached ones: sum of start + i + 1."""
    return n * start + n * (n + 1) // 2


def matmul_flops(cfg: ModelConfig, tokens: int, sampled: int) -> float:
    """FLOPs of the matmuls for ``tokens`` rows through the decoder layers, ``sampled`` of them also
    through the LM head (``2 x`` the weights each row multiplies)."""
    return 2.0 * layer_matmul_params(cfg) * tokens + 2.0 * cfg.vocab_size * cfg.hidden_size * sampled


def step_flops(plan: StepPlan, cfg: ModelConfig) -> float:
    """Useful FLOPs of ``plan`` (see the module docstring): padding rows count nothing."""
    tokens, sampled, pairs, _ = _row_sums(plan)
    return _flops(cfg, tokens, sampled, pairs)


def _flops(cfg: ModelConfig, tokens: int, sampled: int, pairs: int) -> float:
    attn = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return matmul_flops(cfg, tokens, sampled) + attn * pairs


def _row_sums(plan: StepPlan, prompts=None) -> tuple[int, int, int, int]:
    """(tokens, sampled rows, causal pairs, decode rows) of ``plan``'s rows, in one pass (the simulator
    records every step); decodes are counted only with ``prompts`` (a ``trace.PromptLengths``)."""
    from minicb.core.plan import DECODE

    tokens = sampled = pairs = decodes = 0
    for s in plan.seqs:
        n, start = len(s.token_ids), s.start_pos
        tokens += n
        pairs += n * start + n * (n + 1) // 2
        sampled += s.sample
        if prompts is not None:
            decodes += prompts.kind(s) == DECODE
    return tokens, sampled, pairs, decodes


def step_record(plan: StepPlan, start: float, end: float, cfg: ModelConfig | None = None,
                num_slots_held: int = 0, num_blocks_used: int = 0, prompts=None) -> StepRecord:
    """The ``StepRecord`` of ``plan`` run from ``start`` to ``end``. A decode is a row that starts past
    its prompt (``minicb.core.plan.row_kind``); ``prompts``, a ``trace.PromptLengths`` that has seen
    the run's earlier plans, knows where each prompt ends (without one, only this plan is seen)."""
    from minicb.measure.trace import PromptLengths

    n, sampled, pairs, decodes = _row_sums(plan, PromptLengths() if prompts is None else prompts)
    return StepRecord(step=plan.step, start=start, end=end, num_seqs=len(plan.seqs), num_tokens=n,
                      num_padding_tokens=plan.num_padding_tokens, num_prefill_tokens=n - decodes,
                      num_decode_tokens=decodes, num_slots_held=num_slots_held,
                      num_blocks_used=num_blocks_used, num_preempted=len(plan.preempted),
                      flops=_flops(cfg, n, sampled, pairs) if cfg is not None else 0.0)


class StepRecorder:
    """Collects a ``StepRecord`` per non-empty step.

    With an engine: ``rec = StepRecorder(model_config).attach(engine)`` (it listens to the engine's step
    events: a step's start and end are the engine's clock when it was planned and when it was
    recorded). Without events: ``rec.record(plan, start, end, held, used)``.
    """

    def __init__(self, model_config: ModelConfig | None = None,
                 on_record: Callable[[StepRecord], None] | None = None) -> None:
        self.model_config = model_config
        self.steps: list[StepRecord] = []
        self.on_record = on_record
        self._prompts = None                 # trace.PromptLengths, made on the first record

    def attach(self, engine) -> StepRecorder:
        """Record every non-empty step of ``engine`` from its step events (``engine.listen``)."""
        engine.listen(on_step=self.on_step)
        return self

    def on_step(self, event) -> None:
        """A ``StepEvent`` listener: one record per step that computed something."""
        if event.plan.seqs or event.plan.padding:
            self.record(event.plan, event.start, event.end, event.state.num_held_slots,
                        event.state.num_used_blocks)

    def record(self, plan: StepPlan, start: float, end: float, num_slots_held: int = 0,
               num_blocks_used: int = 0) -> StepRecord:
        if self._prompts is None:
            from minicb.measure.trace import PromptLengths

            self._prompts = PromptLengths()
        rec = step_record(plan, start, end, self.model_config, num_slots_held, num_blocks_used,
                          self._prompts)
        self.steps.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        return rec


# --- the table ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Summary:
    """The aggregates of one run (times in seconds, ratios in [0, 1]; None where undefined)."""

    label: str
    num_requests: int
    num_finished: int
    duration: float
    output_tokens: int
    prompt_tokens: int
    output_tokens_per_s: float
    compute_utilisation: float | None
    queueing_delay_mean: float | None
    queueing_delay_p50: float | None
    queueing_delay_p99: float | None
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_mean: float | None
    itl_p50: float | None
    itl_p99: float | None
    latency_mean: float | None
    latency_p99: float | None
    padding_waste: float
    slot_occupancy: float | None
    kv_block_utilisation: float | None
    num_preemptions: int
    num_steps: int
    step_time_mean: float | None
    real_tokens_computed: int
    padding_tokens_computed: int
    useful_flops: float
    peak_flops: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(requests: Iterable[RequestRecord], steps: Sequence[StepRecord] = (), *, label: str = "",
              num_slots: int | None = None, num_blocks: int | None = None, peak_flops: float | None = None,
              num_preemptions: int | None = None, duration: float | None = None) -> Summary:
    """The benchmark table's row (and more) from request and step records; see the module docstring.

    ``num_preemptions`` defaults to the sum over requests; ``duration`` to last finish - first arrival.
    """
    reqs = list(requests)
    if not reqs:
        raise InvalidArgument("summarize needs at least one request record")
    done = [r for r in reqs if r.finished_ok]
    if duration is None:
        ends = [r.finish for r in reqs if r.finish is not None] + [s.end for s in steps]
        duration = max(ends, default=0.0) - min(r.arrival for r in reqs)
    out_tokens = sum(r.num_output_tokens for r in done)
    qd = [r.queueing_delay for r in reqs if r.queueing_delay is not None]
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    itl = [g for r in reqs for g in r.inter_token_latencies]
    lat = [r.latency for r in done]
    real = sum(s.num_tokens for s in steps)
    pad = sum(s.num_padding_tokens for s in steps)
    flops = sum(s.flops for s in steps)

    def weighted(attr: str, capacity: int | None) -> float | None:
        if not capacity or duration <= 0:
            return None
        return sum(getattr(s, attr) * s.duration for s in steps) / (capacity * duration)

    return Summary(
        label=label, num_requests=len(reqs), num_finished=len(done), duration=duration,
        output_tokens=out_tokens, prompt_tokens=sum(r.num_prompt_tokens for r in done),
        output_tokens_per_s=out_tokens / duration if duration > 0 else 0.0,
        compute_utilisation=flops / duration / peak_flops if peak_flops and duration > 0 else None,
        queueing_delay_mean=mean(qd), queueing_delay_p50=percentile(qd, 50),
        queueing_delay_p99=percentile(qd, 99),
        ttft_mean=mean(ttft), ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        itl_mean=mean(itl), itl_p50=percentile(itl, 50), itl_p99=percentile(itl, 99),
        latency_mean=mean(lat), latency_p99=percentile(lat, 99),
        padding_waste=pad / (pad + real) if pad + real else 0.0,
        slot_occupancy=weighted("num_seqs", num_slots),
        kv_block_utilisation=weighted("num_blocks_used", num_blocks),
        num_preemptions=sum(r.num_preemptions for r in reqs) if num_preemptions is None else num_preemptions,
        num_steps=len(steps), step_time_mean=mean([s.duration for s in steps]),
        real_tokens_computed=real, padding_tokens_computed=pad, useful_flops=flops, peak_flops=peak_flops,
    )


# --- printing -----------------------------------------------------------------------------------------
# (column title, Summary field, scale, format); the first five are the benchmark table's columns
COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    ("throughput tok/s", "output_tokens_per_s", 1.0, "{:,.1f}"),
    ("compute util", "compute_utilisation", 100.0, "{:.1f}%"),
    ("queue mean ms", "queueing_delay_mean", 1e3, "{:,.0f}"),
    ("ITL P99 ms", "itl_p99", 1e3, "{:,.1f}"),
    ("padding waste", "padding_waste", 100.0, "{:.1f}%"),
    ("TTFT P50 ms", "ttft_p50", 1e3, "{:,.0f}"),
    ("TTFT P99 ms", "ttft_p99", 1e3, "{:,.0f}"),
    ("ITL P50 ms", "itl_p50", 1e3, "{:,.1f}"),
    ("queue P99 ms", "queueing_delay_p99", 1e3, "{:,.0f}"),
    ("slot occ.", "slot_occupancy", 100.0, "{:.1f}%"),
    ("KV util", "kv_block_utilisation", 100.0, "{:.1f}%"),
    ("preempt", "num_preemptions", 1.0, "{:.0f}"),
)
BENCHMARK_COLUMNS = COLUMNS[:5]


def format_value(value, scale: float, fmt: str) -> str:
    return "-" if value is None else fmt.format(value * scale)


def table_rows(summaries: Sequence[Summary], columns=COLUMNS) -> list[list[str]]:
    """``[header, row, ...]``: the label column then ``columns``."""
    rows = [["policy"] + [c[0] for c in columns]]
    for s in summaries:
        rows.append([s.label] + [format_value(getattr(s, f), k, fmt) for _, f, k, fmt in columns])
    return rows


def format_table(summaries: Sequence[Summary], columns=COLUMNS, markdown: bool = False,
                 width: int | None = None) -> str:
    """The table as aligned text, or as a Markdown table.

    ``width`` (characters): the text table is made to fit it, as ``minicb bench`` and ``minicb
    simulate`` print it (100 columns unless ``--wide``): headers go on two lines ("throughput" over
    "tok/s"), and columns that still do not fit go into a second table under the first, each table
    with the policy column. ``None``: one table, one header line, however wide."""
    rows = table_rows(summaries, columns)
    if markdown:
        head, *body = rows
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    if width is None:
        return _text_table(rows)
    head, *body = rows
    split = [h.rsplit(" ", 1) if " " in h else ["", h] for h in head]      # two header lines
    cols = [[top, bottom, *(r[i] for r in body)] for i, (top, bottom) in enumerate(split)]
    col_w = [max(map(len, c)) for c in cols]
    groups, current, used = [], [], col_w[0]
    for i in range(1, len(cols)):
        if current and used + 2 + col_w[i] > width:
            groups.append(current)
            current, used = [], col_w[0]
        current.append(i)
        used += 2 + col_w[i]
    groups.append(current)
    tables = []
    for group in groups:
        idx = [0, *group]
        tables.append(_text_table([[cols[i][r] for i in idx] for r in range(len(cols[0]))]))
    return "\n\n".join(tables)


def _text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                               enumerate(zip(r, widths))).rstrip() for r in rows)


def records_to_json(summary: Summary, requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                    extra: Mapping | None = None) -> dict:
    """A JSON-ready dict of one run: the summary, every request's timeline, every step."""
    return {"summary": summary.to_dict(), **(dict(extra) if extra else {}),
            "requests": [asdict(r) for r in requests], "steps": [asdict(s) for s in steps]}
