"""The SGLang adapters' side of exact verification: what the adapter checks before it hands bytes to SGLang, and
how it undoes a failed session. Shared by the in-process (`engine.py`) and HTTP (`http_engine.py`) adapters.

- `begin`: the manifest is checked against Beam's HF weight table at the engine's dtype (`ReceiveSession`): a
  stale version, an unknown name, a wrong shape/dtype or a missing tensor is refused before SGLang is touched.
- colocated buckets (`update_weights_from_tensor`): index, layout and raw-bit checksum are checked before the
  payload is serialized for SGLang.
- distributed buckets: the bytes go straight from the trainer's broadcast into SGLang's scheduler, so the adapter
  checks the index and takes the names, dtypes and shapes from the manifest (it cannot read the bytes; a checksum
  check there needs a hook inside SGLang's model class: docs/weight-sync.md, "SGLang").
- rollback (on by default on CPU): the adapter keeps a host mirror of the weights the engine serves (loaded from
  the checkpoint the engine started from, updated at each commit). An aborted colocated session re-sends the
  mirror's values of every bucket it applied, inside SGLang's still-open session, so the engine serves its
  previous weights and version. Without rollback (GPU: a host mirror of 501B weights is ~1 TB per engine), or after
  a distributed session (whose bytes the adapter never saw), an aborted session that touched the weights leaves
  the adapter `failure` set: generate/score are refused until `update_weights_from_disk` reloads every weight (or
  the engine is restarted with the current weights).
- LoRA (an engine launched with `SGLangEngineConfig.lora`): mode `adapter` is checked against the adapter table
  of the engine's LoRA config; beamrl's model class stages the adapter and merges it when its last bucket
  arrives. The adapter keeps the last committed adapter (host copies; with rollback) so that an aborted session
  whose adapter was already merged re-sends the previous one (or a zero adapter, which merges to W0 exactly).
"""

from __future__ import annotations

import torch

from beamrl.dtypes import torch_dtype
from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.lora_config import LoRAConfig
from beamrl.models.beam.lora_payload import ADAPTER, SCALE_NAME, adapter_table, scale_tensor
from beamrl.models.beam.weights import expected_tensors
from beamrl.protocols.flat_bucket import FlatBucket, aligned_order
from beamrl.protocols.manifest import FULL, BucketLayout, SyncManifest
from beamrl.protocols.weights import ROLLED_BACK, UNHEALTHY, UNTOUCHED, WeightSyncError
from beamrl.sync.receive_session import ManifestCache, ReceiveSession


