import pytest

from beamrl.metrics.jsonl import JsonlLogger
from beamrl.metrics.plot import moving_average, plot_reward_curve


def test_moving_average():
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_png_written(tmp_path):
    lg = JsonlLogger(tmp_path)
    for step in range(30):
        lg.log(step, {"reward/mean": step / 30})
    lg.log(30, {"loss": 1.0})  # a row without the key is skipped
    lg.close()
    out = plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "reward.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_nothing_to_plot(tmp_path):
    lg = JsonlLogger(tmp_path)
    lg.log(0, {"loss": 1.0})
    lg.close()
    with pytest.raises(ValueError, match="reward/mean"):
        plot_reward_curve(tmp_path, tmp_path / "x.png")
