"""A `WeightReceiver` for a model living in this process (the native engine, benchmarks, tests).

It follows SGLang 0.5.23's session rules (updates only inside a session, one session at a time, the version
changes only when it ends) and adds exact verification (`ReceiveSession`): the manifest is checked at `begin`
against the model's weight table, every bucket's index, layout and raw-bit checksum before it is committed.

Buckets arrive three ways, all copied into the parameters with `packing.copy_tensors` (batched) from typed views of the
bucket (cached per staging slot and bucket):
- `update_weights_from_tensor(FlatBucket)` (SGLang's colocated payload);
- `load_staged_bucket(slot, index)`: the bucket is in a staging slot shared once (`beamrl.sync.staging`); on GPU
  this is asynchronous (stream-ordered by CUDA events, checksums compared on the device and settled at commit);
- `update_weights_from_distributed(index, checksum, group)`: one uint8 broadcast from rank 0 of an update group.

Failure policy (docs/weight-sync.md, "Failures"): with `rollback` (default on CPU, where host copies are cheap)
every tensor a session overwrites is first copied to host memory (`UndoLog`), and an aborted or failed session
restores them, so the engine keeps its previous weights and version and goes on serving. Without it (default on
GPU: at 501B an undo log is a full model copy through PCIe every step) a session that failed after touching the
weights leaves the receiver `failure` set: its engine refuses to serve until `update_weights_from_disk` reloads
every weight or it is restarted. A session refused before any bucket was applied changes nothing.

Apply modes: `targets` maps a manifest mode to an `ApplyTarget` (where a mode's tensors go); `full` is the model's
parameters. Another mode (LoRA's adapters) plugs in its own target (docs/weight-sync.md, "Export sources").
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

from beamrl.protocols.flat_bucket import FlatBucket, TensorMeta
from beamrl.protocols.manifest import FULL, SyncManifest
from beamrl.protocols.weights import ROLLED_BACK, UNHEALTHY, UNTOUCHED, WeightReceiver, WeightSyncError
from beamrl.sync.packing import bucket_views, copy_tensors, unpack_bucket
from beamrl.sync.receive_session import ManifestCache, ReceiveSession, UndoLog, WeightTable
from beamrl.sync.update_group import destroy_update_group, init_update_group


class ApplyTarget(abc.ABC):
    """Where the tensors of one apply mode go in a receiver."""

    #: True when `destinations` are staging buffers of the target, not the weights: writing them changes nothing
    #: the engine serves until `commit` (so they need no undo log, and a failed session leaves the weights untouched).
    staged: bool = False

    @abc.abstractmethod
    def table(self) -> WeightTable:
        """Every tensor this mode accepts: name -> (shape, dtype)."""

    @abc.abstractmethod
    def destinations(self, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
        """The tensors to copy each non-empty tensor of a bucket into (same order, dtypes and shapes as `metas`)."""

    def commit(self) -> None:
        """After a session of this mode committed (e.g. merge staged adapters into the weights)."""

    def discard(self) -> None:
        """After a session of this mode was aborted."""


class ModelWeights(ApplyTarget):
    """Mode `full`: a model's parameters under their HF names (the reference `BeamForCausalLM`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._params: dict[str, torch.nn.Parameter] = {}

    def table(self) -> WeightTable:
        self._params = dict(self.model.named_parameters())  # walking the modules is slow: once per new layout
        return {n: (tuple(p.shape), p.dtype) for n, p in self._params.items()}

    def destinations(self, metas: tuple[TensorMeta, ...]) -> list[torch.Tensor]:
        params = self._params or dict(self.model.named_parameters())
        return [params[m.name].data for m in metas if m.end > m.start]

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_hf_tensors(state, strict=True)  # validates every tensor before copying any


