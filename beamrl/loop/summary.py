"""The end of a run: reward_curve.png and summary.json from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from beamrl.loop.log import log


def plot_and_summarize(out_dir: Path, plot_reward_curve: bool) -> None:
    metrics_path = out_dir / "metrics.jsonl"
    if plot_reward_curve and metrics_path.exists():
        from beamrl.metrics.plot import plot_reward_curve as plot

        plot(metrics_path, out_dir / "reward_curve.png")
    write_summary(out_dir, metrics_path)


def write_summary(out_dir: Path, metrics_path: Path) -> None:
    """summary.json: mean reward of the first and last 20% of steps (the quickstart's learning check)."""
    if not metrics_path.exists():
        return
    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    if not rewards:
        return
    k = max(1, len(rewards) // 5)
    summary = {"steps": len(rewards), "reward_first_20pct": sum(rewards[:k]) / k,
               "reward_last_20pct": sum(rewards[-k:]) / k}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"mean reward: first 20% of steps {summary['reward_first_20pct']:.3f} -> last 20% "
        f"{summary['reward_last_20pct']:.3f} ({out_dir / 'summary.json'})")
