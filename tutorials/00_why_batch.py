"""Chapter 00: why batch at all.

Run: python tutorials/00_why_batch.py
Prerequisites: none; you know what a transformer's forward pass computes.

Generating one token of one request reads every weight of the model once and
does about two floating-point operations per weight: far too little arithmetic
for the bytes it moves. A decode step is bound by memory, not by compute, so a
step that serves 16 requests costs hardly more than a step that serves one. This
chapter works that out for SmolLM2-135M (the model minicb serves), measures it
on this CPU, reads it from an A100's profile, and draws the roofline the
numbers sit on. Then the first fix, a static batch, and the waste that chapter
01 starts from.
"""

# %% [markdown]
# ## 1. One request's KV cache
#
# Every layer keeps, for every token already seen, its key and its value: one
# vector of `head_dim` numbers per KV head. So one token of context costs
# `layers x 2 (K and V) x kv_heads x head_dim x bytes per number`, and a
# request holds that for every token of its prompt and its output so far.

# %%
import contextlib
import platform
import sys
import time

from _common import Exercise, flags, median, noise

from minicb.core.config import ModelConfig
from minicb.core.errors import ModelLoadError
from minicb.core.sampling_params import SamplingParams
from minicb.measure.workloads import trace_lengths
from minicb.simulate import simulator

args = flags(__doc__, steps=(5, "decode steps timed per batch size"),
             repeats=(3, "runs of each batch size (the median is shown)"),
             context=(512, "tokens of context per request in section 2"),
             figure=("", "write the roofline picture to this file (.svg)"))
BATCHES = [1, 4, 16, 64]
# lines whose numbers are measured on the machine that runs the chapter (the
# page generator's tests compare them with their digits masked)
MEASURED = (r"^(measured here: |spread between runs: "
            r"| +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$)")
NOISY = 0.25      # repeats further apart than this: the CPU column is noise
# SmolLM2-135M's shape (its GGUF's metadata), for when the model is missing
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64)
try:
    import torch

    from minicb.entrypoints.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(max_num_seqs=max(BATCHES), max_num_batched_tokens=1024,
              block_size=16, num_blocks=256)
    cfg = llm.engine.runner.model.config
except ModelLoadError as e:
    print(f"(SmolLM2 is not available: {e}; nothing is measured)")
    llm, cfg = None, SMOLLM2

L, KV, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
for dtype, size in (("float32", 4), ("bfloat16", 2)):
    per_token = L * 2 * KV * D * size
    print(f"{dtype:>8}: {L} layers x 2 x {KV} kv heads x {D} x {size} B = "
          f"{per_token:,} B a token")
KV_BYTES = L * 2 * KV * D * 2                     # bfloat16, as served on a GPU
print(f"a 2,048-token conversation: {2048 * KV_BYTES / 2**20:.0f} MiB of KV "
      "(bfloat16)")

# %% [markdown]
# ## 2. Bytes moved and FLOPs, per decode step
#
# A decode step of a batch of `B` requests multiplies `B` rows by every weight
# matrix: `2 x params x B` FLOPs. It reads each weight once, whatever `B` is,
# plus each request's KV cache. Their ratio, FLOPs per byte, is the step's
# *arithmetic intensity*; an A100 needs about 153 FLOPs per byte (312 TFLOP/s
# of bfloat16 over 2.04 TB/s) before compute, not memory, is what it waits for.

# %%
A100 = simulator.A100_80GB
RIDGE = A100.peak_flops / A100.mem_bw
params, context = cfg.num_params, args.context
weight_bytes = 2 * params                         # bfloat16
print(f"SmolLM2: {params / 1e6:.1f} M parameters, "
      f"{weight_bytes / 2**20:.0f} MiB in bfloat16;")
print(f"each request {context} tokens into its conversation")
print(f"A100 ridge point: {RIDGE:.0f} FLOPs per byte")
print(f"{'batch':>5} {'GFLOP':>7} {'MiB read':>9} {'FLOP/B':>7}")
for b in BATCHES + [256]:
    flops = b * cfg.flops_per_token(context)
    moved = weight_bytes + b * context * KV_BYTES
    print(f"{b:>5} {flops / 1e9:>7.2f} {moved / 2**20:>9.0f} "
          f"{flops / moved:>7.1f}")

