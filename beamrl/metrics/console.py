"""One compact progress line per step on stdout."""

from __future__ import annotations

import sys
from typing import TextIO

from beamrl.metrics import keys


class ConsoleLogger:
    """`step 12/300 | reward 0.513 | len 812 | rollout 41.2s train 30.1s sync 2.5s | 9,870 tok/s`."""

    def __init__(self, num_steps: int | None = None, stream: TextIO | None = None):
        self.num_steps, self.stream = num_steps, stream

    def format(self, step: int, m: dict[str, float]) -> str:
        parts = [f"step {step}" + (f"/{self.num_steps}" if self.num_steps else "")]
        if keys.REWARD_MEAN in m:
            parts.append(f"reward {m[keys.REWARD_MEAN]:.3f}")
        if keys.RESPONSE_LEN_MEAN in m:
            parts.append(f"len {m[keys.RESPONSE_LEN_MEAN]:.0f}")
        times = [f"{k[5:-2]} {v:.1f}s" for k, v in m.items() if k.startswith("time/") and k.endswith("_s")]
        if times:
            parts.append(" ".join(times))
        if keys.TOKENS_PER_S in m:
            parts.append(f"{m[keys.TOKENS_PER_S]:,.0f} tok/s")
        return " | ".join(parts)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        print(self.format(step, metrics), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass
