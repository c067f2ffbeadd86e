"""A cost-model simulator: the real engine, a clock, and a step time computed from the plan.

Nothing here runs a model. The simulator is the engine's own ``LLMEngine`` (its scheduler, its step
loop, its aborts, outputs and failure handling) driving a ``SimRunner`` instead of a model: a
``CostModel`` says how long the plan would take on a given machine, the simulated clock jumps by that
much, and every sampled row gets a dummy token, recorded at the new time. So every policy decision
(admission, chunking, preemption, padding) is minicb's own, at any scale::

    while requests remain:                                   # minicb.engine.arrivals.drive
        add the requests whose (simulated) arrival time has passed
        engine.step():
            plan = scheduler.schedule(now)                   # the engine's loop, unchanged
            SimRunner.run(plan): now += cost.step_time(plan) # FLOPs and bytes -> seconds
            scheduler.update(plan, {rid: token for sampled rows}, now)

The cost of one step (``CostModel.breakdown``), per device of a ``tp``-way tensor-parallel group, for
``M`` computed tokens (real + padding) and ``S`` sampled rows::

    linear ops   per layer q/k/v, o, gate+up, down (sharded by tp) and the LM head (S rows):
                 max(FLOPs / (peak x compute_eff), bytes / (bandwidth x memory_eff)) + launch
                 (a roofline per op; on a CPU core that does not overlap the two, their sum)
    attention    prefill: 4 x heads x head_dim per causal (query, key) pair / (peak x attn_eff);
                 decode: K and V bytes of the context / (bandwidth x memory_eff);
                 "grouped" (minicb's reference CPU backend) costs padded [rows x Lq x Lk] rectangles,
                 one per group (decodes, prompt chunks, padding rows), plus a fixed cost per group
    elementwise  norms, RoPE, SiLU, residual adds: bytes / (bandwidth x elementwise_eff) + launch
    all-reduce   two per layer (after attention, after the MLP) of M x hidden x dtype bytes, from the
                 measured NCCL table for tp workers (log-log interpolation)
    overhead     step_overhead + seq_overhead x rows (scheduling, input preparation, sampling)

Calibration. The LLaMA-3 presets take ``compute_eff``, ``memory_eff`` and the per-op launch time from
microsoft/vidur's A100 per-operation profile of a LLaMA-3-70B layer (tp 1, 2, 4, 8; 1 to 32k tokens;
``fit_vidur_linear`` reproduces the numbers), the elementwise
terms from the same file, and the all-reduce times from vidur's A100 DGX NCCL profile
(``minicb/data/profiles``, MIT, see SOURCES.md there). Attention is not in those files: prefill
attention uses ``attn_eff = 0.5`` (FlashAttention-2's forward reaches 50-70% of an A100's peak), decode
attention the fitted memory efficiency. The fixed per-step overheads are assumptions, not fitted. The
``smollm2-135m`` preset is fitted to this machine's measurements (``bench/calibrate_cpu.py``, which runs
``bench/forward.py``'s cases with one torch thread, plus the engine's own per-step overhead).

``simulate`` is deterministic: the same requests, config and cost model give the same records.
This module imports no torch.
"""

from __future__ import annotations

import bisect
import contextlib
import csv
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache

from minicb.core.config import ModelConfig, SchedulerConfig
from minicb.core.errors import InvalidArgument, check_float, check_int
from minicb.core.plan import StepPlan
from minicb.core.sampling_params import RequestOutputKind, SamplingParams
from minicb.engine.arrivals import Arrival, NoProgress, drive
from minicb.engine.llm_engine import LLMEngine
from minicb.engine.logprobs import RowOutput, TokenLogprobs
from minicb.measure.metrics import RequestRecord, StepRecord, StepRecorder, Summary, causal_pairs, summarize
from minicb.measure.workloads import Request, data_path

# --- models -------------------------------------------------------------------------------------------
LLAMA_3_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                          tie_word_embeddings=False, max_position_embeddings=8192)
LLAMA_3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=False, max_position_embeddings=8192)
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                           tie_word_embeddings=True, max_position_embeddings=8192)


