"""The benchmark plots (PNG through matplotlib, an optional dependency: ``pip install 'minicb[plots]'``).

* ``throughput_bars``: output tokens/s per policy, compute utilisation written on each bar;
* ``latency_cdfs``: empirical CDFs of queueing delay, time to first token and inter-token latency;
* ``occupancy_timeline``: the fraction of slots computing real tokens at every step, over time;
* ``throughput_latency_curve``: for each policy, (throughput, P99 latency) at several arrival rates.

Each function takes ``Summary`` / ``RequestRecord`` / ``StepRecord`` values and a path, and returns the
path. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from minicb.core.errors import MinicbError
from minicb.measure.metrics import RequestRecord, StepRecord, Summary

COLOURS = {"static": "#c0504d", "dynamic": "#f79646", "continuous": "#4f81bd"}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MinicbError("plots need matplotlib, which is not installed: pip install 'minicb[plots]' "
                          "(or pass --no-plots)") from None
    from minicb.measure.trace import READABLE_RC

    matplotlib.rcParams.update(READABLE_RC)     # the docs' pictures' text sizes (trace.save_readable)
    return plt


def _colour(label: str) -> str | None:
    return next((c for k, c in COLOURS.items() if label.startswith(k)), None)


def _save(fig, path: str) -> str:
    from minicb.measure.trace import save_readable

    fig.tight_layout()
    svg = str(path).lower().endswith(".svg")
    save_readable(fig, path, dpi=110, metadata={"Date": None} if svg else {"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def throughput_bars(summaries: Sequence[Summary], path: str, title: str = "") -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(summaries), 3.6))
    xs = range(len(summaries))
    vals = [s.output_tokens_per_s for s in summaries]
    bars = ax.bar(xs, vals, color=[_colour(s.label) or "#888888" for s in summaries])
    for b, s in zip(bars, summaries):
        util = "" if s.compute_utilisation is None else f"\nutil {100 * s.compute_utilisation:.1f}%"
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{s.output_tokens_per_s:,.1f}{util}",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [s.label for s in summaries])
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(0, max(vals + [1e-9]) * 1.25)
    ax.set_title(title or "throughput", fontsize=10)
    return _save(fig, path)


def _cdf(ax, values: Sequence[float], label: str, scale: float = 1e3) -> None:
    xs = sorted(v * scale for v in values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label, color=_colour(label))


def latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: str, title: str = "") -> str:
    """``runs``: label -> request records."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for label, reqs in runs.items():
        _cdf(axes[0], [r.queueing_delay for r in reqs if r.queueing_delay is not None], label)
        _cdf(axes[1], [r.ttft for r in reqs if r.ttft is not None], label)
        _cdf(axes[2], [g for r in reqs for g in r.inter_token_latencies], label)
    for ax, name in zip(axes, ("queueing delay", "time to first token", "inter-token latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("tokens" if name.startswith("inter") else "requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if name != "inter-token latency":
            ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(left=0)
    axes[0].legend(fontsize=9, loc="lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def occupancy_timeline(runs: Mapping[str, Sequence[StepRecord]], num_slots: int, path: str,
                       title: str = "") -> str:
    """``runs``: label -> step records; time starts at each run's first step."""
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 1.5 * len(runs)), sharex=True, squeeze=False)
    for ax, (label, steps) in zip(axes[:, 0], runs.items()):
        if steps:
            xs, busy, held = _rectangles(steps, num_slots)
            ax.fill_between(xs, held, color="#dddddd", linewidth=0, label="held (incl. padding rows)")
            ax.fill_between(xs, busy, color=_colour(label) or "#888888", linewidth=0, alpha=0.9,
                            label="computing real tokens")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=9, loc="upper right")
    axes[-1, 0].set_xlabel("time since the first step (s)")
    fig.suptitle(title or f"slot occupancy ({num_slots} slots)", fontsize=10)
    return _save(fig, path)


def _rectangles(steps: Sequence[StepRecord], num_slots: int):
    """Step outlines: a step lasts until the next one starts unless the gap is longer than the step
    itself (idle, or a static batch filling up), which reads as zero."""
    t0 = steps[0].start
    xs: list[float] = []
    busy: list[float] = []
    held: list[float] = []
    for j, s in enumerate(steps):
        nxt = steps[j + 1].start if j + 1 < len(steps) else s.end
        gap = nxt - s.end
        end = nxt if gap <= max(s.duration, 0.0) else s.end
        b, h = s.num_seqs / num_slots, s.num_slots_held / num_slots
        xs += [s.start - t0, s.start - t0, end - t0, end - t0]
        busy += [0.0, b, b, 0.0]
        held += [0.0, h, h, 0.0]
    return xs, busy, held


def throughput_latency_curve(points: Mapping[str, Sequence[Summary]], path: str, title: str = "") -> str:
    """``points``: policy -> summaries at increasing arrival rates; P99 ITL and P99 TTFT against
    throughput."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, ss in points.items():
        xs = [s.output_tokens_per_s for s in ss]
        for ax, field in zip(axes, ("itl_p99", "ttft_p99")):
            ys = [getattr(s, field) for s in ss]
            ax.plot(xs, [None if y is None else y * 1e3 for y in ys], marker="o", label=label,
                    color=_colour(label))
    for ax, name in zip(axes, ("P99 inter-token latency (ms)", "P99 time to first token (ms)")):
        ax.set_xlabel("throughput (output tokens / s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
