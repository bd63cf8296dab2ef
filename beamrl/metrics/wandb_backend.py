"""Weights & Biases. `mode: offline` never touches the network (the run syncs later with `wandb sync`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WandbLogger:
    def __init__(self, project: str, run_name: str, output_dir: str | Path, mode: str = "offline",
                 entity: str | None = None, config: dict[str, Any] | None = None):
        if mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb.mode={mode!r}: allowed 'offline', 'online'")
        import wandb

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, entity=entity, name=run_name, dir=str(self.dir), mode=mode,
                               config=config or {}, reinit="create_new")

    @property
    def run_dir(self) -> Path:
        return Path(self._run.dir).parent  # <dir>/wandb/offline-run-<date>-<id>

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()
