"""`Timer`: named wall-clock sections (rollout, train, sync) reported as 'time/<name>_s' metrics."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator


class Timer:
    """Accumulates seconds per name within a step: `with timer("rollout"): ...`; `pop()` returns and resets."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self._seconds[name] += self._clock() - start

    def seconds(self, name: str) -> float:
        return self._seconds.get(name, 0.0)

    def pop(self) -> dict[str, float]:
        """{'time/<name>_s': seconds} for every section since the last pop."""
        out = {f"time/{name}_s": s for name, s in self._seconds.items()}
        self._seconds.clear()
        return out
