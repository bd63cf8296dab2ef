"""One compact progress line per step on stdout (`format_step_line` is the one place that formats it)."""

from __future__ import annotations

import sys
from typing import TextIO

from beamrl.metrics import keys


def format_duration(seconds: float) -> str:
    """`1h02m`, `4m05s` or `12s`."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def format_step_line(step: int, num_steps: int | None, m: dict[str, float], eta_s: float | None = None) -> str:
    """`step 12/300 | reward 0.513 | len 812 | rollout 41.2s train 30.1s | 9,870 tok/s | ETA 3h05m`. `step` is
    metrics.jsonl's (0-based); the console counts from 1, so the last step reads `300/300`."""
    parts = [f"step {step + 1}" + (f"/{num_steps}" if num_steps else "")]
    if keys.REWARD_MEAN in m:
        parts.append(f"reward {m[keys.REWARD_MEAN]:.3f}")
    if keys.RESPONSE_LEN_MEAN in m:
        parts.append(f"len {m[keys.RESPONSE_LEN_MEAN]:.0f}")
    times = [f"{k[5:-2]} {v:.1f}s" for k, v in m.items() if k.startswith("time/") and k.endswith("_s")]
    if times:
        parts.append(" ".join(times))
    if keys.TOKENS_PER_S in m:
        parts.append(f"{m[keys.TOKENS_PER_S]:,.0f} tok/s")
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


class ConsoleLogger:
    """Prints `format_step_line` for every step. With `num_steps`, the ETA of the run is the steps left times
    the mean `time/step_s` of the steps logged so far."""

    def __init__(self, num_steps: int | None = None, stream: TextIO | None = None):
        self.num_steps, self.stream = num_steps, stream
        self._seconds, self._timed_steps = 0.0, 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if keys.TIME_STEP in metrics:
            self._seconds += metrics[keys.TIME_STEP]
            self._timed_steps += 1
        eta = None
        if self.num_steps and self._timed_steps:
            eta = max(self.num_steps - step - 1, 0) * self._seconds / self._timed_steps
        print(format_step_line(step, self.num_steps, metrics, eta), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass
