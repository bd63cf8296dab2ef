"""Disk transport: write the synced weights as an SGLang-format Beam checkpoint, then `update_weights_from_disk`.

The slow but simplest path (any engine that can read the shared filesystem). It is a FULL update: each bucket is
packed into its own host buffer, and at `finalize` the buffers' tensors are written by
`beamrl.models.beam.checkpoint.save_checkpoint`, which validates every name, shape and dtype against the Beam
weight table (host memory ~ one model copy). Each write gets its own directory `<root>/v<version>-<id>`; engines
load it and are then told the new version (`update_weight_version`, SGLang `/update_weight_version`). No engine
session is opened: SGLang's disk loader does not need one, and it restores the old weights itself when a load
fails.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.manifest import BucketLayout, SyncManifest
from beamrl.protocols.weights import WeightReceiver, WeightSyncError
from beamrl.removal import remove_tree, undeleted_line
from beamrl.sync.packing import bucket_views
from beamrl.sync.transports import TRANSPORTS
from beamrl.sync.transports.base import PackTarget, ReceiverTransport


@TRANSPORTS.register("disk")
class DiskTransport(ReceiverTransport):
    """Safetensors checkpoint + `update_weights_from_disk(path)` on every engine."""

    name = "disk"
    content_check = ("names, shapes and dtypes validated at the write (no checksum: the engines' own loader reads "
                     "the files)")

    def __init__(self, receivers: Sequence[WeightReceiver], directory: str | Path, config: BeamConfig,
                 max_shard_bytes: int | None = 4 * 1024 ** 3, keep_previous: bool = False) -> None:
        super().__init__(receivers, device="cpu")
        self.root = Path(directory)
        self.config = config
        self.max_shard_bytes = max_shard_bytes
        self.keep_previous = keep_previous
        self._buckets: dict[int, FlatBucket] = {}

    def version_dir(self, version: int) -> Path:
        """A new directory for `version`'s checkpoint. Unique per write: a restarted engine's resync at the current
        version may carry other weights than an earlier write of that version (the trainer may have stepped since),
        so nothing already on disk is ever loaded in its place."""
        return self.root / f"v{version:06d}-{uuid.uuid4().hex[:8]}"

    def connect(self, timeout: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def _ensure_slots(self, manifest: SyncManifest, timeout: float) -> None:
        """Every bucket gets its own host buffer (kept until the checkpoint is written)."""

    def _begin_engines(self, manifest: SyncManifest, timeout: float) -> None:
        self._buckets = {}  # engines are only touched in finalize

    def buffer(self, bucket: BucketLayout, timeout: float) -> PackTarget:
        self._require_session("buffer")
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        self._buckets[bucket.index] = FlatBucket(buf, list(bucket.metas), index=bucket.index)
        return PackTarget(bucket.index, buf, bucket_views(buf, bucket))

    def _send(self, bucket: BucketLayout, timeout: float) -> None:
        """Nothing moves yet: the packed host buffer is kept for the checkpoint written at `finalize`."""

    def finalize(self, timeout: float) -> None:
        manifest = self._require_session("finalize")
        version = manifest.version
        out = self.version_dir(version)
        from beamrl.models.beam.checkpoint import save_checkpoint  # lazy: safetensors is optional elsewhere

        if torch.cuda.is_available():  # packing from GPU tensors into host buffers is asynchronous
            torch.cuda.synchronize()
        tensors = {n: t for b in self._buckets.values() for n, t in b.unflatten()}
        try:
            save_checkpoint(self.config, tensors, out, max_shard_bytes=self.max_shard_bytes)
        except Exception as exc:
            shutil.rmtree(out, ignore_errors=True)  # (a partial write of ours; the error is raised just below)
            raise WeightSyncError(f"disk transport: writing checkpoint {out} failed: {exc}") from exc
        finally:
            self._buckets = {}
        self._touched = True
        self._call_all("update_weights_from_disk", lambda r: r.update_weights_from_disk(str(out), timeout), timeout)
        self._call_all("update_weight_version", lambda r: r.update_weight_version(version, timeout), timeout)
        self._drop_versions(keep=out)
        self.manifest = None

    def _drop_versions(self, keep: Path | None) -> None:
        """Remove every version's checkpoint under the root but `keep` (the engines have loaded it), unless
        `keep_previous`. Found by listing, not remembered: another instance on the same root (a subset sync's, or
        the one built after an engine was replaced) may have written them."""
        if self.keep_previous or not self.root.is_dir():
            return
        for old in sorted(self.root.glob("v[0-9]*")):
            if old != keep and old.is_dir():
                errors = remove_tree(old)
                if errors:
                    print(f"[weight sync] disk transport: {undeleted_line(old, errors)}", flush=True)

    def discard_buffers(self) -> None:
        """The run is ending: besides the base's bookkeeping, remove the last version's checkpoint (unless
        `keep_previous`) and the transport's directory once it is empty; the engines loaded the weights long ago."""
        super().discard_buffers()
        self._buckets = {}
        self._drop_versions(keep=None)
        try:
            self.root.rmdir()  # only when empty: never anything the transport did not write
        except OSError:
            pass

    def abort(self, reason: str, timeout: float) -> None:
        self._buckets = {}
        if not self._touched:  # engines were never called: nothing to undo
            self.manifest = None
            return
        super().abort(reason, timeout)
