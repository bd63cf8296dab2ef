"""The metrics logger the `logging` section asks for: console + metrics.jsonl (always) + TensorBoard + wandb."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from beamrl.metrics.config import LoggingConfig
from beamrl.metrics.console import ConsoleLogger
from beamrl.metrics.jsonl import JsonlLogger
from beamrl.metrics.logger import MetricsLogger, MultiLogger


def build_metrics_logger(logging: LoggingConfig, output_dir: str | Path, run_name: str, num_steps: int | None = None,
                         run_config: dict[str, Any] | None = None) -> MultiLogger:
    """Backends under `output_dir`: metrics.jsonl, tensorboard/, wandb/. `run_config` (the whole recipe) is
    recorded by wandb; `num_steps` lets the console show progress and an ETA."""
    out = Path(output_dir)
    loggers: list[MetricsLogger] = [JsonlLogger(out)]
    if logging.console:
        loggers.append(ConsoleLogger(num_steps))
    if logging.tensorboard:
        from beamrl.metrics.tensorboard import TensorBoardLogger

        loggers.append(TensorBoardLogger(out / "tensorboard"))
    if logging.wandb.enabled:
        from beamrl.metrics.wandb_backend import WandbLogger

        w = logging.wandb
        loggers.append(WandbLogger(w.project, run_name, out, w.mode, w.entity, config=run_config,
                                   finish_timeout_s=w.finish_timeout_s))
    return MultiLogger(loggers)