# %% [markdown]
# At batch 1 the step does about one FLOP per byte, a hundred times below the
# ridge: the arithmetic units wait on memory. Each extra request adds its
# FLOPs almost for free. Intensity stops growing once the KV caches, read once
# per request, outweigh the weights: that is why the KV cache's size (section
# 1), not the FLOPs, limits how large a batch can get.
#
# ## 3. Step time against batch size, measured
#
# The same step on this CPU: `B` requests with 8-token prompts, then the time
# of whole decode steps (each row one token), the fastest of a few. Each batch
# size is run `--repeats` times (3) and the median shown; the spread between
# the runs says how much to trust it. Over 25% (or a larger batch faster than
# batch 1) the machine was busy with something else, and the chapter prints a
# warning that the CPU column is too noisy to read. The A100 numbers are
# microsoft/vidur's profile of one LLaMA-3-70B layer's four matmuls
# (`minicb/data/profiles`, the file the simulator is calibrated on).

# %%
def decode_step_ms(batch: int, run: int = 0) -> float:
    """Wall time of a decode step of ``batch`` requests on SmolLM2: the fastest
    of a few (on a shared machine the slower ones measure the neighbours)."""
    eng, times = llm.engine, []
    for k in range(batch):
        eng.add_request(f"b{batch}.{run}.{k}",
                        [1 + k % 50 + j for j in range(8)],
                        SamplingParams(max_tokens=args.steps + 2,
                                       ignore_eos=True))
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        plan = eng.last_plan
        if len(plan.seqs) == batch and all(s.num_tokens == 1 and s.start_pos > 8
                                           for s in plan.seqs):
            times.append(dt)       # a pure decode step, not the first one
    return 1000 * min(times)


CPU = platform.processor() or platform.machine()
with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
    CPU = next((ln.split(":", 1)[1].strip() for ln in f
                if ln.startswith("model name")), CPU)
if llm:
    decode_step_ms(BATCHES[-1], -1)  # warm up: kernels compile on first use
runs = {b: [decode_step_ms(b, r) for r in range(args.repeats)]
        for b in BATCHES} if llm else {}
cpu_ms = {b: median(t) for b, t in runs.items()}
vidur = {r["tokens"]: sum(r[op] for op in simulator._LINEAR_OPS)
         for r in simulator.vidur_layer_timings() if r["tp"] == 1}
a100_ms = {b: 1000 * vidur[b] for b in BATCHES}
print(f"measured here: {CPU}, 1 torch thread")
print(f"{'batch':>5} {'CPU ms/step':>12} {'x batch 1':>9} "
      f"{'A100 ms/layer':>14} {'x batch 1':>9}")
for b in BATCHES:
    cpu = (f"{cpu_ms[b]:>12.1f} {cpu_ms[b] / cpu_ms[1]:>9.2f}" if cpu_ms
           else f"{'-':>12} {'-':>9}")
    print(f"{b:>5} {cpu} {a100_ms[b]:>14.3f} {a100_ms[b] / a100_ms[1]:>9.2f}")
if runs:
    spreads = [f"{max(t) / min(t) - 1:.0%}" for t in runs.values()]
    print(f"spread between runs: {args.repeats} of each, max/min - 1: "
          + ", ".join(spreads))
    # the verdict goes to stderr: the page shows stdout, whose words must not
    # change from run to run
    why = noise(runs, NOISY)
    if why:
        print("warning: this run is too noisy to read (" + "; ".join(why)
              + "): the machine was busy; rerun it on a quiet one",
              file=sys.stderr)

# %% [markdown]
# On the A100 a step of 64 requests costs about what a step of one does: the
# weights are read once either way. On a CPU the ridge is far lower (a few
# cores do less arithmetic per byte of memory bandwidth), so time grows
# sooner, but still much less than 64-fold. Either way, tokens per second grow
# with the batch. (The CPU column is measured on whatever machine runs the
# chapter, shared or not: the spread line says how far its runs were apart,
# and a warning says when they were too far apart to read; the page's run is
# the one its picture shows.)
#
# ## 4. The roofline
#
# The A100's profile at every batch size it covers, as achieved TFLOP/s
# against arithmetic intensity (a layer's matmul FLOPs over the bytes of its
# weights and activations in bfloat16). The roof is the lesser of the peak
# compute and bandwidth x intensity. Small batches sit on the sloped part,
# memory-bound; from a few hundred tokens a step the matmuls reach the flat
# part. `--figure roofline.svg` writes the picture.
#
# ![the roofline of an A100, with vidur's measured LLaMA-3-70B matmuls on
# it](../images/roofline.svg)

# %%
shapes = simulator._vidur_linear_shapes(1)
POINTS = []                      # (tokens, FLOPs per byte, achieved TFLOP/s)
for n in sorted(vidur):
    flops = sum(2 * n * k * m for k, m in shapes.values())
    moved = sum(2 * (k * m + n * (k + m)) for k, m in shapes.values())
    POINTS.append((n, flops / moved, flops / vidur[n] / 1e12))