@dataclass(slots=True, frozen=True)
class Device:
    """One accelerator (or CPU core set): peak FLOP/s in the model's dtype, memory bandwidth, capacity."""

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float
    overlap: bool = True        # a roofline max(compute, memory) per op; False: their sum (a CPU core)

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bw", "mem_bytes"):     # a rate of 0 or inf makes every time nan
            check_float(name, getattr(self, name), lo=0.0, lo_open=True, finite=True)


A100_80GB = Device("A100-SXM4-80GB", peak_flops=312e12, mem_bw=2.039e12, mem_bytes=80e9)


MAX_STEP_SECONDS = 3600.0      # the largest fixed time (overhead, launch) a cost model accepts


@dataclass(slots=True, frozen=True)
class CostModel:
    """Step time of a ``StepPlan`` on ``tp`` devices (see the module docstring for the formula)."""

    name: str
    model: ModelConfig
    device: Device
    tp: int = 1
    dtype_bytes: int = 2
    compute_eff: float = 0.72
    memory_eff: float = 0.82
    attn_eff: float = 0.5
    attn_memory_eff: float | None = None  # K/V reads of attention (None: memory_eff)
    elementwise_eff: float = 0.64
    op_launch_s: float = 18e-6            # per linear op (launch and tail latency)
    elementwise_launch_s: float = 12e-6   # per layer, all elementwise ops together
    attn_group_s: float = 0.0             # per layer and attention group ("grouped": a fixed cost of each
                                          # gather + mask + SDPA call, which the CPU backend makes per group)
    step_overhead_s: float = 1e-3
    seq_overhead_s: float = 10e-6
    attention: str = "varlen"             # "varlen" (exact causal pairs) or "grouped" (minicb reference)
    allreduce: tuple[tuple[float, float], ...] = ()   # (bytes, seconds), sorted by bytes
    host_bw: float = 25e9                 # swap copies (PCIe)
    gpu_memory_utilization: float = 0.9
    description: str = ""

    def __post_init__(self) -> None:
        if self.attention not in ("varlen", "grouped"):
            raise InvalidArgument(f"attention must be 'varlen' or 'grouped', got {self.attention!r}")
        for name in ("compute_eff", "memory_eff", "attn_eff", "elementwise_eff", "attn_memory_eff",
                     "gpu_memory_utilization"):
            v = getattr(self, name)
            if v is None and name == "attn_memory_eff":
                continue
            check_float(name, v, lo=0.0, hi=1.0, lo_open=True)
        # Times are added to the simulated clock every step: NaN would stop it (an endless run), inf or
        # a negative time would make every figure meaningless. An hour per step is beyond any machine.
        for name in ("op_launch_s", "elementwise_launch_s", "attn_group_s", "step_overhead_s",
                     "seq_overhead_s"):
            check_float(name, getattr(self, name), lo=0.0, hi=MAX_STEP_SECONDS, finite=True)
        check_float("host_bw", self.host_bw, lo=0.0, lo_open=True, finite=True)
        check_int("tp", self.tp, lo=1)
        check_int("dtype_bytes", self.dtype_bytes, lo=1, hi=8)
        if self.tp > 1 and not self.allreduce:
            raise InvalidArgument(f"tp={self.tp} needs an all-reduce table")

    # --- sizes --------------------------------------------------------------------------------------
    @property
    def peak_flops(self) -> float:
        """Peak FLOP/s of the whole tensor-parallel group (what compute utilisation divides by)."""
        return self.device.peak_flops * self.tp

    @property
    def weight_bytes(self) -> float:
        return self.model.num_params * self.dtype_bytes

    def kv_bytes_per_token(self) -> float:
        """K and V of one token, all layers, per device."""
        m = self.model
        return 2 * m.num_hidden_layers * (m.num_key_value_heads / self.tp) * m.head_dim * self.dtype_bytes

    def num_kv_blocks(self, block_size: int, activation_reserve: float = 0.05) -> int:
        """KV blocks that fit on each device after the weights (vLLM's gpu_memory_utilization rule)."""
        free = self.device.mem_bytes * (self.gpu_memory_utilization - activation_reserve) \
            - self.weight_bytes / self.tp
        if free <= 0:
            raise InvalidArgument(f"{self.name}: the weights do not fit on {self.tp} x {self.device.name}")
        return int(free // (block_size * self.kv_bytes_per_token()))

    # --- the cost -----------------------------------------------------------------------------------
    def _linear(self, m: int, k: float, n: float) -> float:
        if m == 0:
            return 0.0
        d = self.device
        f = 2.0 * m * k * n / (d.peak_flops * self.compute_eff)
        b = self.dtype_bytes * (k * n + m * k + m * n) / (d.mem_bw * self.memory_eff)
        return (max(f, b) if d.overlap else f + b) + self.op_launch_s

    def _allreduce(self, nbytes: float) -> float:
        pts = self.allreduce
        if self.tp == 1 or nbytes <= 0:
            return 0.0
        j = bisect.bisect_left(pts, nbytes, key=_first)      # O(log n): this runs every simulated step
        if j == 0:
            return pts[0][1]
        if j == len(pts):       # beyond the table: linear in bytes from the last point
            return pts[-1][1] * nbytes / pts[-1][0]
        (x0, y0), (x1, y1) = pts[j - 1], pts[j]
        w = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))

    def _attention(self, plan: StepPlan) -> tuple[float, float, int]:
        """(FLOPs, bytes, attention calls) of attention per layer per device."""
        m, t = self.model, self.tp
        qh, kvh, d, b = m.num_attention_heads / t, m.num_key_value_heads / t, m.head_dim, self.dtype_bytes
        if self.attention == "varlen":
            pairs = keys = 0                    # one pass over the rows (this runs every simulated step)
            for s in plan.seqs:
                n = len(s.token_ids)
                pairs += causal_pairs(s.start_pos, n)
                keys += s.start_pos + n         # its context length
            pairs += sum(n * (n + 1) // 2 for n in plan.padding)     # causal_pairs(0, n), inline
            keys += sum(plan.padding)
            return 4.0 * qh * d * pairs, 2.0 * kvh * d * b * keys, 1
        # grouped: decodes padded to the longest context, prompt chunks to the longest chunk and context,
        # padding rows attend to themselves (their own padded group): what ReferenceAttention computes
        flops = nbytes = 0.0
        dec = [s.context_len for s in plan.seqs if s.num_tokens == 1]
        pre = [s for s in plan.seqs if s.num_tokens > 1]
        groups = []
        if dec:
            groups.append((len(dec), 1, max(dec)))
        if pre:
            groups.append((len(pre), max(s.num_tokens for s in pre), max(s.context_len for s in pre)))
        if plan.padding:
            groups.append((len(plan.padding), max(plan.padding), max(plan.padding)))
        for g, lq, lk in groups:
            flops += 4.0 * qh * d * g * lq * lk
            nbytes += 2.0 * kvh * d * b * g * lk + g * lq * lk     # gathered K and V, the boolean mask
        return flops, nbytes, len(groups)

    def features(self, plan: StepPlan) -> dict[str, float]:
        """The raw work of one step per device: FLOPs and bytes by kind, operation and row counts."""
        m, t = self.model, self.tp
        h, i, d, L = m.hidden_size, m.intermediate_size, m.head_dim, m.num_hidden_layers
        tokens = plan.num_batched_tokens + plan.num_padding_tokens
        sampled = sum(1 for s in plan.seqs if s.sample)
        b = self.dtype_bytes
        lin_f = lin_b = 0.0
        n_ops = 0
        if tokens:
            for k, n in self._layer_shapes():
                lin_f += L * 2.0 * tokens * k * n
                lin_b += L * b * (k * n + tokens * k + tokens * n)
            n_ops += 4 * L
        if sampled:
            lin_f += 2.0 * sampled * h * m.vocab_size / t
            lin_b += b * (h * m.vocab_size / t + sampled * h + sampled * m.vocab_size / t)
            n_ops += 1
        af, ab, calls = self._attention(plan) if tokens else (0.0, 0.0, 0)
        eb = b * tokens * (10 * h + 4 * (m.num_attention_heads + m.num_key_value_heads) * d / t + 3 * i / t)
        return {"tokens": tokens, "rows": len(plan.seqs) + len(plan.padding), "sampled": sampled,
                "linear_flops": lin_f, "linear_bytes": lin_b, "linear_ops": n_ops,
                "attn_flops": L * af, "attn_bytes": L * ab, "attn_calls": L * calls,
                "elementwise_bytes": L * eb,
                "layers": L if tokens else 0, "copies": len(plan.swap_in) + len(plan.swap_out)}

    def _layer_shapes(self) -> tuple[tuple[float, float], ...]:
        """(K, N) of the per-device q/k/v, o, gate+up and down weights of one layer."""
        m, t = self.model, self.tp
        d = m.head_dim
        return ((m.hidden_size, (m.num_attention_heads + 2 * m.num_key_value_heads) * d / t),
                (m.num_attention_heads * d / t, m.hidden_size),
                (m.hidden_size, 2 * m.intermediate_size / t),
                (m.intermediate_size / t, m.hidden_size))

    def breakdown(self, plan: StepPlan) -> dict[str, float]:
        """Seconds per component of one step (their sum is ``step_time``)."""
        m, t, dv = self.model, self.tp, self.device
        h, L = m.hidden_size, m.num_hidden_layers
        tokens, sampled = _tokens_and_sampled(plan)
        out = dict.fromkeys(("linear", "lm_head", "attention", "elementwise", "allreduce", "swap",
                             "overhead"), 0.0)
        if tokens:
            out["linear"] = L * sum(self._linear(tokens, k, n) for k, n in self._layer_shapes())
            out["lm_head"] = self._linear(sampled, h, m.vocab_size / t)
            af, ab, calls = self._attention(plan)
            fa = af / (dv.peak_flops * self.attn_eff)
            ba = ab / (dv.mem_bw * (self.attn_memory_eff or self.memory_eff))
            out["attention"] = L * ((max(fa, ba) if dv.overlap else fa + ba) + calls * self.attn_group_s)
            eb = self.dtype_bytes * tokens * (10 * h + 4 * (m.num_attention_heads + m.num_key_value_heads)
                                              * m.head_dim / t + 3 * m.intermediate_size / t)
            out["elementwise"] = L * (eb / (dv.mem_bw * self.elementwise_eff) + self.elementwise_launch_s)
            out["allreduce"] = 2 * L * self._allreduce(tokens * h * self.dtype_bytes)
        copies = len(plan.swap_in) + len(plan.swap_out)
        if copies:
            out["swap"] = copies * plan.block_size * self.kv_bytes_per_token() / self.host_bw
        rows = len(plan.seqs) + len(plan.padding)
        if rows or copies:
            out["overhead"] = self.step_overhead_s + self.seq_overhead_s * rows
        return out

    def step_time(self, plan: StepPlan) -> float:
        return sum(self.breakdown(plan).values())

    def to_dict(self) -> dict:
        skip = ("model", "device", "allreduce")
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f not in skip}
        d["device"] = {f: getattr(self.device, f) for f in self.device.__dataclass_fields__}
        d["model_params"] = self.model.num_params
        d["allreduce_points"] = len(self.allreduce)
        return d


