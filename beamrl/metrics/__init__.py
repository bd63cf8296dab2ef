"""Run outputs: metric loggers (console, metrics.jsonl, TensorBoard, wandb), a Timer, the reward-curve plot."""

from beamrl.metrics.build import build_metrics_logger
from beamrl.metrics.logger import MetricsLogger, MultiLogger
from beamrl.metrics.timer import Timer

__all__ = ["MetricsLogger", "MultiLogger", "Timer", "build_metrics_logger"]
