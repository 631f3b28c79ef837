"""A PNG of the training curves in a metrics JSONL: the training batches' LM loss (a moving average; for QAD
too, so that the modes compare) and the held-out NLL against the step, one colour per run. Needs matplotlib;
without it, says so and writes nothing."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _pyplot(path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)", flush=True)
        return None
    return plt


def _save(plt, fig, path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(records: list[dict], path: str | Path, title: str = "") -> Path | None:
    plt = _pyplot(path)
    if plt is None:
        return None
    train, heldout = defaultdict(list), defaultdict(list)
    for r in records:
        if r.get("kind") == "train" and isinstance(r.get("lm_loss", r.get("loss")), float):
            train[r["run"]].append((r["step"], r.get("lm_loss", r.get("loss"))))
        elif r.get("kind") == "eval" and isinstance(r.get("nll"), float):
            heldout[r["run"]].append((r["step"], r["nll"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    runs = sorted(set(train) | set(heldout))
    colour = {run: plt.get_cmap("tab20")(i % 20) for i, run in enumerate(runs)}
    for run, points in sorted(train.items()):
        steps, losses = zip(*points)
        left.plot(steps, moving_average(list(losses), max(1, len(losses) // 20)), label=run, linewidth=1,
                  color=colour[run])
    for run, points in sorted(heldout.items()):
        steps, nlls = zip(*points)
        right.plot(steps, nlls, marker="o", markersize=3, label=run, linewidth=1, color=colour[run])
    left.set(xlabel="step", ylabel="LM loss of the training batches (moving average)", title="training")
    right.set(xlabel="step", ylabel="held-out NLL (nats / byte)", title="held-out")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    if len(runs) <= 32:
        left.legend(fontsize=5, ncol=1 + len(runs) // 12)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def plot_spans(differences: dict[str, dict[str, list]], starts: list[int], path: str | Path, title: str = ""):
    """One panel per comparison: each policy's difference (mean, 2 sigma band) against the span's first position.
    ``differences``: comparison -> policy -> [report.Difference per span]."""
    plt = _pyplot(path)
    if plt is None:
        return None
    comparisons = [c for c in differences if differences[c]]
    if not comparisons:
        return None
    fig, axes = plt.subplots(1, len(comparisons), figsize=(5 * len(comparisons), 4), squeeze=False)
    for axis, comparison in zip(axes[0], comparisons):
        for policy, values in sorted(differences[comparison].items()):
            means = [d.mean for d in values]
            band = [2 * d.sigma for d in values]
            line, = axis.plot(starts, means, marker="o", markersize=3, linewidth=1, label=policy)
            axis.fill_between(starts, [m - b for m, b in zip(means, band)], [m + b for m, b in zip(means, band)],
                              color=line.get_color(), alpha=0.15)
        axis.axhline(0, color="black", linewidth=0.6)
        axis.set(xlabel="first position of the span", ylabel="NLL difference (nats / byte)", title=comparison)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)
