from beamrl.metrics import build_metrics_logger
from beamrl.metrics.config import LoggingConfig
from beamrl.metrics.console import ConsoleLogger
from beamrl.metrics.jsonl import JsonlLogger, read_metrics
from beamrl.metrics.tensorboard import TensorBoardLogger


def test_backends_from_the_logging_section(tmp_path, capsys):
    m = build_metrics_logger(LoggingConfig(tensorboard=True), tmp_path, "run", num_steps=10)
    assert [type(x) for x in m.loggers] == [JsonlLogger, ConsoleLogger, TensorBoardLogger]
    m.log(0, {"reward/mean": 0.25})
    m.close()
    assert read_metrics(tmp_path) == [{"step": 0, "reward/mean": 0.25}]
    assert "reward 0.250" in capsys.readouterr().out
    assert [type(x) for x in build_metrics_logger(LoggingConfig(console=False), tmp_path / "b", "run").loggers] \
        == [JsonlLogger]
