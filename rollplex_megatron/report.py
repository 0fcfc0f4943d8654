"""Reports of GRPO runs from their `metrics.jsonl`: reward curves, per-phase time bars, a summary table.

Each line of `metrics.jsonl` is one step's JSON object with `step`, `mode`, `reward_mean`, `accuracy`,
`kl`, `kl_k1`, `loss`, `entropy`, `step_time_s`, `phase_times` ({phase: seconds}) and `peak_mem_bytes`,
or a validation run's (`"kind": "val"`, `step`, `val/reward_mean`, `val/<data_source>/reward_mean`).
The first step is warm-up (compilation, allocator growth) and is left out of timings when a run
has more than one step. A phase absent from a step counts as 0 s in that step.

    python -m rollplex_megatron.report RUN_DIR [RUN_DIR ...] [--out PNG] [--chance X]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

METRICS_FILE = "metrics.jsonl"
REQUIRED_KEYS = ("step", "mode", "reward_mean", "step_time_s", "phase_times", "peak_mem_bytes")
NO_KL = "no reference model: KL not computed"  # the KL panel of runs without one (train.kl_coef=0)


def read_metrics(path: str | os.PathLike, kind: str = "step") -> list[dict]:
    """Records of a metrics.jsonl, in file order: the steps' (`kind="step"`) or the validation runs'
    (`kind="val"`, lines with `"kind": "val"`); a malformed line raises ValueError naming file:line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if isinstance(rec, dict) and rec.get("kind") == "val":
                if kind == "val":
                    records.append(rec)
                continue
            _check_record(rec, f"{path}:{lineno}")
            if kind == "step":
                records.append(rec)
    return records


def _check_record(rec: object, where: str) -> None:
    """Raise ValueError at `where` unless `rec` is an object with the keys a report reads."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if missing:
        raise ValueError(f"{where}: record lacks {', '.join(missing)}")
    if not isinstance(rec["phase_times"], dict):
        raise ValueError(f"{where}: phase_times must be an object of phase -> seconds")


def _by_step(records: list[dict]) -> list[dict]:
    """Records sorted by step."""
    return sorted(records, key=lambda r: r["step"])


def _timed(records: list[dict]) -> list[dict]:
    """Step-ordered records whose timings count: all but the first (warm-up) step when there are several."""
    ordered = _by_step(records)
    return ordered[1:] if len(ordered) > 1 else ordered


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def phase_names(runs: dict[str, list[dict]]) -> list[str]:
    """Union of phase names across runs, in order of first appearance."""
    names: dict[str, None] = {}
    for records in runs.values():
        for rec in records:
            names.update(dict.fromkeys(rec["phase_times"]))
    return list(names)


def mean_phase_times(records: list[dict]) -> dict[str, float]:
    """Mean seconds per step of each phase over the timed steps (a phase absent from a step counts 0)."""
    timed = _timed(records)
    names = phase_names({"": timed})
    return {p: sum(r["phase_times"].get(p, 0.0) for r in timed) / len(timed) for p in names}


def summarize(records: list[dict]) -> dict:
    """Steps, reward first/last and first/last-20% means, mean step and phase times, peak memory."""
    if not records:
        raise ValueError("summarize: no records")
    ordered = _by_step(records)
    rewards = [r["reward_mean"] for r in ordered]
    k = max(1, len(ordered) // 5)
    return {
        "steps": len(ordered),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_first20": _mean(rewards[:k]),
        "reward_last20": _mean(rewards[-k:]),
        "step_time_s": _mean([r["step_time_s"] for r in _timed(ordered)]),
        "phase_times": mean_phase_times(ordered),
        "peak_mem_bytes": max(int(r["peak_mem_bytes"]) for r in ordered),
        # share of step time spent waiting for prompts (loading, image/video processing, tokenising)
        "data_share": _mean([r.get("data_share", 0.0) for r in _timed(ordered)]),
    }


def _plot_rewards(ax, runs: dict[str, list[dict]], chance: float | None) -> None:
    """Left panel: reward_mean vs step, one line per run, dashed chance level."""
    for label, records in runs.items():
        ordered = _by_step(records)
        ax.plot([r["step"] for r in ordered], [r["reward_mean"] for r in ordered],
                marker="o" if len(ordered) < 30 else None, markersize=3, label=label)
    if chance is not None:
        ax.axhline(chance, color="grey", linestyle="--", linewidth=1, label=f"chance ({chance:g})")
    ax.set_xlabel("step")
    ax.set_ylabel("reward_mean")
    ax.set_title("Reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _plot_phases(ax, runs: dict[str, list[dict]]) -> None:
    """Right panel: stacked horizontal bars of mean seconds per step by phase, one bar per run."""
    names = phase_names(runs)
    colours = {p: f"C{i % 10}" for i, p in enumerate(names)}
    labels = list(runs)
    means = [mean_phase_times(runs[label]) for label in labels]
    left = [0.0] * len(labels)
    for p in names:
        widths = [m.get(p, 0.0) for m in means]
        ax.barh(labels, widths, left=left, color=colours[p], label=p)
        left = [a + b for a, b in zip(left, widths)]
    for y, label in enumerate(labels):
        step_s = _mean([r["step_time_s"] for r in _timed(runs[label])])
        ax.text(left[y], y, f" step {step_s:.3g}s", va="center", fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("mean seconds per step (warm-up step 1 excluded)")
    ax.set_title("Time per phase")
    ax.margins(x=0.2)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(len(names), 5),
              frameon=False)


def _plot_curve(ax, runs: dict[str, list[dict]], key: str, title: str, alt: str | None = None) -> None:
    """`key` vs step, one line per run (and `alt` dotted beside it, when the records hold it)."""
    for i, (label, records) in enumerate(runs.items()):
        ordered = [r for r in _by_step(records) if key in r]
        ax.plot([r["step"] for r in ordered], [r[key] for r in ordered], color=f"C{i}", label=f"{label} {key}")
        if alt and any(alt in r for r in ordered):
            ax.plot([r["step"] for r in ordered if alt in r], [r[alt] for r in ordered if alt in r], color=f"C{i}",
                    linestyle=":", label=f"{label} {alt}")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")


def _plot_kl(ax, runs: dict[str, list[dict]]) -> None:
    """KL panel: the loss's estimator per run (k1 dotted), or a note where no run had a reference model (records
    without `kl`: train.kl_coef=0), rather than an empty plot."""
    if any("kl" in r for records in runs.values() for r in records):
        _plot_curve(ax, runs, "kl", "KL to the reference (the loss's estimator; k1 dotted)", alt="kl_k1")
        return
    ax.set_title("KL to the reference")
    ax.text(0.5, 0.5, NO_KL, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_val(ax, val_runs: dict[str, list[dict]]) -> None:
    """Validation reward per data source (dashed, markers) over the reward panel."""
    for i, (label, records) in enumerate(val_runs.items()):
        keys = sorted({k for r in records for k in r if k.startswith("val/") and k.endswith("/reward_mean")}
                      - {"val/reward_mean"})
        for j, k in enumerate(["val/reward_mean", *keys] if len(keys) > 1 else ["val/reward_mean"]):
            pts = [(r["step"], r[k]) for r in _by_step(records) if k in r]
            ax.plot(*zip(*pts), color=f"C{i}", linestyle="--", marker="os^v<>"[j % 6], markersize=4,
                    label=f"{label} {k}")
    if val_runs:
        ax.legend(fontsize="x-small")


def plot_runs(runs: dict[str, list[dict]], out_png: str, chance: float | None = None,
              val_runs: dict[str, list[dict]] | None = None) -> str:
    """Write a four-panel PNG (reward with validation rewards, accuracy, KL, per-phase time bars)
    atomically to `out_png`; return its path."""
    if not runs or not all(runs.values()):
        raise ValueError("plot_runs: every run needs at least one record")
    fig = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_reward, ax_acc), (ax_kl, ax_phase) = fig.subplots(2, 2)
    _plot_rewards(ax_reward, runs, chance)
    _plot_val(ax_reward, {k: v for k, v in (val_runs or {}).items() if v})
    _plot_curve(ax_acc, runs, "accuracy", "Accuracy (right answers over all responses)", alt="answered")
    _plot_kl(ax_kl, runs)
    _plot_phases(ax_phase, runs)
    out_dir = os.path.dirname(os.path.abspath(out_png))
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".report-", suffix=".png")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        os.replace(tmp, out_png)
    except BaseException:
        os.unlink(tmp)
        raise
    return out_png


def _run_label(run_dir: Path, records: list[dict], taken: dict) -> str:
    """The run's mode (else its dir name), made unique against `taken` by the dir name, then a counter."""
    modes = {r.get("mode") for r in records}
    label = modes.pop() if len(modes) == 1 and None not in modes else run_dir.name
    if label in taken:
        label = f"{label} [{run_dir.name}]"
    base, n = label, 2
    while label in taken:
        label, n = f"{base} #{n}", n + 1
    return label


