"""TensorBoard event files via torch's SummaryWriter (values read back exactly by EventAccumulator)."""

from __future__ import annotations

import math
from pathlib import Path


class TensorBoardLogger:
    """Scalars under `log_dir`. The writer opens at the first step logged, with `purge_step` = that step: a resumed
    run (which logs from its checkpoint's step on) hides the events an earlier attempt wrote from there on, as
    metrics.jsonl is cut back to the checkpoint; TensorBoard would otherwise show both attempts' values."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self._writer = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=step)
        for key, value in metrics.items():
            if not math.isnan(value):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
