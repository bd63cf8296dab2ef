"""`metrics.jsonl`: one JSON object per step with 'step' and every metric. Always on; the source of plots."""

from __future__ import annotations

import json
import math
from pathlib import Path


class JsonlLogger:
    """Appends to <dir>/metrics.jsonl (a resumed run continues the same file). NaN is written as null."""

    FILENAME = "metrics.jsonl"

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / self.FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl (a directory means its metrics.jsonl), in file order."""
    path = Path(path)
    if path.is_dir():
        path = path / JsonlLogger.FILENAME
    if not path.exists():
        raise FileNotFoundError(f"metrics file not found: {path}")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e})") from None
    return rows
