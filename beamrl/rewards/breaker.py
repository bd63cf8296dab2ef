"""A circuit breaker for one reward component within one batch.

It counts consecutive expensive failures: timeouts (each costs a per-call timeout) and crashes (each costs a
worker restart). A call that returns, even with an exception or a bad value, resets the count: it failed
quickly. After `trip_after` in a row the breaker trips and the component's remaining calls of the batch are
skipped. `reset()` closes it again at the start of the next batch, so a component that recovered is used again.
"""

from __future__ import annotations


class CircuitBreaker:
    """trip_after: consecutive timeouts or crashes that trip it (0: never trips).

    Example:
        >>> b = CircuitBreaker(2)
        >>> b.record_failure("timed out"), b.record_success(), b.record_failure("a"), b.record_failure("b")
        (False, None, False, True)
        >>> b.tripped, b.reason
        (True, 'a')
    """

    def __init__(self, trip_after: int) -> None:
        if trip_after < 0:
            raise ValueError(f"trip_after={trip_after} must be >= 0")
        self.trip_after = trip_after
        self.reset()

    def reset(self) -> None:
        """Close the breaker (start of a batch)."""
        self.consecutive = 0
        self.tripped = False
        self.reason: str | None = None  # the first failure of the run that tripped it
        self._first: str | None = None

    def record_success(self) -> None:
        """A call returned (a score, None, an exception or a bad value): the run of failures ends."""
        if not self.tripped:
            self.consecutive, self._first = 0, None

    def record_failure(self, message: str) -> bool:
        """A timeout or a crash; True when this one trips the breaker."""
        if self.tripped:
            return False
        self.consecutive += 1
        if self._first is None:
            self._first = message
        if self.trip_after and self.consecutive >= self.trip_after:
            self.tripped, self.reason = True, self._first
            return True
        return False
