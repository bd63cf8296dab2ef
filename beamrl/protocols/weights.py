"""The engine side of the weight-sync seam: what a rollout engine implements to receive weights.

`WeightReceiver` mirrors SGLang 0.5.23's RL endpoints (sessions, tensor / distributed / disk updates, versions), so
the SGLang engines and the native engine are interchangeable behind the trainer-side transports (`beamrl.sync`),
and adds what exact verification needs: the session's manifest at `begin_weight_update`, each bucket's index and
raw-bit checksum, and `abort_weight_update` (roll back or stop serving). It lives here, beside the rollout
protocol, so that neither `beamrl.rollout` nor `beamrl.sync` has to import the other.
"""

from __future__ import annotations

import abc
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from beamrl.protocols.flat_bucket import FlatBucket
    from beamrl.protocols.manifest import SyncManifest


class WeightSyncError(RuntimeError):
    """A weight sync failed or timed out; the message names the engine and its reply."""


# What `abort_weight_update` reports became of the engine's weights.
ROLLED_BACK = "rolled back"  # the session's writes were undone: previous weights and version, still serving
UNHEALTHY = "unhealthy"  # the weights are partly updated: the engine refuses to serve until reloaded or restarted
UNTOUCHED = "untouched"  # nothing of the session was applied (or no session was open)


class PendingCall:
    """A receiver call already issued; `wait` returns its result or raises `WeightSyncError`. Transports issue
    the per-bucket calls this way and wait only when they need the bucket's staging buffer again."""

    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error

    def wait(self, timeout: float) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


class _ThreadCall(PendingCall):
    def __init__(self, who: str, what: str) -> None:
        super().__init__()
        self.who, self.what = who, what
        self.done = threading.Event()

    def wait(self, timeout: float) -> Any:
        if not self.done.wait(max(timeout, 0.0)):
            raise WeightSyncError(f"{self.who}: no reply to {self.what} within {round(timeout, 1):g} s (engine dead "
                                  f"or wedged)")
        return super().wait(timeout)


class _CallWorker:
    """Runs an in-process receiver's issued calls one after another on a daemon thread, so the issuer can wait
    with a timeout (a wedged receiver cannot hang it) and calls keep their issue order."""

    def __init__(self, who: str) -> None:
        self.who = who
        self._queue: "queue.SimpleQueue[tuple[_ThreadCall, Callable[[], Any]]]" = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"beamrl-receiver:{who}", daemon=True).start()

    def _run(self) -> None:
        while True:
            call, fn = self._queue.get()
            try:
                call._result = fn()
            except BaseException as exc:  # delivered by wait(), as a remote failure would be
                call._error = exc if isinstance(exc, WeightSyncError) else WeightSyncError(
                    f"{self.who}: {call.what}: {type(exc).__name__}: {exc}")
            call.done.set()

    def submit(self, what: str, fn: Callable[[], Any]) -> PendingCall:
        call = _ThreadCall(self.who, what)
        self._queue.put((call, fn))
        return call


