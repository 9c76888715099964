"""Results on disk: one JSON and one PNG per experiment, and results.md rendered from all of them.

An experiment run alone replaces its own JSON and plot only, and results.md is re-rendered from
every JSON present, so running one experiment never loses another's results. Hand-written
interpretation lives between `<!-- notes:NAME -->` and `<!-- /notes:NAME -->` in results.md and
is carried over each time the file is rewritten.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402

from bench.reproduce.context import Outcome, fmt_bytes  # noqa: E402

log = logging.getLogger(__name__)
IMG = Path("img/results")
NOTES = re.compile(r"<!-- notes:(?P<name>[\w-]+) -->\n?(?P<body>.*?)<!-- /notes:(?P=name) -->", re.S)
NO_NOTES = "_No interpretation written yet._\n"


def save(out: Path, name: str, meta: dict[str, Any], outcome: Outcome) -> dict[str, Any]:
    """Write IMG/name.json and IMG/name.png under `out`; returns the JSON record."""
    (out / IMG).mkdir(parents=True, exist_ok=True)
    record = {**meta, "name": name, "seconds": round(outcome.seconds, 1), "setup": outcome.setup,
              "xlabel": outcome.xlabel, "metric": outcome.metric, "rows": [dataclasses.asdict(r) for r in outcome.rows],
              "curves": [dataclasses.asdict(c) for c in outcome.curves],
              "checks": [dataclasses.asdict(c) for c in outcome.checks]}
    (out / IMG / f"{name}.json").write_text(json.dumps(record, indent=1))
    plot(record, out / IMG / f"{name}.png")
    return record


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def plot(record: dict[str, Any], path: Path) -> None:
    curves, rows = record["curves"], record["rows"]
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(12 if curves else 7, 4.2), squeeze=False)
    if curves:
        ax = axes[0][0]
        for c in curves:  # the mean over seeds; seeds differ mostly by their held-out split (a vertical shift)
            cols = list(zip(*c["per_seed"]))
            ax.plot(c["steps"], [_mean(list(v)) for v in cols], label=c["label"], marker=".")
        loss = "loss" in record.get("metric", "loss")  # the limits below suit a falling loss, not an accuracy
        means = [_mean(list(v)) for c in curves for v in list(zip(*c["per_seed"]))[1:]]
        if means and loss:  # the starting model's loss would flatten the part worth seeing
            ax.set_ylim(min(means) - 0.02, max(means) + 0.02)
        ax.set_xlabel(record["xlabel"])
        ax.set_ylabel(record.get("metric", "held-out eval loss (nats/byte)"))
        lows = [min(min(s[1:]) for s in c["per_seed"]) for c in curves if len(c["steps"]) > 1]
        if lows and loss:  # the first point (the starting model) would flatten the interesting part
            top = max(max(s[1] for s in c["per_seed"]) for c in curves if len(c["steps"]) > 1)
            ax.set_ylim(min(lows) - 0.02, top + 0.05)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[0][-1]  # paired: each seed's final loss minus the first row's on the same seed
    ref = rows[0]["finals"]
    diffs = [[v - r for v, r in zip(row["finals"], ref)] for row in rows]
    ax.barh(range(len(rows)), [_mean(d) for d in diffs], color="tab:blue", alpha=0.6)
    for i, d in enumerate(diffs):
        ax.plot(d, [i] * len(d), "k.", markersize=6)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"{record.get('metric', 'final eval loss')} minus '{rows[0]['label'][:30]}' (bar: mean, dots: seeds)",
                  fontsize=8)
    fig.suptitle(f"{record['title']} ({record['paper']}), size {record['size']}, seeds {record['seeds']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(checks: list[dict[str, Any]]) -> str:
    held = sum(c["holds"] for c in checks)
    if held == len(checks):
        return "yes" if all(c["every_seed"] for c in checks) else "yes (not on every seed)"
    return "no" if held == 0 else f"partly ({held}/{len(checks)})"


def _section(rec: dict[str, Any], notes: str) -> list[str]:
    out = [f"## {rec['title']} ({rec['paper']})", "",
           f"`{rec['command']}`: {rec['seconds']:.0f} s, size `{rec['size']}`, seeds {rec['seeds']}, {rec['device']}.", "",
           rec["setup"], "", f"| method | {rec.get('metric', 'final eval loss')} (mean ± half range) | per seed | communication | note |",
           "|---|---|---|---|---|"]
    for r in rec["rows"]:
        spread = (max(r["finals"]) - min(r["finals"])) / 2
        seeds = " / ".join(f"{v:.4f}" for v in r["finals"])
        out.append(f"| {r['label']} | {_mean(r['finals']):.4f} ± {spread:.4f} | {seeds} | "
                   f"{fmt_bytes(r['comm_bytes'])} | {r['note']} |")
    out += ["", "Paper's direction, tested on these numbers (means over seeds; and on every seed alone):", ""]
    for c in rec["checks"]:
        if c["holds"]:
            mark = "**holds** on every seed" if c["every_seed"] else "**holds** on the means, not on every seed"
        else:
            mark = "**does NOT hold**" + (" on the means (though on every seed alone)" if c["every_seed"] else "")
        out.append(f"- {c['claim']}: {mark}: {c['detail']}")
    out += ["", f"![{rec['title']}]({IMG}/{rec['name']}.png)", "", f"<!-- notes:{rec['name']} -->",
            notes.rstrip("\n"), f"<!-- /notes:{rec['name']} -->", ""]
    return out


def render(out: Path, order: list[str]) -> Path:
    """Rewrite out/results.md from every experiment JSON under out/IMG, keeping the notes."""
    path = out / "results.md"
    old = path.read_text() if path.exists() else ""
    notes = {m["name"]: m["body"] for m in NOTES.finditer(old)}
    records = {p.stem: json.loads(p.read_text()) for p in (out / IMG).glob("*.json") if not p.stem.startswith("_")}
    run_file = out / IMG / "_all.json"
    run = json.loads(run_file.read_text()) if run_file.exists() else None
    lines = ["# Reproducing the papers at small scale", "",
             "Generated by `python -m bench.reproduce` (bench/reproduce/); the text between the `notes` markers is "
             "written by hand and kept when the file is regenerated. Eval loss is the held-out cross-entropy in nats "
             "per byte (lower is better). Communication counts bytes that cross the network over a whole run, all "
             "workers together (float32 weights). A seed changes the initial model, every batch and the held-out split, so "
             "most of the spread between seeds is the eval set itself: compare methods within a seed (the per-seed "
             "column), as the checks under each table do.", ""]
    if run:
        lines += [f"Last full run: `{run['command']}` took **{run['seconds'] / 60:.1f} min** wall time "
                  f"({run['device']}, {run['date']}).", ""]
    lines += ["\"reproduced here?\" counts the paper's directions that hold on the means over seeds (the checks under "
              "each table). Time is the experiment's share of the run: a run an earlier experiment already did (the "
              "pre-training, shared baselines) is not repeated.", "",
              "| experiment | paper | reproduced here? | seeds | time |", "|---|---|---|---|---|"]
    names = [n for n in order if n in records] + sorted(set(records) - set(order))
    for n in names:  # plots follow the renderer, so they are redrawn with it
        plot(records[n], out / IMG / f"{n}.png")
    for n in names:
        r = records[n]
        lines.append(f"| [{r['title']}](#{_anchor(r)}) | {r['paper']} | {verdict(r['checks'])} | {len(r['seeds'])} | "
                     f"{r['seconds']:.0f} s |")
    lines += ["", "<!-- notes:summary -->", notes.get("summary", NO_NOTES).rstrip("\n"), "<!-- /notes:summary -->", ""]
    for n in names:
        lines += _section(records[n], notes.get(n, NO_NOTES))
    path.write_text("\n".join(lines))
    return path


def _anchor(rec: dict[str, Any]) -> str:
    text = f"{rec['title']} ({rec['paper']})".lower()
    return re.sub(r"[^a-z0-9 -]", "", text).replace(" ", "-")
