"""The reward curve of a run: reward/mean per step and its moving average, from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from beamrl.metrics import keys
from beamrl.metrics.jsonl import read_metrics


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curve(metrics_path: str | Path, out_png: str | Path, window: int = 10,
                      key: str = keys.REWARD_MEAN, title: str | None = None) -> Path:
    """Write a PNG of `key` per step plus a `window`-step moving average; raise if no row has `key`."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if r.get(key) is not None]
    if not rows:
        raise ValueError(f"{metrics_path}: no step has {key!r}; nothing to plot")
    steps = [r["step"] for r in rows]
    values = [float(r[key]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1, label=key)
    ax.plot(steps, moving_average(values, window), color="tab:blue", linewidth=2, label=f"{window}-step average")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or key)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