class WeightReceiver(abc.ABC):
    """Engine-side weight-update API that transports drive (docs/weight-sync.md, "Receivers").

    Every method raises `WeightSyncError` (with the engine's message) on a refusal, a `success=False` reply or a
    timeout. Session rules (SGLang's): tensor and distributed updates only between `begin_weight_update` and
    `end_weight_update`; one session at a time; the served version changes only when a session ends."""

    @property
    def name(self) -> str:
        """Engine name used in error messages (override with e.g. 'sglang-0@host:port')."""
        return type(self).__name__

    @property
    @abc.abstractmethod
    def tp_size(self) -> int:
        """Number of engine TP ranks (one colocated payload per rank)."""

    @abc.abstractmethod
    def begin_weight_update(self, manifest: "SyncManifest", timeout: float) -> None:
        """Open a session for `manifest`. Refuses, before anything is applied, a version not newer than the one
        served, an unknown apply mode, and (checked against the engine's weight table) an unknown name, a wrong
        shape or dtype, or in mode `full` a missing tensor."""

    @abc.abstractmethod
    def update_weights_from_tensor(self, bucket: "FlatBucket", timeout: float) -> None:
        """Colocated path: one flattened bucket (`beamrl.protocols.flat_bucket.FlatBucket`) with its `index` and
        `checksum`. It must be the session's next bucket, laid out as the manifest says, with intact bytes. The
        SGLang adapter serializes it into SGLang's `flattened_bucket` payload, one per engine TP rank (CUDA-IPC
        handles on GPU); the native engine copies from it. flush_cache=False per bucket."""

    @abc.abstractmethod
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str, timeout: float) -> None: ...

    @abc.abstractmethod
    def update_weights_from_distributed(self, index: int, checksum: tuple[int, int], group_name: str,
                                        timeout: float) -> None:
        """Bucket `index` of the session arrives as one uint8 broadcast from rank 0 of the group, laid out as the
        manifest says (`FlatBucket.empty`, identical to SGLang's `FlattenedTensorBucket.empty`; SGLang itself is
        told the names, dtypes and shapes). The receiver joins the broadcast; rank 0 broadcasts concurrently."""

    @abc.abstractmethod
    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None: ...

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        """Load a full checkpoint (no session; SGLang's own loader). Also the way back to serving after a session
        that left the engine unhealthy."""

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        """Set the served weight version outside a session (after `update_weights_from_disk`; SGLang:
        `POST /update_weight_version`). Receivers that support the disk transport override it."""
        raise WeightSyncError(f"{self.name}: update_weight_version is not implemented, so the disk transport "
                              f"cannot version this engine")

    @abc.abstractmethod
    def end_weight_update(self, new_version: int, timeout: float) -> None:
        """Commit the session: every announced bucket must have arrived and passed its checks (checks a receiver
        deferred, e.g. on-device checksum comparisons, are settled here); then serve `new_version` (the manifest's)
        and flush the prefix cache. A failed commit is handled as `abort_weight_update` and raises."""

    @abc.abstractmethod
    def abort_weight_update(self, reason: str, timeout: float) -> str:
        """Close the session without serving its version. A receiver with an undo log restores the weights it
        overwrote in this session (and keeps serving the previous version); one without stops serving until its
        weights are reloaded (`update_weights_from_disk`) or it is restarted. Returns `ROLLED_BACK`, `UNHEALTHY`
        or `UNTOUCHED` (also outside a session)."""

    def served_weight_version(self, timeout: float) -> int:
        """The weight version the engine serves now (engines also implement `RolloutEngine.weight_version`)."""
        return int(getattr(self, "weight_version"))

    def served_version_after_commit(self, timeout: float) -> int:
        """The version the engine served right after this receiver's last successful `end_weight_update` (the
        orchestrator's version check). Here a fresh `served_weight_version`; a proxy whose calls run in issue order
        reads it together with the commit, in the same round trip."""
        return self.served_weight_version(timeout)

    #: Whether direct calls and `call_async` calls run on the engine in the order they were issued (a proxy that
    #: sends every call down one ordered channel). The orchestrator then issues the next call of a sync without
    #: waiting for the reply to the one before it (the pause before `begin_weight_update`).
    calls_in_issue_order: bool = False

    #: Whether every blocking call returns or raises within its `timeout` (plus its channel's slack) by itself: a
    #: proxy whose calls are `PendingCall` waits. A caller may then make such a call in its own thread, where it
    #: would otherwise start a thread per call to keep its deadline (`beamrl.sync.calls.run_concurrently`).
    bounded_calls: bool = False

    # -- staged buckets: persistent shared buffers, small messages per bucket (optional) -----------------------
    def staging_supported(self, timeout: float) -> bool:
        """Whether this receiver takes staged buckets (`attach_staging` / `load_staged_bucket`)."""
        return False

    def attach_staging(self, slots: list, timeout: float) -> list:
        """Open the sender's shared staging buffers once (`beamrl.sync.staging.SlotHandle`s; CUDA-IPC handles on
        GPU, shared memory on CPU) and keep them open; returns, per slot, what the sender waits on before it
        reuses the slot (an IPC event handle on GPU, None on CPU)."""
        raise WeightSyncError(f"{self.name}: staged buckets are not supported")

    def load_staged_bucket(self, slot: int, index: int, timeout: float) -> None:
        """Bucket `index` of the session is packed in staging slot `slot`, its checksum in the slot's trailer."""
        raise WeightSyncError(f"{self.name}: staged buckets are not supported")

    def detach_staging(self, timeout: float) -> None:
        """Close the staging buffers opened by `attach_staging` (idempotent)."""

    # -- pipelining ------------------------------------------------------------------------------------------
    def call_async(self, method: str, timeout: float, *args: Any) -> PendingCall:
        """Issue `method(*args, timeout)` and return at once; calls issued this way run in issue order. A proxy
        sends it to the engine's process; an in-process receiver runs it on its own worker thread."""
        worker = self.__dict__.get("_beamrl_call_worker")
        if worker is None:
            worker = self.__dict__["_beamrl_call_worker"] = _CallWorker(self.name)
        return worker.submit(method, lambda: getattr(self, method)(*args, timeout))
