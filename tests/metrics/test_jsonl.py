import pytest

from beamrl.metrics.jsonl import JsonlLogger, read_metrics


def test_round_trip_and_append(tmp_path):
    rows = [{"reward/mean": 0.1 * i, "time/train_s": 1.0 / 3, "n": float(i)} for i in range(5)]
    lg = JsonlLogger(tmp_path / "run")
    for i, r in enumerate(rows):
        lg.log(i, r)
    lg.close()
    back = read_metrics(tmp_path / "run")
    assert back == [{"step": i, **r} for i, r in enumerate(rows)]  # floats survive exactly
    lg = JsonlLogger(tmp_path / "run")  # resumed run appends
    lg.log(5, {"reward/mean": float("nan")})
    lg.close()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1] == {"step": 5, "reward/mean": None}


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(tmp_path)
