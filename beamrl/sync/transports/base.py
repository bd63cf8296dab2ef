"""The trainer side of the weight-sync seam: `WeightTransport`, and `ReceiverTransport`, its shared bookkeeping over a
list of `WeightReceiver`s (sessions, staging buffers, pipelined calls, health).

Lifecycle of one sync, driven by the orchestrator (`beamrl.sync.orchestrator.WeightSync`):
`connect` (once) -> `begin(manifest)` -> per bucket `buffer(k)` (where the orchestrator packs bucket k, with
`beamrl.sync.packing.pack_bucket`) then `send(k)` -> `finalize()` (or `abort(reason)` after any failure).

`send` may return before the engines have loaded the bucket (the calls are pipelined); a transport waits for a
buffer's earlier calls only when it hands that buffer out again, and for all of them in `finalize`.

Failure policy: any failed or timed-out engine call fails the sync; the orchestrator then calls `abort`, which
asks every engine to abort its session (`abort_weight_update`: the engine rolls back or stops serving). An engine
that cannot answer, or reports that it stopped serving, is marked unhealthy, and the transport refuses to sync to
it again until it is restarted. Nothing is ever resumed half-updated and silent.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from beamrl.protocols.checksum import bucket_checksum
from beamrl.protocols.manifest import FULL, BucketLayout, SyncManifest
from beamrl.protocols.weights import UNHEALTHY, PendingCall, WeightReceiver, WeightSyncError
from beamrl.sync.calls import ReceiverCallError, bounded, check_reply, run_concurrently, wait_replies
from beamrl.sync.packing import BucketChecksum, bucket_views

#: Packing views cached per staging slot (a few plans' worth: full and adapter layouts alternate in a LoRA run).
_MAX_CACHED_VIEWS = 4096
from beamrl.sync.staging import StagingSlot, receiver_event

log = logging.getLogger(__name__)

#: Staging memory that buys pipeline depth when buckets are small: a small bucket's fixed per-bucket host cost (the
#: engine's call, its launches) is hidden only if more buckets are in flight (on the H200 at 64 MiB, 4 slots gave
#: 158 GB/s where 2 gave 139: docs/benchmarks.md). Large buckets keep 2 slots (double buffering).
STAGING_BUDGET_BYTES = 256 << 20


def auto_staging_slots(bucket_bytes: int) -> int:
    """Slots for buckets of `bucket_bytes`: as many as fit `STAGING_BUDGET_BYTES`, at least 2 and at most 4."""
    return max(2, min(4, STAGING_BUDGET_BYTES // max(bucket_bytes, 1)))


@dataclass
class PackTarget:
    """Where bucket `index` is packed: `buffer` (uint8, exactly the bucket's bytes) and the cached packing views."""

    index: int
    buffer: torch.Tensor
    views: list[torch.Tensor]
    checksum: BucketChecksum | None = None  # where the packer also writes the bucket's checksum (staging slots)


class WeightTransport(abc.ABC):
    """Moves packed buckets into one or more engines (module docstring)."""

    name: str = "abstract"
    device: torch.device = torch.device("cpu")
    #: What this transport checks of the bytes the engines load, as the sync's console summary says it.
    content_check: str = "checksums verified"

    @abc.abstractmethod
    def connect(self, timeout: float) -> None:
        """Set up channels (e.g. the NCCL/gloo update group). Idempotent."""

    @abc.abstractmethod
    def begin(self, manifest: SyncManifest, timeout: float) -> None:
        """Open the engines' weight-update session for `manifest` (engines paused and idle). It may return before
        the engines answered (`ReceiverTransport`: where their calls run in issue order); `send` and `finalize` then
        wait for the answers first, so no bucket goes out before every engine accepted the manifest."""

    @abc.abstractmethod
    def buffer(self, bucket: BucketLayout, timeout: float) -> PackTarget:
        """The buffer to pack `bucket` into (waits until its earlier use is done)."""

    @abc.abstractmethod
    def send(self, bucket: BucketLayout, timeout: float) -> None:
        """Ship the bucket packed into `buffer(bucket)`; raise `WeightSyncError` on any engine failure seen."""

    @abc.abstractmethod
    def finalize(self, timeout: float) -> None:
        """Wait for every bucket, then commit the session: the engines serve the manifest's version."""

    @abc.abstractmethod
    def abort(self, reason: str, timeout: float) -> None:
        """Leave the session after a failure; the engines roll back or stop serving (never half-updated)."""

    def close(self) -> None:
        """Tear down channels and buffers."""

    def release_buffers(self, timeout: float) -> None:
        """Free the staging buffers between syncs (a colocated trainer going to sleep); the next `begin` makes and
        shares new ones. Channels stay up."""

    def discard_buffers(self) -> None:
        """The run is ending: free the staging buffers without calling the engines (they may be gone already), so
        no shared-memory file outlives this process, and whatever else the transport wrote for the run (the disk
        transport's checkpoints)."""


class ReceiverTransport(WeightTransport):
    """A `WeightTransport` over a fixed list of receivers: session state, staging slots, health marks.

    `staging_slots`: buffers packed in turn (2 = pack bucket k+1 while the engines load bucket k); None: as many as
    fit `STAGING_BUDGET_BYTES`, between 2 and 4 (`auto_staging_slots`)."""

    def __init__(self, receivers: Sequence[WeightReceiver], device: str | torch.device = "cpu",
                 staging_slots: int | None = None) -> None:
        if not receivers:
            raise ValueError(f"{type(self).__name__} needs at least one WeightReceiver")
        if staging_slots is not None and staging_slots < 1:
            raise ValueError(f"staging_slots must be >= 1, got {staging_slots}")
        self.receivers = list(receivers)
        names = [r.name for r in self.receivers]
        # Labels name engines in errors and health marks; engine classes may share a default name.
        self.labels = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self.device = torch.device(device)
        self.num_slots = staging_slots
        self.unhealthy: dict[str, str] = {}  # engine label -> why it must be restarted
        self.manifest: SyncManifest | None = None  # of the open session
        self._touched = False  # whether an engine call of the open session was issued
        self._slots: list[StagingSlot] = []
        self._shared_slots = False  # whether receivers read the slots directly (staged buckets)
        self._sent_digest: dict[str, str] = {}  # engine label -> the `full` layout it accepted last
        self._bounded = bounded(self.receivers)  # a single engine's calls then run in the caller's thread
        self._opening: list[tuple[str, WeightReceiver, bool, PendingCall]] = []  # begin calls not yet answered

    # -- helpers -------------------------------------------------------------------------------------------
    def _call_all(self, what: str, call: Callable[[WeightReceiver], object], timeout: float,
                  extra: Sequence[tuple[str, Callable[[], object]]] = ()) -> None:
        """Call `call(receiver)` on every receiver concurrently (plus `extra` trainer-side calls)."""
        calls = [(label, (lambda r=r: call(r))) for label, r in zip(self.labels, self.receivers)] + list(extra)
        run_concurrently(what, calls, timeout, bounded_calls=not extra and self._bounded)

    def _issue(self, method: str, timeout: float, *args) -> list[tuple[str, PendingCall]]:
        """Issue `method(*args, timeout)` on every receiver without waiting (pipelined, in issue order)."""
        self._touched = True
        return [(label, r.call_async(method, timeout, *args)) for label, r in zip(self.labels, self.receivers)]

    def mark_unhealthy(self, engine: str, reason: str) -> None:
        """Record that `engine` must not serve until restarted (e.g. a failed post-sync verification)."""
        self.unhealthy.setdefault(engine, reason)

    def _require_healthy(self) -> None:
        if self.unhealthy:
            detail = "; ".join(f"{k}: {v}" for k, v in self.unhealthy.items())
            raise WeightSyncError(f"refusing to sync: engine(s) marked unhealthy by an earlier failure must be "
                                  f"restarted first ({detail})")

    def _require_session(self, op: str) -> SyncManifest:
        if self.manifest is None:
            raise WeightSyncError(f"{op} outside a sync session; call begin(manifest) first")
        return self.manifest

    # -- slots ---------------------------------------------------------------------------------------------
    def _use_shared_slots(self, timeout: float) -> bool:
        """Whether the receivers read buckets straight from shared slots (colocated staged buckets)."""
        return False

    def _ensure_slots(self, manifest: SyncManifest, timeout: float) -> None:
        need = max(b.nbytes for b in manifest.buckets)
        shared = self._use_shared_slots(timeout)
        count = self.num_slots or auto_staging_slots(need)
        if (self._slots and self._slots[0].capacity >= need and self._shared_slots == shared
                and len(self._slots) == count):
            return
        self._drop_slots(timeout)
        self._slots = [StagingSlot(i, need, self.device, shared=shared) for i in range(count)]
        self._shared_slots = shared
        if shared:
            handles = [s.handle() for s in self._slots]
            replies: dict[int, list] = {}

            def attach(i: int, r: WeightReceiver) -> None:
                replies[i] = r.attach_staging(handles, timeout)

            run_concurrently("attach_staging", [(label, (lambda i=i, r=r: attach(i, r)))
                                                for i, (label, r) in enumerate(zip(self.labels, self.receivers))],
                             timeout, bounded_calls=self._bounded)
            for s in self._slots:
                s.receiver_events = [receiver_event(replies[i][s.index], self.device) for i in range(len(self.receivers))]

    def _drop_slots(self, timeout: float, detach: bool = True) -> None:
        """Close the staging slots (a CPU slot's shared-memory file is removed); with `detach`, the engines are asked
        to let go of shared slots first."""
        if detach and self._shared_slots and self._slots:
            try:
                self._call_all("detach_staging", lambda r: r.detach_staging(timeout), timeout)
            except WeightSyncError as err:
                log.error("could not detach staging buffers: %s", err)
        for s in self._slots:
            s.close()
        self._slots, self._shared_slots = [], False

    def _slots_in_bucket_order(self) -> list[StagingSlot]:
        return sorted(self._slots, key=lambda s: -1 if s.last_bucket is None else s.last_bucket)

    def _slot(self, index: int) -> StagingSlot:
        return self._slots[index % len(self._slots)]

    def _wait_slot(self, slot: StagingSlot, timeout: float) -> None:
        """Wait for the receivers' calls on `slot` (host) and for their copies out of it (device)."""
        pending, slot.pending = slot.pending, []
        if pending:
            wait_replies(f"bucket {slot.last_bucket}", pending, time.monotonic() + timeout)
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for ev in slot.receiver_events:
                if ev is not None:
                    stream.wait_event(ev)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def begin(self, manifest: SyncManifest, timeout: float) -> None:
        if self.manifest is not None:
            raise WeightSyncError(f"begin(version {manifest.version}): a sync to version {self.manifest.version} is "
                                  f"still open; finalize() or abort() it first")
        self._require_healthy()
        self._ensure_slots(manifest, timeout)
        self.manifest, self._touched = manifest, False
        self._begin_engines(manifest, timeout)

    def _begin_engines(self, manifest: SyncManifest, timeout: float) -> None:
        """Open every engine's session. An engine that accepted this `full` layout before gets it by digest only
        (`SyncManifest.reference`; a 501B layout is ~38K tensors, pickled to every engine every step); one that
        refuses the reference (e.g. restarted behind the same proxy) is sent the full manifest, whose checks then
        decide. Where every engine runs calls in issue order the calls are only issued (the trainer packs the first
        bucket meanwhile); `_await_begin` takes the answers before anything else goes to the engines."""
        self._touched = True
        reference = manifest.reference() if manifest.mode == FULL else None
        if all(r.calls_in_issue_order for r in self.receivers):
            for label, r in zip(self.labels, self.receivers):
                by_digest = reference is not None and self._sent_digest.get(label) == manifest.digest
                self._opening.append((label, r, by_digest, r.call_async("begin_weight_update", timeout,
                                                                        reference if by_digest else manifest)))
            return

        def begin(label: str, r: WeightReceiver) -> None:
            by_digest = reference is not None and self._sent_digest.get(label) == manifest.digest
            self._open_session(label, r, manifest, by_digest, timeout, lambda: check_reply(
                r.begin_weight_update(reference if by_digest else manifest, timeout)))

        run_concurrently("begin_weight_update", [(label, (lambda label=label, r=r: begin(label, r)))
                                                 for label, r in zip(self.labels, self.receivers)], timeout,
                         bounded_calls=self._bounded)

    def _await_begin(self, timeout: float) -> None:
        """The engines' answers to the `begin_weight_update` calls `_begin_engines` issued (none: returns at once),
        with the same fallback and the same failure as the waited path: an engine refusing the digest-only manifest
        gets the full one; every refusal is named in one `ReceiverCallError`. Called before the first bucket is sent
        and at `finalize`."""
        opening, self._opening = self._opening, []
        if not opening:
            return
        manifest = self._require_session("begin")
        deadline = time.monotonic() + timeout
        failures: dict[str, str] = {}
        for label, r, by_digest, call in opening:
            try:
                self._open_session(label, r, manifest, by_digest, timeout,
                                   lambda call=call: check_reply(call.wait(max(deadline - time.monotonic(), 1e-3))))
            except WeightSyncError as err:
                failures[label] = str(err)
        if failures:
            raise ReceiverCallError("begin_weight_update", failures)

    def _open_session(self, label: str, r: WeightReceiver, manifest: SyncManifest, by_digest: bool, timeout: float,
                      first_answer) -> None:
        """One engine's `begin_weight_update`, waited path or issued one alike: `first_answer()` takes the answer to
        the begin sent first (the digest-only reference when `by_digest`). An engine refusing the reference gets the
        full manifest, with its own `timeout` (the first answer may have used up the first one's); a refusal of that
        raises naming both. Nothing else was issued to the engine in between: its session opens now or is refused."""
        try:
            first_answer()
        except WeightSyncError as err:
            if not by_digest:
                raise
            log.info("%s refused the manifest by digest (%s); sending it in full", label, err)
            self._sent_digest.pop(label, None)
            try:
                check_reply(r.begin_weight_update(manifest, timeout))
            except WeightSyncError as full:
                raise WeightSyncError(f"{full} (after the digest-only manifest failed: {err})") from None
        if manifest.mode == FULL:
            self._sent_digest[label] = manifest.digest

    def buffer(self, bucket: BucketLayout, timeout: float) -> PackTarget:
        self._require_session("buffer")
        slot = self._slot(bucket.index)
        self._wait_slot(slot, timeout)
        # Keyed by the layout object, which the entry keeps alive: an id alone is reused once a plan is freed (a
        # new bucket size, or a full sync after an adapter sync), and stale views pack the wrong tensors (seen on
        # the H200: "Tensor lists must have the same number of tensors, got 2 and 20").
        cached = slot.views.get(id(bucket))
        if cached is None or cached[0] is not bucket:
            if len(slot.views) >= _MAX_CACHED_VIEWS:
                slot.views.clear()
            cached = slot.views[id(bucket)] = (bucket, bucket_views(slot.buffer, bucket))
        checksum = None
        if self._packer_checksums():
            checksum = slot.packed
            checksum.bucket = None  # set by `pack_bucket` once it wrote this bucket's checksum
        return PackTarget(bucket.index, slot.payload(bucket.nbytes), cached[1], checksum)

    def send(self, bucket: BucketLayout, timeout: float) -> None:
        """Ship the bucket packed into `buffer(bucket)`: only inside a session, and only once every engine accepted
        its manifest (`_await_begin`; the begin calls may still be in flight), then the transport's own `_send`."""
        self._require_session("send")
        self._await_begin(timeout)
        self._send(bucket, timeout)

    @abc.abstractmethod
    def _send(self, bucket: BucketLayout, timeout: float) -> None:
        """The transport's part of `send` (session open, every engine's begin answered)."""

    def _packer_checksums(self) -> bool:
        """Whether `buffer` asks the packer for the bucket's checksum into the slot's trailer (`_checksum_into_trailer`
        then has nothing left to do): transports whose receivers read the trailer say yes."""
        return False

    def _checksum_into_trailer(self, slot: StagingSlot, bucket: BucketLayout) -> None:
        if slot.packed.bucket != bucket.index:  # packed without its checksum (a caller of pack_bucket's own)
            bucket_checksum(slot.checked(bucket.nbytes), out=slot.trailer)
        slot.last_bucket = bucket.index

    def finalize(self, timeout: float) -> None:
        manifest = self._require_session("finalize")
        deadline = time.monotonic() + timeout
        self._await_begin(timeout)
        for slot in self._slots_in_bucket_order():  # the earliest bucket's failure is the one reported
            self._wait_slot(slot, max(deadline - time.monotonic(), 1e-3))
        self._before_commit()
        self._touched = True
        try:
            self._call_all("end_weight_update", lambda r: r.end_weight_update(manifest.version, timeout), timeout)
        except ReceiverCallError as err:
            for who, msg in err.failures.items():
                self.mark_unhealthy(who, f"commit of version {manifest.version} failed: {msg}")
            self.manifest = None
            raise
        self.manifest = None

    def _before_commit(self) -> None:
        """After every bucket's engine calls were waited for, before the commit (a transport's own last check)."""

    def abort(self, reason: str, timeout: float) -> None:
        """Ask every engine to abort its session; mark those that stop serving or do not answer unhealthy."""
        version = self.manifest.version if self.manifest is not None else None
        log.error("weight sync to version %s aborted: %s", version, reason)
        deadline = time.monotonic() + timeout
        for _, _, _, call in self._opening:  # begin calls never waited for: their answers are behind us now
            try:
                call.wait(max(deadline - time.monotonic(), 1e-3))
            except WeightSyncError:
                pass
        self._opening = []
        for slot in self._slots:  # let calls in flight finish (their failures are what we are handling)
            try:
                self._wait_slot(slot, max(deadline - time.monotonic(), 1e-3))
            except WeightSyncError:
                pass
        # Every engine is asked, also when begin failed early: a dead or wedged one is found (and marked) here.
        outcomes: dict[str, object] = {}

        def ask(label: str, r: WeightReceiver) -> None:
            outcomes[label] = r.abort_weight_update(reason, timeout)

        try:
            run_concurrently("abort_weight_update", [(label, (lambda label=label, r=r: ask(label, r)))
                                                     for label, r in zip(self.labels, self.receivers)],
                             max(deadline - time.monotonic(), 1.0), fail_fast=False, bounded_calls=self._bounded)
        except ReceiverCallError as err:
            for who, msg in err.failures.items():
                self.mark_unhealthy(who, f"weight sync to version {version} aborted ({reason}) and the engine "
                                         f"did not abort its session cleanly: {msg}")
        for who, outcome in outcomes.items():
            if outcome == UNHEALTHY:
                self.mark_unhealthy(who, f"weight sync to version {version} aborted ({reason}); the engine "
                                         f"holds partially updated weights and does not serve")
        self.manifest, self._touched = None, False

    def close(self) -> None:
        self._drop_slots(10.0)

    def discard_buffers(self) -> None:
        self._drop_slots(0.0, detach=False)
        # An open session cannot go on without its slots: it ends here (the engines are not told; they may be gone).
        self.manifest, self._opening, self._touched = None, [], False

    def release_buffers(self, timeout: float) -> None:
        if self.manifest is not None:
            raise WeightSyncError("release_buffers during an open sync session")
        self._drop_slots(timeout)
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # blocks the engines had opened by CUDA IPC are freed once they detached
