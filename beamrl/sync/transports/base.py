"""Shared session bookkeeping for transports that drive `WeightReceiver`s.

Failure policy: any failed or timed-out engine call aborts the sync. Every engine that took part is then
marked unhealthy (it may hold a mix of old and new tensors, or sit in an open update session) and the
transport refuses to sync to it again; the RL loop must restart it. Nothing is ever resumed half-updated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from beamrl.sync.calls import ReceiverCallError, run_concurrently
from beamrl.protocols.weights import WeightReceiver, WeightSyncError
from beamrl.sync.protocol import WeightTransport

log = logging.getLogger(__name__)


class ReceiverTransport(WeightTransport):
    """A `WeightTransport` over a fixed list of receivers, with session state and health marks."""

    def __init__(self, receivers: Sequence[WeightReceiver]) -> None:
        if not receivers:
            raise ValueError(f"{type(self).__name__} needs at least one WeightReceiver")
        self.receivers = list(receivers)
        names = [r.name for r in self.receivers]
        # Labels name engines in errors and health marks; engine classes may share a default name.
        self.labels = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self.unhealthy: dict[str, str] = {}  # engine name -> why it must be restarted
        self.version: int | None = None  # version of the open session
        self._touched = False  # whether an engine call of the open session was issued

    # -- helpers -------------------------------------------------------------------------------------------
    def _call_all(self, what: str, call: Callable[[WeightReceiver], object], timeout: float,
                  extra: Sequence[tuple[str, Callable[[], object]]] = ()) -> None:
        """Call `call(receiver)` on every receiver concurrently (plus `extra` trainer-side calls)."""
        calls = [(label, (lambda r=r: call(r))) for label, r in zip(self.labels, self.receivers)] + list(extra)
        try:
            run_concurrently(what, calls, timeout)
        except ReceiverCallError as err:
            for who, msg in err.failures.items():
                if who in self.labels:
                    self.unhealthy.setdefault(who, msg)
            raise

    def mark_unhealthy(self, engine: str, reason: str) -> None:
        """Record that `engine` must not serve until restarted (e.g. a failed post-sync verification)."""
        self.unhealthy.setdefault(engine, reason)

    def _require_healthy(self) -> None:
        if self.unhealthy:
            detail = "; ".join(f"{k}: {v}" for k, v in self.unhealthy.items())
            raise WeightSyncError(f"refusing to sync: engine(s) marked unhealthy by an earlier failure must be "
                                  f"restarted first ({detail})")

    # -- lifecycle -------------------------------------------------------------------------------------------
    def begin(self, version: int, timeout: float) -> None:
        if self.version is not None:
            raise WeightSyncError(f"begin({version}): a sync to version {self.version} is still open; "
                                  f"finalize() or abort() it first")
        self._require_healthy()
        self.version, self._touched = version, False
        self._begin_engines(timeout)

    def _begin_engines(self, timeout: float) -> None:
        self._touched = True
        self._call_all("begin_weight_update", lambda r: r.begin_weight_update(timeout), timeout)

    def _require_session(self, op: str) -> int:
        if self.version is None:
            raise WeightSyncError(f"{op} outside a sync session; call begin(version) first")
        return self.version

    def finalize(self, timeout: float) -> None:
        version = self._require_session("finalize")
        self._touched = True
        self._call_all("end_weight_update", lambda r: r.end_weight_update(version, timeout), timeout)
        self.version = None

    def abort(self, reason: str) -> None:
        """Close the session locally; engines already touched are half-updated, so they are marked unhealthy."""
        if self._touched:
            for label in self.labels:
                self.mark_unhealthy(label, f"weight sync to version {self.version} aborted ({reason}); "
                                            f"the engine may hold partially updated weights")
        log.error("weight sync to version %s aborted: %s", self.version, reason)
        self.version, self._touched = None, False
