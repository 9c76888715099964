"""`orchestrate report RUN --out DIR`: PNG plots and one self-contained HTML page of a run.

Works on a finished run and on one in progress, on any storage (local, memory://, object stores):
everything comes from the run directory (orchestrator.observe.report_data). Figures use matplotlib's
object API on the Agg canvas, never pyplot, so nothing opens a window and no global state is set.
What each plot shows, and what to look for, is in docs/observability.md.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import html
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.layout import local_cache_root
from core.progress import bytes_moved, bytes_sent
from core.storage import Storage
from orchestrator.observe.metrics import to_jsonl
from orchestrator.observe.report_data import (RunData, Segment, bytes_series, collect, contribution_size, eval_curve,
                                              outer_stats_cached, time_budget, timeline, worker_io, worker_losses,
                                              worker_utilization)

FIGURES = ("loss", "timeline", "bytes", "outer_gradients", "contributions")
COLORS = {"queued": "#f2b134", "starting": "#f7d794", "training ahead": "#2a9d8f", "running": "#3b7dd8", "merging": "#d8453b", "evaluating": "#8e5bc7",
          "in flight": "#9cc3f0", "no contribution": "#b0b0b0"}
CAPTIONS = {
    "loss": "Eval loss of the global model (held-out data) after each round, and against inner steps with each "
            "worker's own training loss: the gap between the workers' curves and the global model is what merging buys.",
    "timeline": "Every job per worker per round: queued (the scheduler's queue wait), starting (the job's process "
                "starting and loading its base, or a persistent worker taking its next round, until its first step), "
                "training ahead (round.overlap: "
                "the round's steps taken before it was submitted), running (training until its contribution was "
                "published), and the merge service merging and evaluating. Gaps are idle time; a persistent "
                "worker's label gives its utilization, busy / (busy + idle waiting for a global).",
    "bytes": "Bytes written to storage per round (contributions, global weights, outer-optimizer state, workers' "
             "optimizer states) and bytes the merge read.",
    "outer_gradients": "Outer gradients (global - worker weights): norm per worker and of the merged step, and the "
                       "cosine similarity between workers' outer gradients (DiLoCo paper, Figures 10-11).",
    "contributions": "Contributions per round: merged, late (published after the merge), dropped without a "
                     "contribution, and rejected by the merge.",
}


def _figure(width: float, height: float, cols: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, cols, i + 1) for i in range(cols)]
    return fig, axes


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _marker(n: int) -> float:
    """Marker size: visible on a few points, out of the way on a hundred."""
    return 6.0 if n <= 20 else 3.0 if n <= 60 else 0.0


def _round_axis(ax: Any, n: int) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(max(n, 1), 12)))


# -- the figures (pure: data in, Figure out) ----------------------------------------------------
def plot_loss(data: RunData) -> Any:
    fig, (by_round, by_step) = _figure(11, 4.2, cols=2)
    rounds, steps, losses = eval_curve(data.lines)
    curves = worker_losses(data.steps_with_current())
    if not losses:
        _empty(by_round, "no eval loss yet")
    else:
        by_round.plot(rounds, losses, marker="o", markersize=_marker(len(losses)), color="black")
        by_round.set_xlabel("rounds merged (0 = initial model)")
        _round_axis(by_round, len(rounds))
    by_round.set_ylabel(f"eval {data.cfg.loss_label} (held-out)")
    by_round.set_title("Global model: eval loss per round")
    for i, (w, (xs, ys)) in enumerate(sorted(curves.items())):
        label = f"worker {w} (train loss)" if len(curves) <= 4 else "workers' train loss (one line each)" if i == 0 else None
        by_step.plot(xs, ys, linewidth=0.9, alpha=0.6, label=label)
    if losses:
        by_step.plot(steps, losses, marker="o", markersize=_marker(len(losses)), color="black", linewidth=2,
                     label="global model (eval loss)")
    h = data.cfg.inner.steps
    for r in range(1, len(rounds)) if len(rounds) <= 40 else ():
        by_step.axvline(r * h, color="gray", linewidth=0.5, linestyle=":")
    if not curves and not losses:
        _empty(by_step, "no steps yet")
    else:
        by_step.legend(fontsize=8, loc="upper right")
    _round_axis(by_step, max([x for xs, _ in curves.values() for x in xs] + steps + [1]))
    by_step.set_xlabel(f"inner steps (H = {h} per round; dotted lines: merges)")
    by_step.set_ylabel(data.cfg.loss_label)
    by_step.set_title("Per inner step: workers' training loss vs global eval loss")
    return fig


def _time_scale(span: float) -> tuple[float, str]:
    return (3600.0, "hours") if span > 3 * 3600 else (60.0, "minutes") if span > 600 else (1.0, "seconds")


def plot_timeline(data: RunData, segments: Sequence[Segment]) -> Any:
    rows = [f"worker {w}" for w in range(data.cfg.workers)] + ["merge service"]
    busy = worker_utilization(data.kind("worker"))
    labels = [f"{row}, busy {busy[i]:.0%}" if i in busy else row for i, row in enumerate(rows)]
    fig, (ax,) = _figure(11, 1.4 + 0.38 * len(rows))
    if not segments:
        _empty(ax, "no job has been submitted yet")
        return fig
    t0 = min(s.start for s in segments)
    unit, label = _time_scale(max(s.end for s in segments) - t0)
    for kind, color in COLORS.items():
        if not any(s.kind == kind for s in segments):
            continue
        for i, row in enumerate(rows):
            bars = [((s.start - t0) / unit, (s.end - s.start) / unit) for s in segments if s.row == row and s.kind == kind]
            if bars:
                ax.broken_barh(bars, (i - 0.35, 0.7), facecolors=color, edgecolor="white", linewidth=0.3,
                               hatch="//" if kind in ("in flight", "no contribution") else None)
        ax.bar(0, 0, color=color, label=kind)  # legend entry
    starts = sorted({(s.round, min(x.start for x in segments if x.round == s.round)) for s in segments})
    if len(starts) <= 30:
        for r, start in starts:
            ax.axvline((start - t0) / unit, color="black", linewidth=0.5, alpha=0.4)
            ax.text((start - t0) / unit, -0.45, f" r{r}", fontsize=8, va="bottom")
    ax.set_yticks(range(len(rows)), labels)
    ax.set_ylim(len(rows) - 0.5, -0.75)  # worker 0 on top, round labels above it
    ax.set_xlabel(f"wall time since the first submission ({label})")
    ax.set_title("Where the wall time went: every job, per worker and round (rN: round N submitted)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return fig


def _byte_unit(top: float) -> tuple[float, str]:
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if top >= scale:
            return scale, name
    return 1.0, "bytes"


def plot_bytes(data: RunData) -> Any:
    rounds = data.kind("round")
    fig, (ax,) = _figure(9, 3.8)
    if not rounds:
        _empty(ax, "no round committed yet")
        return fig
    s = bytes_series(rounds)
    xs = [line["round"] for line in rounds]
    written = ("bytes_contributions", "bytes_global", "bytes_outer_state", "bytes_worker_states")
    totals = [sum(v) for v in zip(*(s[k] for k in written))]
    scale, unit = _byte_unit(max(totals + s["bytes_read"]))
    bottom = [0.0] * len(xs)
    labels = {"bytes_contributions": "contributions (workers' weights or deltas)", "bytes_global": "global weights",
              "bytes_outer_state": "outer-optimizer state", "bytes_worker_states": "workers' optimizer states"}
    for k in written:
        vals = [v / scale for v in s[k]]
        ax.bar(xs, vals, bottom=bottom, label=labels[k], width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(xs, [v / scale for v in s["bytes_read"]], color="black", marker="x", markersize=_marker(len(xs)),
            linestyle="--", label="read by the merge")
    _round_axis(ax, len(xs))
    ax.set_xlabel("round")
    ax.set_ylabel(f"{unit} per round")
    said = [bytes_sent(*sent)] if (sent := contribution_size(data.kind("worker"))) else []
    said += bytes_moved(*io).split("; ") if (io := worker_io(data.kind("worker"))) else []
    ax.set_title("\n".join(["Storage traffic per round (workers' optimizer states: 0 where already pruned)", *said]),
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_outer(data: RunData) -> Any:
    fig, (norm_ax, cos_ax) = _figure(11, 4.0, cols=2)
    stats = {r: s for r, s in sorted(data.outer.items()) if "error" not in s}
    # the merged step's norm is in every round's record; the workers' own need their tensors
    recorded = {line["round"]: line["outer_grad_norm"] for line in data.kind("round") if line.get("outer_grad_norm") is not None}
    if not stats and not recorded:
        _empty(norm_ax, "no merged round yet")
        _empty(cos_ax, "needs a merged round with 2+ workers")
        return fig
    xs = list(recorded) or list(stats)
    for r, s in stats.items():
        norm_ax.scatter([r] * len(s["norms"]), s["norms"], s=14, color="tab:blue", alpha=0.6,
                        label="each worker" if r == next(iter(stats)) else None)
    norm_ax.plot(xs, list(recorded.values()) or [s["mean_grad_norm"] for s in stats.values()], color="black", marker="o",
                 markersize=_marker(len(xs)), label="merged outer gradient (weighted mean)")
    _kept_only(norm_ax, list(stats), len(xs), "each worker's norm")
    norm_ax.set_xlabel("round")
    norm_ax.set_ylabel("L2 norm of global - worker weights")
    norm_ax.set_title("Outer-gradient norm per round")
    norm_ax.legend(fontsize=8)
    _round_axis(norm_ax, len(xs))
    paired = {r: s["pairwise"] for r, s in stats.items() if s["pairwise"]}
    if not paired:
        _empty(cos_ax, "cosine similarity needs 2+ merged workers in a round")
        return fig
    px = list(paired)
    cos_ax.fill_between(px, [min(p) for p in paired.values()], [max(p) for p in paired.values()], alpha=0.25,
                        color="tab:green", label="min-max over worker pairs")
    cos_ax.plot(px, [sum(p) / len(p) for p in paired.values()], marker="o", markersize=_marker(len(px)), color="tab:green",
                label="mean over pairs")
    cos_ax.axhline(0, color="gray", linewidth=0.6)
    cos_ax.set_ylim(min(-0.05, min(min(p) for p in paired.values()) - 0.05), 1.02)
    cos_ax.set_xlabel("round")
    cos_ax.set_ylabel("cosine similarity")
    cos_ax.set_title("Agreement between workers' outer gradients")
    cos_ax.legend(fontsize=8)
    _round_axis(cos_ax, len(px))
    _kept_only(cos_ax, px, len(xs), "cosines")
    return fig


def _kept_only(ax: Any, shown: list[int], rounds: int, what: str) -> None:
    """Say on the plot when `what` covers fewer rounds than the run has: only the rounds whose
    tensors retention kept (round.keep_last) can be measured."""
    if len(shown) < rounds:
        where = f"round{'s' if len(shown) != 1 else ''} {', '.join(map(str, shown[:6]))}{' ...' if len(shown) > 6 else ''}"
        ax.text(0.01, 0.01, f"{what}: {where} only, whose tensors are kept (round.keep_last; 0 keeps all)",
                transform=ax.transAxes, fontsize=7, color="dimgray", va="bottom")


def contribution_counts(rounds: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Per round: merged, late (published, not merged), dropped without a contribution, rejected."""
    out: dict[str, list[int]] = {"merged": [], "late": [], "dropped": [], "rejected": []}
    for line in rounds:
        late = set(line.get("late") or [])
        out["merged"].append(len(line["merged"]))
        out["late"].append(len(late))
        out["dropped"].append(len(set(line["dropped"]) - late))
        out["rejected"].append(len(line["rejected"]))
    return out


