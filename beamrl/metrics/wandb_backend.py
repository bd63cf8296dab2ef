"""Weights & Biases. `mode: offline` never touches the network (the run syncs later with `wandb sync`)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any


#: How much longer than wandb's own `finish_timeout` `close` waits for the finish call (its own bookkeeping).
_FINISH_MARGIN_S = 30.0


class WandbLogger:
    """One wandb run under `output_dir/wandb/`. wandb itself gives up the end-of-run upload after `finish_timeout_s`
    (its `finish_timeout` setting, which also bounds the teardown it runs at interpreter exit); `close` also waits
    at most that long (plus a margin) for the finish call, then says where the run's files are and how to upload
    them, and returns."""

    def __init__(self, project: str, run_name: str, output_dir: str | Path, mode: str = "offline",
                 entity: str | None = None, config: dict[str, Any] | None = None, finish_timeout_s: float = 300.0):
        if mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb.mode={mode!r}: allowed 'offline', 'online'")
        import wandb

        self.finish_timeout_s = finish_timeout_s
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # wandb's own bound on the end-of-run upload: it covers `finish` and the teardown wandb registers with atexit
        # (which otherwise waits for its service process, unbounded, when the interpreter exits).
        self._run = wandb.init(project=project, entity=entity, name=run_name, dir=str(self.dir), mode=mode,
                               config=config or {}, reinit="create_new",
                               settings=wandb.Settings(finish_timeout=finish_timeout_s))

    @property
    def run_dir(self) -> Path:
        return Path(self._run.dir).parent  # <dir>/wandb/offline-run-<date>-<id>

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        run_dir = self.run_dir
        errors: list[BaseException] = []

        def finish() -> None:
            try:
                self._run.finish()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

        # A daemon thread: an upload stuck on the network must not hold the end of the run (or the interpreter's).
        worker = threading.Thread(target=finish, name="beamrl-wandb-finish", daemon=True)
        worker.start()
        worker.join(self.finish_timeout_s + _FINISH_MARGIN_S)
        if worker.is_alive():
            print(f"[beamrl] wandb did not finish within logging.wandb.finish_timeout_s={self.finish_timeout_s:g} s; "
                  f"the run's records are in {run_dir}: upload them with `wandb sync {run_dir}`",
                  file=sys.stderr, flush=True)
            return
        if errors:
            raise errors[0]