def format_table(summaries: dict[str, dict]) -> str:
    """Fixed-width table of summaries, one row per run, one column per phase."""
    phases = list(dict.fromkeys(p for s in summaries.values() for p in s["phase_times"]))
    head = ["run", "steps", "reward0", "rewardN", "first20%", "last20%", "step_s",
            *[f"{p}_s" for p in phases], "peak_GiB"]
    rows = [head]
    for label, s in summaries.items():
        rows.append([label, str(s["steps"]),
                     *(f"{s[k]:.4f}" for k in ("reward_first", "reward_last", "reward_first20", "reward_last20")),
                     f"{s['step_time_s']:.3f}",
                     *(f"{s['phase_times'][p]:.3f}" if p in s["phase_times"] else "-" for p in phases),
                     f"{s['peak_mem_bytes'] / 2**30:.2f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)


def main(argv: list[str] | None = None) -> int:
    """CLI: read each run dir's metrics.jsonl, write the PNG, print the table then the PNG path."""
    ap = argparse.ArgumentParser(prog="python -m rollplex_megatron.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path, help=f"run directories holding {METRICS_FILE}")
    ap.add_argument("--out", help="PNG path (default: report.png next to the first run's metrics)")
    ap.add_argument("--chance", type=float, help="reward of a random policy, drawn as a dashed line")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {}
    val_runs: dict[str, list[dict]] = {}
    for run_dir in args.run_dirs:
        try:
            records = read_metrics(run_dir / METRICS_FILE)
        except (OSError, ValueError) as e:
            ap.error(str(e))
        if not records:
            ap.error(f"{run_dir / METRICS_FILE}: no records")
        label = _run_label(run_dir, records, runs)
        runs[label], val_runs[label] = records, read_metrics(run_dir / METRICS_FILE, kind="val")
    out = args.out or str(args.run_dirs[0] / "report.png")
    plot_runs(runs, out, chance=args.chance, val_runs=val_runs)
    print(format_table({label: summarize(records) for label, records in runs.items()}))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
