"""The end of a run: reward_curve.png and summary.json from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from beamrl.loop.log import log
from beamrl.metrics import keys
from beamrl.metrics.jsonl import read_metrics
from beamrl.metrics.samples import FILENAME as SAMPLES_FILE


def plot_and_summarize(out_dir: Path, plot_reward_curve: bool, run: dict[str, Any] | None = None) -> None:
    metrics_path = out_dir / "metrics.jsonl"
    if plot_reward_curve and metrics_path.exists():
        from beamrl.metrics.plot import plot_reward_curve as plot

        if any(r.get(keys.REWARD_MEAN) is not None for r in read_metrics(metrics_path)):
            plot(metrics_path, out_dir / "reward_curve.png")
        else:  # every step's samples were left out (rewards with on_error: skip): no reward to draw
            log(f"no step of {metrics_path} has a reward (every sample was left out): no reward_curve.png")
    write_summary(out_dir, metrics_path, run or {})


def write_summary(out_dir: Path, metrics_path: Path, run: dict[str, Any]) -> None:
    """summary.json: the run (`run`: name, wall time of this invocation, where its outputs and last checkpoint
    are), the mean reward of the first and last 20% of steps (the quickstart's learning check), and the files."""
    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()] \
        if metrics_path.exists() else []
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    summary: dict[str, Any] = {**run, "steps": len(rewards)}
    if rewards:
        k = max(1, len(rewards) // 5)
        summary.update(reward_first_20pct=sum(rewards[:k]) / k, reward_last_20pct=sum(rewards[-k:]) / k)
    summary["files"] = {name: str(out_dir / name) for name in ("recipe.yaml", "metrics.jsonl", SAMPLES_FILE,
                                                               "reward_curve.png") if (out_dir / name).exists()}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if rewards:
        log(f"mean reward: first 20% of steps {summary['reward_first_20pct']:.3f} -> last 20% "
            f"{summary['reward_last_20pct']:.3f} ({out_dir / 'summary.json'})")
    wall = f" in {summary['wall_time_s']:.0f} s" if "wall_time_s" in summary else ""
    log(f"done{wall}: outputs in {out_dir}" + (f", last checkpoint {summary['last_checkpoint']}"
                                              if summary.get("last_checkpoint") else ""))