def plot_contributions(data: RunData) -> Any:
    rounds = data.kind("round")
    fig, (ax,) = _figure(9, 3.4)
    if not rounds:
        _empty(ax, "no round committed yet")
        return fig
    xs = [line["round"] for line in rounds]
    counts = contribution_counts(rounds)
    colors = {"merged": "tab:green", "late": "tab:orange", "dropped": "tab:gray", "rejected": "tab:red"}
    labels = {"merged": "merged", "late": "late (published after the merge)", "dropped": "dropped (no contribution)",
              "rejected": "rejected by the merge"}
    bottom = [0] * len(xs)
    for k, vals in counts.items():
        ax.bar(xs, vals, bottom=bottom, color=colors[k], label=labels[k], width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, max(max(bottom), data.cfg.workers) + 0.5)
    from matplotlib.ticker import MaxNLocator
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _round_axis(ax, len(xs))
    ax.set_xlabel("round")
    ax.set_ylabel("workers")
    ax.set_title(f"Contributions per round ({data.cfg.workers} workers, quorum {data.cfg.quorum})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# -- the page -----------------------------------------------------------------------------------
def _pct(u: float | None) -> float | None:
    return None if u is None else 100 * u


def _cell(v: Any, fmt: str = "{}") -> str:
    return "" if v is None else html.escape(fmt.format(v))


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    th = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" if head else ""
    trs = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{th}{trs}</table>"


def summary_rows(data: RunData) -> list[tuple[str, str]]:
    c, rounds = data.cfg, data.kind("round")
    _, _, losses = eval_curve(data.lines)
    created = data.info.get("created_at")
    return [("run directory", data.run), ("state", data.state),
            ("shape", f"{c.algorithm}: {c.workers} workers x {c.rounds} rounds x {c.inner.steps} inner steps"),
            ("rounds committed", f"{len(rounds)} of {c.rounds}"),
            (f"eval {data.cfg.loss_label}", " -> ".join(f"{v:.4f}" for v in (losses[:1] + losses[-1:] if len(losses) > 1 else losses))),
            *((f"eval {k}", " -> ".join(f"{v:.4f}" for v in vs)) for k, vs in _metric_ends(data.lines).items()),
            ("wall time", "" if created is None or not rounds else
             f"{max(r.get('evaluated_at') or r['committed_at'] for r in rounds) - created:.0f} s from the run's "
             "creation to its last committed round"),
            ("parameters", _cell(data.info.get("params")))]


def _metric_ends(lines: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """The task's other eval metrics (e.g. accuracy): each one's first and last value over the run."""
    seen: dict[str, list[float]] = {}
    for ln in lines:
        if ln["kind"] in ("run", "round"):
            for k, v in (ln.get("eval_metrics") or {}).items():
                seen.setdefault(k, []).append(v)
    return {k: vs[:1] + vs[-1:] if len(vs) > 1 else vs for k, vs in seen.items()}


def round_rows(data: RunData, budget: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    by_round = {b["round"]: b for b in budget}
    rows = []
    for line in data.kind("round"):
        r, b, o = line["round"], by_round.get(line["round"], {}), data.outer.get(line["round"], {})
        pairs = o.get("pairwise") or []
        written = sum(line.get(k) or 0 for k in ("bytes_contributions", "bytes_global", "bytes_outer_state",
                                                 "bytes_worker_states"))
        rows.append([_cell(r), _cell(line["eval_loss"], "{:.4f}"), _cell(line["merged"]), _cell(line["dropped"]),
                     _cell(line["rejected"]), _cell(line["round_seconds"], "{:.1f}"), _cell(b.get("queued"), "{:.1f}"), _cell(b.get("starting"), "{:.1f}"),
                     _cell(b.get("running"), "{:.1f}"), _cell(_pct(line.get("utilization")), "{:.0f}%"),
                     _cell(line["merge_seconds"], "{:.2f}"),
                     _cell(b.get("evaluating"), "{:.2f}"), _cell(written / 1e6, "{:.2f}"),
                     _cell(line["outer_grad_norm"], "{:.4g}"), _cell(sum(pairs) / len(pairs) if pairs else None, "{:.3f}")])
    return rows


def problem_items(data: RunData) -> list[str]:
    """Why each dropped or rejected contribution was left out, and rounds whose statistics failed."""
    items = []
    for line in data.kind("round"):
        for kind in ("dropped", "rejected"):
            for w, why in sorted((line.get(f"{kind}_reasons") or {}).items(), key=lambda kv: int(kv[0])):
                items.append(f"round {line['round']}: worker {w} {kind}: {why}")
    items += [f"round {r}: outer-gradient statistics unavailable: {s['error']}"
              for r, s in sorted(data.outer.items()) if "error" in s]
    return items


def current_rows(data: RunData) -> list[list[str]]:
    cur = data.current
    if not cur:
        return []
    rows = []
    for w, entry in sorted(cur["jobs"].get("workers", {}).items(), key=lambda kv: int(kv[0])):
        p = cur["progress"].get(int(w)) or {}
        here = p.get("round") == cur["round"]
        rows.append([str(cur["round"]), w, html.escape(str(entry["job_ids"][-1])),
                     "published" if int(w) in cur["manifests"] else "in flight",
                     _cell(p.get("step") if here else None), _cell(p.get("loss") if here else None, "{:.4f}")])
    return rows


CSS = ("body{font-family:sans-serif;max-width:1250px;margin:2em auto;color:#222}"
       "table{border-collapse:collapse;margin:1em 0;font-size:90%}td,th{border:1px solid #ccc;padding:3px 8px;"
       "text-align:right}th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}p.cap{color:#555}")


def render_html(data: RunData, images: Mapping[str, bytes], budget: Sequence[Mapping[str, Any]]) -> str:
    """One page, every image inline as a data: URI, so the file can be mailed or attached alone."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>islands report: {html.escape(data.run)}</title>"
             f"<style>{CSS}</style></head><body><h1>islands report</h1>",
             _table([], [[html.escape(k), html.escape(v)] for k, v in summary_rows(data)])]
    if data.current:
        parts += ["<h2>Round in progress</h2>", _table(["round", "worker", "job", "state", "step", "last loss"],
                                                       current_rows(data))]
    for name in FIGURES:
        b64 = base64.b64encode(images[name]).decode()
        parts += [f"<h2>{html.escape(name.replace('_', ' '))}</h2><p class='cap'>{html.escape(CAPTIONS[name])}</p>",
                  f"<img alt='{name}' src='data:image/png;base64,{b64}'>"]
    head = ["round", "eval loss", "merged", "dropped", "rejected", "round s", "queued s (sum)", "starting s (sum)", "running s (sum)",
            "workers busy", "merge s", "eval s", "MB written", "outer grad norm", "mean cosine"]
    parts += ["<h2>Rounds</h2>", _table(head, round_rows(data, budget))]
    problems = problem_items(data)
    parts += ["<h2>Dropped and rejected contributions</h2>",
              "<ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in problems) + "</ul>" if problems else "<p>none</p>"]
    stamp = dt.datetime.fromtimestamp(data.now).isoformat(timespec="seconds")
    parts.append(f"<p class='cap'>generated {stamp} by <code>orchestrate report</code>; "
                 "plots explained in docs/observability.md</p></body></html>")
    return "\n".join(parts)


def build_figures(data: RunData, segments: Sequence[Segment]) -> dict[str, bytes]:
    figs = {"loss": plot_loss(data), "timeline": plot_timeline(data, segments), "bytes": plot_bytes(data),
            "outer_gradients": plot_outer(data), "contributions": plot_contributions(data)}
    return {name: _png(fig) for name, fig in figs.items()}


def stats_cache(storage: Storage) -> Path:
    """Where a run's outer-gradient statistics are kept between reports: a cache of this machine's
    ($ISLANDS_CACHE or ~/.cache/islands), not a file in --out, which holds the report only."""
    run = hashlib.sha256(storage.display().encode()).hexdigest()[:16]
    return local_cache_root() / "report" / run / "outer_gradients.json"


def write_report(storage: Storage, out: Path | str, now: float | None = None) -> dict[str, Any]:
    """Write DIR/<figure>.png, DIR/report.html (self-contained) and DIR/metrics.jsonl; return what was written."""
    out = Path(out)
    data = collect(storage, now)
    out.mkdir(parents=True, exist_ok=True)
    data.outer = outer_stats_cached(storage, data.kind("round"), stats_cache(storage))
    segments = timeline(data.kind("round"), data.kind("worker"), data.current, data.now)
    budget = time_budget(segments, data.kind("round"))
    images = build_figures(data, segments)
    for name, png in images.items():
        (out / f"{name}.png").write_bytes(png)
    (out / "metrics.jsonl").write_bytes(to_jsonl(data.lines))
    (out / "report.html").write_text(render_html(data, images, budget), encoding="utf-8")
    return {"html": str(out / "report.html"), "images": [str(out / f"{n}.png") for n in images],
            "metrics": str(out / "metrics.jsonl"), "state": data.state, "rounds": len(data.kind("round")),
            "problems": problem_items(data)}
