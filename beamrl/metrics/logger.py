"""The `MetricsLogger` seam and the multiplexer that fans one step's metrics out to every backend."""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable


@runtime_checkable
class MetricsLogger(Protocol):
    """A metrics backend. `log` gets one step's scalars (names like 'reward/mean'); `close` flushes."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_metrics(step: int, metrics: dict[str, float]) -> dict[str, float]:
    """Plain-float copy of `metrics`; raise on a non-numeric value or a reserved key (names the key)."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"metrics step must be a non-negative int, got {step!r}")
    out = {}
    for key, value in metrics.items():
        if key == "step":
            raise ValueError("metric name 'step' is reserved (pass the step as the step argument)")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {key!r} is not a number: {value!r}") from None
        if math.isinf(out[key]):
            raise ValueError(f"metric {key!r} is infinite at step {step}")
    return out


class MultiLogger:
    """Sends each step to every backend, in order; closes all of them even if one fails."""

    def __init__(self, loggers: list[MetricsLogger]):
        self.loggers = list(loggers)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = check_metrics(step, metrics)
        for logger in self.loggers:
            logger.log(step, clean)

    def close(self) -> None:
        errors = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:  # keep closing the others; report after
                errors.append(f"{type(logger).__name__}: {e}")
        if errors:
            raise RuntimeError("closing metric loggers failed: " + "; ".join(errors))