class LocalWeightReceiver(WeightReceiver):
    """Applies weight updates to an in-process model (module docstring)."""

    def __init__(self, model: torch.nn.Module, name: str = "local", initial_version: int = 0,
                 rollback: bool | None = None, targets: Mapping[str, ApplyTarget] | None = None,
                 defer_checks: bool | None = None) -> None:
        """`rollback` (None: on CPU): keep an undo log per session. `defer_checks` (None: on CUDA): compare bucket
        checksums on the device and settle them at commit instead of before each bucket is applied."""
        self.model = model
        self._name = name
        self.device = next(model.parameters()).device
        self.weight_version = initial_version
        self.rollback = self.device.type == "cpu" if rollback is None else bool(rollback)
        self.defer_checks = self.device.type == "cuda" if defer_checks is None else bool(defer_checks)
        self.targets: dict[str, ApplyTarget] = {FULL: ModelWeights(model), **(targets or {})}
        self.failure: str | None = None  # set when a failed session left the weights partly updated
        # set (why) while the weights hold no values at all (dropped by a memory release without a host copy): the
        # engine must not serve until a committed `full` session or a disk load replaced every weight
        self.unloaded: str | None = None
        self._session: ReceiveSession | None = None
        self._session_error: str | None = None  # a refused bucket: the session can only be aborted
        self._touched = False  # whether this session wrote into the weights
        self._undo: UndoLog | None = None
        self._manifests = ManifestCache()
        self._dst: dict[int, list[torch.Tensor]] = {}  # copy targets per bucket, for one session only
        self._slots: list = []
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._lock = threading.Lock()  # engine calls are serialised, as SGLang's scheduler does

    @property
    def name(self) -> str:
        return self._name

    @property
    def tp_size(self) -> int:
        return 1

    @property
    def in_session(self) -> bool:
        return self._session is not None

    @property
    def _defer(self) -> bool:
        return self.defer_checks

    # -- session -------------------------------------------------------------------------------------------
    def begin_weight_update(self, manifest: SyncManifest, timeout: float) -> None:
        with self._lock:
            if self._session is not None:
                raise WeightSyncError(f"{self._name}: a weight-update session is already open")
            tables = lambda: {mode: t.table() for mode, t in self.targets.items()}  # noqa: E731
            self._session = ReceiveSession(self._name, manifest, self.weight_version, tables, self._manifests)
            self._session_error, self._dst, self._touched = None, {}, False
            self._undo = UndoLog() if self.rollback else None

    def _require_session(self, op: str) -> ReceiveSession:
        if self._session is None:
            raise WeightSyncError(f"{self._name}: {op} must run between begin_weight_update() and "
                                  f"end_weight_update()")
        if self._session_error is not None:
            raise WeightSyncError(f"{self._name}: {op} refused: this session already failed "
                                  f"({self._session_error}); abort it")
        return self._session

    def _apply(self, index: int, src: list[torch.Tensor], rows: torch.Tensor | None = None,
               checksum_out: torch.Tensor | None = None) -> None:
        """Copy bucket `index` (`src`: its views) into its destinations; with `checksum_out`, also checksum the
        bucket's `rows` into it (`unpack_bucket`: one pass on CUDA)."""
        session = self._session
        # Copy targets are looked up once per session, never kept across sessions: a parameter's storage may be
        # replaced between syncs (memory release/resume on GPU), and a stale target would be written silently.
        dst = self._dst.get(index)
        if dst is None:
            dst = self._dst[index] = self.targets[session.manifest.mode].destinations(session.manifest.bucket(index).metas)
        if not self.targets[session.manifest.mode].staged:
            if self._undo is not None:
                self._undo.save(dst)
            self._touched = True
        if checksum_out is not None:
            unpack_bucket(rows, session.manifest.bucket(index), dst, src, checksum_out)
        elif dst:
            copy_tensors(dst, src)
        session.advance()

    def _guarded(self, op: str, fn) -> None:
        """Run a bucket operation; a refusal fails the session (it can then only be aborted)."""
        session = self._require_session(op)
        try:
            fn(session)
        except Exception as exc:
            msg = str(exc) if isinstance(exc, WeightSyncError) else f"{op} failed: {type(exc).__name__}: {exc}"
            self._session_error = msg
            raise WeightSyncError(msg if msg.startswith(self._name) else f"{self._name}: {msg}") from exc

    def update_weights_from_tensor(self, bucket: FlatBucket, timeout: float) -> None:
        def run(session: ReceiveSession) -> None:
            if bucket.index is None or bucket.checksum is None:
                raise WeightSyncError(f"{self._name}: a bucket must carry its index and checksum")
            layout = session.expect(bucket.index)
            session.check_layout(bucket.index, bucket.metas)
            session.check_checksum(bucket.index, bucket.buffer, bucket.checksum, defer=self._defer)
            self._apply(bucket.index, bucket_views(bucket.buffer, layout))
            if self.device.type == "cuda":
                # Reply once the copies are done: the sender reuses its buffer when the call returns.
                torch.cuda.synchronize(self.device)

        with self._lock:
            self._guarded("update_weights_from_tensor", run)

    def update_weights_from_distributed(self, index: int, checksum: tuple[int, int], group_name: str,
                                        timeout: float) -> None:
        def run(session: ReceiveSession) -> None:
            layout = session.expect(index)
            pg = self._groups.get(group_name)
            if pg is None:
                raise WeightSyncError(f"{self._name}: update group {group_name!r} not initialised "
                                      f"(have {sorted(self._groups)})")
            bucket = FlatBucket.empty(layout.names, layout.dtypes, layout.shapes, self.device)
            dist.broadcast(bucket.buffer, src=0, group=pg)
            session.check_checksum(index, bucket.buffer, checksum, defer=self._defer)
            self._apply(index, bucket_views(bucket.buffer, layout))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        with self._lock:
            self._guarded("update_weights_from_distributed", run)

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        with self._lock:
            session = self._session
            if session is None:
                raise WeightSyncError(f"{self._name}: no weight-update session is open; call "
                                      f"begin_weight_update() first")
            try:
                if self._session_error is not None:
                    raise WeightSyncError(self._session_error)
                if int(new_version) != session.version:
                    raise WeightSyncError(f"{self._name}: end_weight_update({new_version}) but the session's "
                                          f"manifest is for version {session.version}")
                session.settle()
                self.targets[session.manifest.mode].commit()  # a staged target may still refuse (nothing applied)
            except Exception as exc:
                outcome = self._abort(str(exc))
                raise WeightSyncError(f"{self._name}: session closed without serving version {new_version} "
                                      f"({outcome}): {exc}") from None
            if session.manifest.mode == FULL:
                self.failure = self.unloaded = None  # every weight was replaced
            self.weight_version = session.version
            self._close()

    def abort_weight_update(self, reason: str, timeout: float) -> str:
        """Returns what became of the weights: 'rolled back', 'unhealthy' or 'untouched' (no session: 'untouched')."""
        with self._lock:
            if self._session is None:
                return UNTOUCHED
            return self._abort(reason)

    def _abort(self, reason: str) -> str:
        session = self._session
        if self._undo is not None and len(self._undo):
            self._undo.restore()
            outcome = ROLLED_BACK
        elif self._touched:
            self.failure = (f"weight sync to version {session.version} failed after {session.next_index} "
                            f"bucket(s) were applied ({reason}); the weights are partly updated")
            outcome = UNHEALTHY
        else:
            outcome = UNTOUCHED
        self.targets[session.manifest.mode].discard()
        self._close()
        return outcome

    def _close(self) -> None:
        self._session, self._session_error, self._undo, self._dst = None, None, None, {}

    # -- staged buckets ------------------------------------------------------------------------------------
    def staging_supported(self, timeout: float) -> bool:
        return True

    def attach_staging(self, slots: list, timeout: float) -> list:
        with self._lock:
            self._slots = [h.open() for h in slots]
            return [s.reply for s in self._slots]

    def detach_staging(self, timeout: float) -> None:
        with self._lock:
            self._slots = []

    def load_staged_bucket(self, slot: int, index: int, timeout: float) -> None:
        def run(session: ReceiveSession) -> None:
            if not 0 <= slot < len(self._slots):
                raise WeightSyncError(f"{self._name}: staging slot {slot} is not attached ({len(self._slots)} are)")
            s = self._slots[slot]
            layout = session.expect(index)
            s.wait_for_sender()
            key = (session.manifest.digest, index)
            src = s.views.get(key)
            if src is None:
                src = s.views[key] = bucket_views(s.buffer, layout)
            rows = s.checked(layout.nbytes)
            if self._defer:  # checksum while copying out, compared at commit
                self._apply(index, src, rows, session.deferred(index, s.trailer, rows.device))
            else:
                session.check_checksum(index, rows, s.trailer)
                self._apply(index, src)
            s.signal_done()

        with self._lock:
            self._guarded("load_staged_bucket", run)

    # -- groups, disk, versions ----------------------------------------------------------------------------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str, timeout: float) -> None:
        with self._lock:
            if group_name in self._groups:
                raise WeightSyncError(f"{self._name}: update group {group_name!r} already exists")
            self._groups[group_name] = init_update_group(backend, master_address, master_port, world_size,
                                                         rank_offset, group_name, timeout)

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        with self._lock:
            pg = self._groups.pop(group_name, None)
            if pg is None:
                raise WeightSyncError(f"{self._name}: no update group {group_name!r} to destroy")
            destroy_update_group(pg)

    @property
    def group_names(self) -> list[str]:
        return list(self._groups)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        """Load a full checkpoint (validated before anything is copied); clears `failure`."""
        from beamrl.models.beam.checkpoint import load_checkpoint

        with self._lock:
            if self._session is not None:
                raise WeightSyncError(f"{self._name}: update_weights_from_disk during an open session")
            try:
                _, state = load_checkpoint(path)
                self.targets[FULL].load_state(state)
            except Exception as exc:
                raise WeightSyncError(f"{self._name}: update_weights_from_disk({path}) failed: {exc}") from exc
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.failure = self.unloaded = None

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        with self._lock:
            self.weight_version = int(new_version)

    def served_weight_version(self, timeout: float) -> int:
        return self.weight_version

    def abort_all(self, timeout: float) -> None:
        """A bare model receiver runs no requests: nothing to pause (engines built on it override this)."""


def model_receiver(model: torch.nn.Module, name: str = "local", initial_version: int = 0,
                   rollback: bool | None = None) -> LocalWeightReceiver:
    """A receiver writing into a `BeamForCausalLM` (or any module whose parameters carry HF names)."""
    return LocalWeightReceiver(model, name=name, initial_version=initial_version, rollback=rollback)
