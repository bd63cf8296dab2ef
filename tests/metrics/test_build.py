from beamrl.metrics import build_metrics_logger
from beamrl.metrics.console import ConsoleLogger
from beamrl.metrics.jsonl import JsonlLogger, read_metrics
from beamrl.metrics.tensorboard import TensorBoardLogger
from beamrl.recipe import load_recipe


def test_backends_from_recipe(tmp_path, capsys):
    r = load_recipe("quickstart", ["logging.tensorboard=true"])
    m = build_metrics_logger(r, tmp_path)
    assert [type(x) for x in m.loggers] == [JsonlLogger, ConsoleLogger, TensorBoardLogger]
    m.log(0, {"reward/mean": 0.25})
    m.close()
    assert read_metrics(tmp_path) == [{"step": 0, "reward/mean": 0.25}]
    assert "reward 0.250" in capsys.readouterr().out
    r = load_recipe("quickstart", ["logging.console=false"])
    assert [type(x) for x in build_metrics_logger(r, tmp_path / "b").loggers] == [JsonlLogger]
