"""The end of a run: a run in which no step has a reward (every sample left out by rewards with on_error: skip)
finishes with its summary and says why there is no reward curve (plotting raised there, after the final checkpoint)."""

import json

from beamrl.loop.summary import plot_and_summarize


def test_no_reward_to_plot_is_said_and_the_summary_is_written(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/num_samples": 0.0}) + "\n"
                                                    for s in range(2)))
    plot_and_summarize(tmp_path, True, {"name": "r"})
    assert not (tmp_path / "reward_curve.png").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 0
    assert "no reward_curve.png" in capsys.readouterr().out


def test_a_run_with_rewards_gets_its_curve(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 4}) + "\n"
                                                    for s in range(4)))
    plot_and_summarize(tmp_path, True, {"name": "r"})
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
