"""PNG figure of a queue-wait report: wait distributions per node bucket (+ the projection).

Uses matplotlib's object API with the Agg canvas, never pyplot, so no global backend is set
and nothing opens a window.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.queuewait.stats import Bucket, waits_by_bucket
from orchestrator.queuewait.waits import QueueWaitError, WaitData

log = logging.getLogger(__name__)

# log-axis ticks a reader thinks in
_TICKS = [(1, "1 s"), (10, "10 s"), (60, "1 min"), (600, "10 min"), (3600, "1 h"), (6 * 3600, "6 h"),
          (86400, "1 day"), (7 * 86400, "1 week")]
_FLOOR_S = 1.0  # waits below this are drawn at it: a log axis has no zero


def _time_axis(axis: Any, lo: float, hi: float) -> None:
    ticks = [(v, t) for v, t in _TICKS if lo / 3 <= v <= hi * 3] or _TICKS[:3]
    axis.set_ticks([v for v, _ in ticks], [t for _, t in ticks])


def _wait_panel(ax: Any, data: WaitData, buckets: Sequence[Bucket], report: dict[str, Any]) -> None:
    groups = [np.maximum(w, _FLOOR_S) for w in waits_by_bucket(data.jobs, buckets)]
    shown = [(b, g, s) for b, g, s in zip(buckets, groups, report["buckets"]) if g.size]
    positions = np.arange(1, len(shown) + 1)
    ax.boxplot([g for _, g, _ in shown], positions=positions, whis=(5, 95), showfliers=False,
               medianprops={"color": "black", "linewidth": 2})
    for x, (_, g, s) in zip(positions, shown):
        ax.plot(x, max(s["mean_wait_s"], _FLOOR_S), marker="o", color="tab:red", linestyle="none")
        if s["per_day_median_wait_s"] is not None:
            ax.plot(x + 0.3, max(s["per_day_median_wait_s"], _FLOOR_S), marker="D", color="tab:blue", linestyle="none")
        ax.annotate(f"n={g.size}\nmedian {_short(s['median_wait_s'])}", (x, float(np.percentile(g, 95)) * 1.4),
                    ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    top = max(float(np.percentile(g, 95)) for _, g, _ in shown) * 20
    ax.set_ylim(_FLOOR_S * 0.7, top)
    _time_axis(ax.yaxis, _FLOOR_S, top)
    ax.set_xticks(positions, [f"{b.label} node{'s' if b.label != '1' else ''}" for b, _, _ in shown])
    ax.set_ylabel("queue wait (submit to start), log scale")
    ax.set_title(f"Queue wait by job size: {data.source}\n"
                 f"{len(data.jobs)} jobs, {data.n_skipped} skipped; box 25-75%, whiskers 5-95%, "
                 f"waits under {_FLOOR_S:g} s drawn at {_FLOOR_S:g} s",
                 fontsize=10)
    ax.plot([], [], marker="o", color="tab:red", linestyle="none", label="mean")
    ax.plot([], [], marker="D", color="tab:blue", linestyle="none", label="mean of per-day medians")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def _projection_panel(ax: Any, projection: dict[str, Any]) -> None:
    models = projection["models"]
    y = np.arange(len(models))[::-1]
    hours = np.array([m["median_s"] for m in models]) / 3600
    p10 = np.array([m["p10_s"] for m in models]) / 3600
    p90 = np.array([m["p90_s"] for m in models]) / 3600
    compute_h = projection["compute_s"] / 3600
    log_x = p90.max() > 5 * hours.min()  # one model far slower: a linear axis would hide the others
    left = compute_h / 4 if log_x else 0.0
    ax.barh(y, hours - left, left=left, color=["tab:gray", "tab:orange", "tab:green", "tab:olive"][: len(models)], height=0.6)
    ax.errorbar(hours, y, xerr=[hours - p10, p90 - hours], fmt="none", ecolor="black", capsize=4)
    for yi, h, q in zip(y, hours, p90):
        ax.text(q * 1.08 if log_x else q + 0.01 * p90.max(), yi, f"{_short(h * 3600)} (p90 {_short(q * 3600)})", va="center", fontsize=8)
    ax.axvline(compute_h, color="black", linestyle="--", linewidth=1)
    ax.text(compute_h, y.max() + 0.45, " compute only", fontsize=8, va="bottom")
    ax.set_yticks(y, [m["label"] for m in models], fontsize=9)
    if log_x:
        ax.set_xscale("log")
        ax.set_xlim(left, p90.max() * 15)
    else:
        ax.set_xlim(0, p90.max() * 1.35)
    ax.set_ylim(-0.6, len(models) - 0.2)
    ax.set_xlabel(f"projected end-to-end time, hours{', log scale' if log_x else ''} (bar: median, whiskers: p10-p90)")
    ax.set_title(f"{projection['rounds']} rounds x {projection['round_seconds']:g} s, "
                 f"{projection['workers']} workers; job time limit {projection['job_time_limit_s'] / 3600:g} h "
                 f"({projection['lifetime_rounds']} rounds per job lifetime)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def write_plot(path: str | Path, data: WaitData, buckets: Sequence[Bucket], report: dict[str, Any]) -> Path:
    """Write the figure; a second panel when `report` has a "projection"."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not data.jobs or not any(b["jobs"] for b in report["buckets"]):
        raise QueueWaitError(f"nothing to plot: no job of {data.source} falls in a bucket")
    projection = report.get("projection")
    fig = Figure(figsize=(9, 9.5 if projection else 5.5), layout="constrained")
    axes = fig.subplots(2, 1, height_ratios=[3, 2]) if projection else [fig.subplots()]
    _wait_panel(axes[0], data, buckets, report)
    if projection:
        _projection_panel(axes[1], projection)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(out))
    log.debug("wrote %s", out)
    return out


def _short(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f}min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