# --- calibration against the vidur profiles ------------------------------------------------------------
VIDUR_MLP = "profiles/vidur_a100_Meta-Llama-3-70B_mlp.csv"
VIDUR_ALLREDUCE = "profiles/vidur_a100_dgx_all_reduce.csv"
_LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
_ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")


@cache
def allreduce_table(num_workers: int) -> tuple[tuple[float, float], ...]:
    """(bytes, median seconds) of NCCL all-reduce on one A100 DGX node for ``num_workers`` GPUs
    (the median over ranks of vidur's per-rank medians)."""
    by: dict[int, list[float]] = {}
    with data_path(VIDUR_ALLREDUCE).open(newline="") as f:
        for r in csv.DictReader(f):
            if int(r["num_workers"]) == num_workers and int(r["devices_per_node"]) == num_workers:
                by.setdefault(int(r["size"]), []).append(float(r["time_stats.all_reduce.median"]) * 1e-3)
    if not by:
        raise InvalidArgument(f"no all-reduce profile for {num_workers} workers on one node (2, 4, 8)")
    pts = [(float(s), sorted(v)[len(v) // 2]) for s, v in sorted(by.items())]
    # small messages are latency-bound and noisy (2 KiB slower than 16 KiB): make the curve monotone by
    # taking, at each size, the fastest time measured at that size or any larger one
    best = math.inf
    for j in range(len(pts) - 1, -1, -1):
        best = min(best, pts[j][1])
        pts[j] = (pts[j][0], best)
    return tuple(pts)


def _first(point: tuple[float, float]) -> float:
    return point[0]


def _tokens_and_sampled(plan: StepPlan) -> tuple[int, int]:
    """Tokens computed (real and padding) and rows sampled by ``plan``, in one pass over its rows."""
    tokens = sampled = 0
    for s in plan.seqs:
        tokens += len(s.token_ids)
        sampled += s.sample
    return tokens + sum(plan.padding), sampled


def vidur_layer_timings() -> list[dict]:
    """vidur's LLaMA-3-70B layer profile as dicts: tp, tokens, and per-op median seconds."""
    out = []
    with data_path(VIDUR_MLP).open(newline="") as f:
        for r in csv.DictReader(f):
            row = {"tp": int(r["num_tensor_parallel_workers"]), "tokens": int(r["num_tokens"])}
            for op in _LINEAR_OPS + _ELEMENTWISE_OPS:
                row[op] = float(r[f"time_stats.{op}.median"]) * 1e-3
            out.append(row)
    return out


def _vidur_linear_shapes(tp: int) -> dict[str, tuple[float, float]]:
    m = LLAMA_3_70B
    d = m.head_dim
    return {"attn_pre_proj": (m.hidden_size, (m.num_attention_heads + 2 * m.num_key_value_heads) * d / tp),
            "attn_post_proj": (m.num_attention_heads * d / tp, m.hidden_size),
            "mlp_up_proj": (m.hidden_size, 2 * m.intermediate_size / tp),
            "mlp_down_proj": (m.intermediate_size / tp, m.hidden_size)}


def profile_errors(cost: CostModel) -> dict[str, float]:
    """Relative error of ``cost``'s linear-op and elementwise times against the vidur profile:
    median and 90th percentile of |predicted / measured - 1| over every (tp, tokens, op)."""
    from minicb.measure.metrics import percentile

    lin, elem = [], []
    for row in vidur_layer_timings():
        c = replace(cost, tp=row["tp"], allreduce=allreduce_table(row["tp"]) if row["tp"] > 1 else ())
        for op, (k, n) in _vidur_linear_shapes(row["tp"]).items():
            lin.append(abs(c._linear(row["tokens"], k, n) / row[op] - 1))
        plan_tokens = row["tokens"]
        m = LLAMA_3_70B
        eb = c.dtype_bytes * plan_tokens * (10 * m.hidden_size + 4 * (m.num_attention_heads
                                            + m.num_key_value_heads) * m.head_dim / c.tp
                                            + 3 * m.intermediate_size / c.tp)
        pred = eb / (c.device.mem_bw * c.elementwise_eff) + c.elementwise_launch_s
        elem.append(abs(pred / sum(row[op] for op in _ELEMENTWISE_OPS) - 1))
    return {"linear_median": percentile(lin, 50), "linear_p90": percentile(lin, 90),
            "elementwise_median": percentile(elem, 50), "elementwise_p90": percentile(elem, 90),
            "num_linear": len(lin)}


def fit_vidur_linear(device: Device = A100_80GB) -> dict[str, float]:
    """Grid-fit ``compute_eff``, ``memory_eff`` (step 0.01) and ``op_launch_s`` (0-40 us, step 1 us) to the
    profile's linear ops, minimising the mean |log(predicted / measured)|. Needs numpy; ~1 s."""
    import numpy as np

    fl, by, tm = [], [], []
    for row in vidur_layer_timings():
        for op, (k, n) in _vidur_linear_shapes(row["tp"]).items():
            m = row["tokens"]
            fl.append(2.0 * m * k * n)
            by.append(2.0 * (k * n + m * k + m * n))
            tm.append(row[op])
    f, b, t = np.array(fl), np.array(by), np.array(tm)
    best = (math.inf, 0.0, 0.0, 0.0)
    for ce in np.arange(0.50, 1.0001, 0.01):
        cf = f / (device.peak_flops * ce)
        for me in np.arange(0.40, 1.0001, 0.01):
            base = np.maximum(cf, b / (device.mem_bw * me))
            for launch in np.arange(0.0, 40e-6, 1e-6):
                err = float(np.mean(np.abs(np.log((base + launch) / t))))
                if err < best[0]:
                    best = (err, float(ce), float(me), float(launch))
    return {"mean_abs_log_error": best[0], "compute_eff": round(best[1], 2), "memory_eff": round(best[2], 2),
            "op_launch_s": round(best[3], 7)}


# --- presets -------------------------------------------------------------------------------------------
PRESETS = ("llama-3-70b", "llama-3-8b", "smollm2-135m")
SMOLLM2_CALIBRATION = "calibration/smollm2_cpu.json"


# What a calibration file must hold (bench/calibrate_cpu.py writes them all) and what it may hold.
CALIBRATION_KEYS = ("ceiling_gflops", "mem_bw_gbs", "compute_eff", "memory_eff", "attn_eff",
                    "step_overhead_s", "seq_overhead_s")
CALIBRATION_OPTIONAL = ("mem_bytes", "attn_memory_eff", "elementwise_eff", "op_launch_s",
                        "elementwise_launch_s", "attn_group_s")


def load_calibration(path=None) -> dict:
    """The smollm2-135m CPU calibration (``bench/calibrate_cpu.py`` writes it); the shipped one by default.

    A missing, unreadable or malformed file is an ``InvalidArgument`` naming the file and what is
    wrong (not a ``FileNotFoundError``, a ``KeyError`` or "Expecting value: line 1 column 1")."""
    if path is None:
        with data_path(SMOLLM2_CALIBRATION).open() as f:
            return json.load(f)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise InvalidArgument(f"cannot read the calibration file {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:      # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidArgument(f"the calibration file {path} is not JSON: {' '.join(str(e).split())[:200]}"
                              ) from None
    return check_calibration(data, str(path))


def check_calibration(data, source: str = "calibration") -> dict:
    """``data`` if it is a calibration: a JSON object with every key of ``CALIBRATION_KEYS`` (and any
    of ``CALIBRATION_OPTIONAL``) a finite number; else ``InvalidArgument`` naming the key."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: a calibration must be a JSON object, got {type(data).__name__}")
    missing = [k for k in CALIBRATION_KEYS if k not in data]
    if missing:
        raise InvalidArgument(f"{source}: the calibration lacks {', '.join(missing)} (bench/calibrate_cpu.py "
                              "writes every key)")
    for key in CALIBRATION_KEYS + tuple(k for k in CALIBRATION_OPTIONAL if k in data):
        if not (key == "attn_memory_eff" and data[key] is None):
            check_float(f"{source}: {key}", data[key], lo=0.0, finite=True)
    return data


def preset(name: str, calibration: dict | None = None, **overrides) -> CostModel:
    """A named cost model: ``llama-3-70b`` (8 x A100-80GB, tp 8), ``llama-3-8b`` (1 x A100-80GB) or
    ``smollm2-135m`` (this CPU, float32, one thread, minicb's reference attention)."""
    if name == "llama-3-70b":
        cm = CostModel("llama-3-70b", LLAMA_3_70B, A100_80GB, tp=8, allreduce=allreduce_table(8),
                       description="LLaMA-3-70B, bf16, 8 x A100-SXM4-80GB (NVLink DGX), tensor parallel 8")
    elif name == "llama-3-8b":
        cm = CostModel("llama-3-8b", LLAMA_3_8B, A100_80GB, tp=1,
                       description="LLaMA-3-8B, bf16, 1 x A100-SXM4-80GB")
    elif name == "smollm2-135m":
        cal = calibration if calibration is not None else load_calibration()
        dev = Device("cpu", peak_flops=cal["ceiling_gflops"] * 1e9, mem_bw=cal["mem_bw_gbs"] * 1e9,
                     mem_bytes=cal.get("mem_bytes", 8e9), overlap=False)
        cm = CostModel("smollm2-135m", SMOLLM2_135M, dev, tp=1, dtype_bytes=4,
                       compute_eff=cal["compute_eff"], memory_eff=cal["memory_eff"], attn_eff=cal["attn_eff"],
                       attn_memory_eff=cal.get("attn_memory_eff"),
                       elementwise_eff=cal.get("elementwise_eff", 1.0),
                       op_launch_s=cal.get("op_launch_s", 0.0),
                       elementwise_launch_s=cal.get("elementwise_launch_s", 0.0),
                       attn_group_s=cal.get("attn_group_s", 0.0),
                       step_overhead_s=cal["step_overhead_s"], seq_overhead_s=cal["seq_overhead_s"],
                       attention="grouped",
                       description=f"SmolLM2-135M, float32, {cal.get('machine', 'this CPU')}")
    else:
        raise InvalidArgument(f"preset must be one of {PRESETS}, got {name!r}")
    return replace(cm, **overrides) if overrides else cm


FINAL_ONLY = RequestOutputKind.FINAL_ONLY   # the simulator reads each request's final output only


# --- the simulation ------------------------------------------------------------------------------------
@dataclass(slots=True)
class SimResult:
    label: str
    config: SchedulerConfig
    requests: list[RequestRecord]
    steps: list[StepRecord]
    summary: Summary
    breakdown: dict[str, float] = field(default_factory=dict)   # seconds per cost component, summed


class SimRunner:
    """The engine's runner with a clock instead of a model (``minicb.engine.interface.Runner``).

    ``run(plan)`` advances the simulated clock ``now`` by ``step_time(plan)`` and gives every row
    that samples the dummy token ``token``. The engine reads the same clock (``clock``), so arrivals,
    token times and finishes are stamped in simulated seconds. Any token id is a valid prompt token
    and no token ends a request by itself (``eos_token_id`` is None): requests end at ``max_tokens``.
    """

    eos_token_id = None
    failure = None

    def __init__(self, step_time: Callable[[StepPlan], float], *, token: int = 1, start: float = 0.0,
                 vocab_size: int = sys.maxsize) -> None:
        self.now = start
        self.vocab_size = vocab_size
        self._step_time = step_time
        self._token = token
        self._logprobs: set[str] = set()     # registered sequences that ask for logprobs of any kind

    def clock(self) -> float:
        return self.now

    def run(self, plan: StepPlan, params=None) -> dict[str, int | RowOutput]:
        """Advance the clock; every sampled row gets the dummy token. Logprobs, where asked for, are
        those of a model certain of every token it sees: logprob 0, rank 1."""
        self.now += self._step_time(plan)
        token = self._token
        out: dict[str, int | RowOutput] = {}
        for s in plan.seqs:
            if s.sample:
                out[s.request_id] = token
                for r in s.forks:
                    out[r] = token
        if not self._logprobs:          # nobody registered asks for logprobs: the tokens are all
            return out
        for s in plan.seqs:
            for r in (s.request_id, *s.forks) if s.sample else (s.request_id,):
                p = params.get(r) if params else None
                targets = s.prompt_targets if r == s.request_id else ()     # the row's own request's
                if p is None or (p.logprobs is None and not targets):
                    continue
                lp = _certain(self._token, p.logprobs) if s.sample and p.logprobs is not None else None
                prompt = tuple(_certain(t, p.prompt_logprobs or 0) for t in targets)
                out[r] = RowOutput(out.get(r), lp, prompt, s.start_pos + 1)
        return out

    def register(self, request_id: str, params: SamplingParams, prompt_token_ids=(), *,
                 eos_token_id: int | None = None, tokenizer=None) -> None:
        """Every sampled token is the dummy one: only whether it asks for logprobs is kept."""
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self._logprobs.add(request_id)

    def release(self, request_id: str) -> None:
        self._logprobs.discard(request_id)

    def close(self) -> None:
        """Nothing to release."""


def _certain(token: int, k: int) -> TokenLogprobs:
    """The logprobs of a token that had probability 1 (the simulator's model is never in doubt)."""
    return TokenLogprobs(token, 0.0, 1, (token,) if k else (), (0.0,) if k else ())


class SimulatedEngine(LLMEngine):
    """``LLMEngine`` over a ``SimRunner``: the engine's own loop, scheduler, request API and step events
    (``listen``), with a simulated clock that jumps by ``step_time(plan)`` every step and the dummy token
    ``token`` for every sampled row. ``advance_to(t)`` idles until ``t``, so
    ``minicb.engine.arrivals.drive(engine, arrivals, now=lambda: engine.now, wait=engine.advance_to)``
    serves it on simulated time; no torch anywhere."""

    def __init__(self, config: SchedulerConfig, step_time: Callable[[StepPlan], float], *,
                 token: int = 1, start: float = 0.0) -> None:
        runner = SimRunner(step_time, token=token, start=start)
        super().__init__(runner, config, clock=runner.clock)

    def _interruptible(self):
        """No window in which Ctrl-C acts at once: a simulated step takes microseconds, so a Ctrl-C
        waits for the step's end (``LLMEngine``'s safe point), and no step pays for two handler swaps."""
        return contextlib.nullcontext()

    @property
    def now(self) -> float:
        """The simulated clock (seconds, or whatever unit ``step_time`` returns)."""
        return self.runner.now

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` (the simulated clock jumps; it never goes back)."""
        self.runner.now = max(self.runner.now, t)


def simulate(requests: Sequence[Request], config: SchedulerConfig, cost: CostModel, *, label: str = "",
             on_step: Callable[[StepRecord, int], None] | None = None,
             max_steps: int = 50_000_000) -> SimResult:
    """Run ``requests`` through a ``SimulatedEngine`` (the engine's ``Scheduler``) on the clock of ``cost``.

    Every request produces exactly ``output_len`` tokens (EOS ignored), as in ``minicb bench``.
    ``on_step(record, num_finished)`` is called after every step (progress displays).
    """
    totals = dict.fromkeys(("linear", "lm_head", "attention", "elementwise", "allreduce", "swap", "overhead"),
                           0.0)

    rec = StepRecorder(cost.model)

    def step_time(plan: StepPlan) -> float:
        # Called between planning and recording (``SimRunner.run``): the slots and blocks held now are
        # the planned step's, what a ``StepEvent``'s ``state`` snapshot would say. Read as two counts,
        # so that no step listener makes the engine copy every block table twice a step.
        start, (held, used) = engine.now, engine.occupancy()
        end = start
        try:
            parts = cost.breakdown(plan)
            for key, v in parts.items():
                totals[key] += v
            t = sum(parts.values())
            end = start + t
            return t
        finally:                        # recorded like a StepEvent would be, a failed step too
            if plan.seqs or plan.padding:
                rec.record(plan, start, end, held, used)

    engine = SimulatedEngine(config, step_time)
    n_done = 0

    def after_step(outs) -> None:
        nonlocal n_done
        n_done += sum(1 for o in outs if o.finished)
        if engine.stats.num_steps > max_steps:
            raise RuntimeError(f"simulation exceeded max_steps={max_steps}")
        if on_step is not None and not engine.last_plan.is_empty:
            on_step(rec.steps[-1], n_done)

    # a distinct first token per request: no two prompts share a prefix (the prefix cache finds
    # nothing, as with the random prompts of minicb bench)
    order = sorted(requests, key=lambda r: r.arrival)
    arrivals = [Arrival(r.arrival, r.request_id, [k + 2] + [1] * (r.prompt_len - 1),
                        SamplingParams(max_tokens=r.output_len, ignore_eos=True, output_kind=FINAL_ONLY))
                for k, r in enumerate(order)]
    try:
        done = drive(engine, arrivals, now=lambda: engine.now, wait=engine.advance_to, on_step=after_step)
    except NoProgress as exc:
        raise RuntimeError(f"{label or config.policy}: {exc}") from None
    final = {o.request_id: o for o in done}
    records = [RequestRecord.from_output(final[a.request_id]) for a in arrivals]    # in arrival order
    summary = summarize(records, rec.steps, label=label or config.policy, num_slots=config.max_num_seqs,
                        num_blocks=config.num_blocks, peak_flops=cost.peak_flops,
                        num_preemptions=engine.stats.num_preemptions)
    return SimResult(label or config.policy, config, records, rec.steps, summary, totals)