for n, inten, tflops in POINTS:
    if n in (1, 16, 64, 256, 1024, 4096):
        print(f"{n:>5} tokens: {inten:>6.1f} FLOP/B, {tflops:>5.1f} TFLOP/s "
              f"({100 * tflops * 1e12 / A100.peak_flops:.0f}% of peak)")

if args.figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    # text stays text (svg.fonttype none), plain tick labels (no mathtext
    # superscripts), at most 680 px wide: shown at its own size on the page
    plt.rcParams.update({"font.size": 12, "svg.fonttype": "none"})
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(6.6, 7.4))
    xs = [2 ** (i / 4) for i in range(-4, 60)]
    ax.plot(xs, [min(A100.peak_flops, A100.mem_bw * x) / 1e12 for x in xs],
            color="#333", label="roof: min(peak, bandwidth x intensity)")
    ax.scatter([p[1] for p in POINTS], [p[2] for p in POINTS], s=14,
               color="#1f5fbf", label="vidur: LLaMA-3-70B layer matmuls")
    for n, inten, tflops in POINTS:
        if n in (1, 16, 4096):
            ax.annotate(f"{n} tok", (inten, tflops), textcoords="offset points",
                        xytext=(6, -14))
    ax.axvline(RIDGE, color="#999", linestyle=":")
    ax.text(RIDGE / 1.3, 1.0, f"ridge {RIDGE:.0f}", color="#444", ha="right")
    ax.set(xscale="log", yscale="log", xlabel="FLOPs per byte",
           ylabel="TFLOP/s", title="A100 roofline, bfloat16")
    ax.legend(loc="lower right", fontsize=11, labels=["roof", "vidur, 70B"])
    bx.plot(BATCHES, [a100_ms[b] / a100_ms[1] for b in BATCHES], "o-",
            color="#1f5fbf", label="A100 (vidur profile)")
    if cpu_ms:
        bx.plot(BATCHES, [cpu_ms[b] / cpu_ms[1] for b in BATCHES], "s-",
                color="#b3470b", label="this CPU, SmolLM2")
    bx.plot(BATCHES, BATCHES, "--", color="#999", label="time x batch")
    bx.set(xscale="log", yscale="log", xlabel="requests in the decode step",
           ylabel="step time / batch 1's",
           title="decode step time")
    bx.set_xticks(BATCHES, [str(b) for b in BATCHES])
    bx.legend(loc="upper left", fontsize=11, frameon=False)
    for axis in (ax.xaxis, ax.yaxis, bx.xaxis, bx.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    bx.set_xticks(BATCHES, [str(b) for b in BATCHES])
    fig.tight_layout()
    fig.savefig(args.figure, metadata={"Date": None} if
                args.figure.endswith(".svg") else None)

# %% [markdown]
# ## 5. The first fix, a static batch, and its limit
#
# So run requests together. The simplest way is a *static* batch: take `B`
# requests, run them as one until the longest is done. But requests end at
# different lengths, and a finished row keeps computing padding until the
# batch ends. Here are real output lengths (ShareGPT conversations, the vLLM
# paper's trace), cut into static batches in arrival order:

# %%
outputs = [o for p, o in trace_lengths("sharegpt")
           if p >= 4 and o >= 4 and p + o <= 2048][:4096]
for b in (1, 8, 32, 128):
    batches = [outputs[i:i + b] for i in range(0, len(outputs), b)]
    slots = sum(len(g) * max(g) for g in batches)
    print(f"batch {b:>3}: {100 * (1 - sum(outputs) / slots):4.1f}% of decode "
          "rows are padding")

# %% [markdown]
# The larger the batch, the likelier one long request holds all the others:
# the bigger batches that section 3 says are nearly free are exactly the ones
# a static batch wastes most. And requests that arrive meanwhile wait outside
# for the whole batch. Chapter 01 measures that padding with minicb's padded
# baseline; chapters 03 and 05 fix it by refilling a finished request's slot
# at the very next step: continuous batching.
#
# The roofline is Williams, Waterman and Patterson's model (CACM, 2009); the
# [reading list](../reading.md) has it beside the serving papers, each with
# the chapter that builds it.

# %%
EXERCISES = [
    Exercise(
        "--context 2048",
        "With 2,048 tokens of context per request instead of 512, how far "
        "does batching raise the decode step's FLOPs per byte?",
        r"^ +(1|64|256) +[\d.]+ +\d+ +[\d.]+$",
        "Less far: every request's KV cache is read once per step, so a long "
        "context adds bytes as fast as a request adds FLOPs, and intensity "
        "levels off at a smaller batch. Long contexts make decode more "
        "memory-bound, not less."),
]