class SGLangSyncGuard:
    """Per-engine session checks, rollback mirror and failure state (module docstring)."""

    def __init__(self, engine: str, beam_config: BeamConfig, dtype: str, checkpoint: str, rollback: bool,
                 lora: LoRAConfig | None = None) -> None:
        self.engine = engine
        model_dtype = torch_dtype(beam_config.dtype if dtype == "auto" else dtype)
        self.table = {n: (tuple(s.shape), s.dtype(model_dtype)) for n, s in expected_tensors(beam_config).items()}
        self.tables = {FULL: self.table}
        self.lora = lora
        if lora is not None:
            self.tables[ADAPTER] = adapter_table(beam_config, lora, model_dtype)
        self._adapter_mirror: dict[str, torch.Tensor] | None = None  # the last committed adapter (host)
        self.rollback = rollback
        self.failure: str | None = None  # set when a failed session left SGLang's weights partly updated
        self._mirror_source: str | None = checkpoint  # where the mirror is (re)loaded from, lazily
        self._mirror: dict[str, torch.Tensor] | None = None
        self._mirror_valid = True
        self.session: ReceiveSession | None = None
        self._manifests = ManifestCache()
        self._applied: list[int] = []  # buckets of this session SGLang has loaded
        self._pending: dict[str, torch.Tensor] = {}  # their new values (host copies), committed into the mirror
        self._blind = False  # a distributed bucket was loaded: the adapter never saw its bytes
        self._adapter_refused = False  # LoRA: the model class merged nothing in this session

    # -- session ---------------------------------------------------------------------------------------------
    def begin(self, manifest: SyncManifest, served_version: int) -> None:
        if self.session is not None:
            raise WeightSyncError(f"{self.engine}: a weight-update session is already open")
        self.session = ReceiveSession(self.engine, manifest, served_version, self.tables, self._manifests)
        self._applied, self._pending, self._blind = [], {}, False
        if self.rollback and self._mirror_valid and self._mirror is None:
            from beamrl.models.beam.checkpoint import load_checkpoint

            self._mirror = dict(load_checkpoint(self._mirror_source)[1])

    def require(self, op: str) -> ReceiveSession:
        if self.session is None:
            raise WeightSyncError(f"{self.engine}: {op} must run between begin_weight_update() and "
                                  f"end_weight_update()")
        return self.session

    def check_tensor_bucket(self, bucket: FlatBucket) -> None:
        """Index, layout and checksum of a colocated bucket, before SGLang sees it."""
        session = self.require("update_weights_from_tensor")
        if bucket.index is None or bucket.checksum is None:
            raise WeightSyncError(f"{self.engine}: a bucket must carry its index and checksum")
        session.expect(bucket.index)
        session.check_layout(bucket.index, bucket.metas)
        for where, copy in bucket.checkable_copies():  # a per-rank bucket: every TP rank's own copy (on CPU)
            try:
                session.check_checksum(bucket.index, copy, bucket.checksum)
            except WeightSyncError as exc:
                if not where:
                    raise
                raise WeightSyncError(f"{exc}{where}") from None

    def tensor_bucket_loaded(self, bucket: FlatBucket) -> None:
        self._applied.append(bucket.index)
        if self.adapter_session:
            if self.rollback:
                self._pending.update((n, t.detach().to("cpu", copy=True)) for n, t in bucket.unflatten())
        elif self.rollback and self._mirror is not None:
            for name, t in bucket.unflatten():
                self._pending[name] = t.detach().to("cpu", copy=True)
        self.session.advance()

    def distributed_bucket(self, index: int) -> BucketLayout:
        """The announced layout of distributed bucket `index` (which must be the next one)."""
        return self.require("update_weights_from_distributed").expect(index)

    def distributed_bucket_loaded(self, index: int) -> None:
        self._applied.append(index)
        self._blind = True
        self.session.advance()

    def settle(self, new_version: int) -> None:
        session = self.session
        if session is None:
            raise WeightSyncError(f"{self.engine}: no weight-update session is open; call begin_weight_update() first")
        if int(new_version) != session.version:
            raise WeightSyncError(f"{self.engine}: end_weight_update({new_version}) but the session's manifest is "
                                  f"for version {session.version}")
        session.settle()

    @property
    def adapter_session(self) -> bool:
        return self.session is not None and self.session.manifest.mode == ADAPTER

    @property
    def adapter_merged(self) -> bool:
        """Whether this adapter session's last bucket reached SGLang (beamrl's model class then merged it)."""
        return (self.adapter_session and len(self._applied) == len(self.session.manifest.buckets)
                and not self._adapter_refused)

    def adapter_refused(self) -> None:
        """beamrl's model class reports that it merged nothing in this session (it refused the adapter)."""
        self._adapter_refused = True

    def committed(self) -> None:
        if self.adapter_session:
            self._adapter_mirror = dict(self._pending) if self.rollback and not self._blind else None
            self._close()
            return
        if self._blind:  # the mirror no longer matches what the engine serves
            self._mirror, self._mirror_valid = None, False
        elif self._mirror is not None:
            self._mirror.update(self._pending)
        self.failure = None if self.session.manifest.mode == FULL else self.failure
        self._close()

    def undo_buckets(self) -> list[FlatBucket] | None:
        """The buckets that restore what this session overwrote (None: it cannot be undone)."""
        if not self._applied:
            return []
        manifest = self.session.manifest
        if self.adapter_session:
            if not self.adapter_merged:
                return []  # only staged in the model class: the weights are untouched
            if not self.rollback or self._blind:
                return None
            previous = self._adapter_mirror or {n: torch.zeros(shape, dtype=dt) for n, (shape, dt)
                                                in self.tables[ADAPTER].items()}
            previous[SCALE_NAME] = scale_tensor(self.lora)  # a zero adapter merges to W0 bit for bit
            return [FlatBucket.from_named_tensors(aligned_order([(n, previous[n]) for n in b.names]))
                    for b in manifest.buckets]
        if not self.rollback or self._blind or self._mirror is None:
            return None
        return [FlatBucket.from_named_tensors(aligned_order([(n, self._mirror[n])
                                                             for n in manifest.bucket(i).names]))
                for i in self._applied]

    def aborted(self, reason: str, restored: bool) -> str:
        """Close the session after `undo_buckets` were re-sent (`restored`) or could not be."""
        session = self.session
        if not self._applied or (self.adapter_session and not self.adapter_merged):
            outcome = UNTOUCHED
        elif restored:
            outcome = ROLLED_BACK
        else:
            self.failure = (f"weight sync to version {session.version} failed after {len(self._applied)} bucket(s) "
                            f"were loaded ({reason}); the weights are partly updated")
            outcome = UNHEALTHY
        self._close()
        return outcome

    def _close(self) -> None:
        self.session, self._applied, self._pending, self._blind = None, [], {}, False
        self._adapter_refused = False

    def disk_loaded(self, path: str) -> None:
        """Every weight was reloaded by SGLang's own loader: serving again; the mirror is read from `path` now (a
        disk transport may delete that directory after its next version)."""
        self.failure = None
        self._mirror, self._mirror_source, self._mirror_valid = None, str(path), True
        if self.rollback:
            from beamrl.models.beam.checkpoint import load_checkpoint

            self._mirror = dict(load_checkpoint(self._mirror_source)[1])

    def require_serving(self, what: str, error_cls: type[Exception]) -> None:
        if self.failure is not None:
            raise error_cls(f"{self.engine}: {what} refused: not serving ({self.failure}); reload the full weights "
                            f"with update_weights_from_disk or restart the engine")
