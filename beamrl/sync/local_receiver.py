"""A `WeightReceiver` for a model living in this process (the native engine, benchmarks, tests).

It follows SGLang 0.5.23's rules so that code driving it behaves the same against SGLang:
- tensor and distributed updates only between `begin_weight_update` and `end_weight_update` (one session
  at a time), the version changes only when the session ends;
- a distributed update receives one uint8 broadcast from group rank 0 and rebuilds the layout from
  (names, dtypes, shapes) (`FlatBucket.empty`, identical to SGLang's `FlattenedTensorBucket.empty`);
- a disk update needs no session and loads a full, validated checkpoint.
Updates are applied by `load_tensors(named_tensors)`, e.g. `BeamForCausalLM.load_hf_tensors`, which checks
every name/shape/dtype before copying any.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from beamrl.protocols.flat_bucket import FlatBucket
from beamrl.protocols.weights import WeightReceiver, WeightSyncError
from beamrl.sync.update_group import destroy_update_group, init_update_group

LoadTensors = Callable[[list[tuple[str, torch.Tensor]]], object]


class LocalWeightReceiver(WeightReceiver):
    """Applies weight updates to an in-process model through `load_tensors`."""

    def __init__(self, load_tensors: LoadTensors, name: str = "local", device: str | torch.device = "cpu",
                 initial_version: int = 0) -> None:
        self._load = load_tensors
        self._name = name
        self.device = torch.device(device)
        self.weight_version = initial_version
        self._in_session = False
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._lock = threading.Lock()  # engine calls are serialised, as SGLang's scheduler does

    @property
    def name(self) -> str:
        return self._name

    @property
    def tp_size(self) -> int:
        return 1

    def _require_session(self, op: str) -> None:
        if not self._in_session:
            raise WeightSyncError(f"{self._name}: {op} must run between begin_weight_update() and "
                                  f"end_weight_update()")

    def _apply(self, named: list[tuple[str, torch.Tensor]], op: str) -> None:
        try:
            self._load(named)
            if self.device.type == "cuda":
                # Reply only once the copies are done: a colocated sender frees or reuses its buffer (shared
                # by CUDA-IPC) as soon as the call returns.
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # the engine's own words travel back to the trainer
            raise WeightSyncError(f"{self._name}: {op} failed to load weights: {exc}") from exc

    def begin_weight_update(self, timeout: float) -> None:
        with self._lock:
            if self._in_session:
                raise WeightSyncError(f"{self._name}: a weight-update session is already open")
            self._in_session = True

    def update_weights_from_tensor(self, bucket: FlatBucket, timeout: float) -> None:
        with self._lock:
            self._require_session("update_weights_from_tensor")
            self._apply(bucket.unflatten(), "update_weights_from_tensor")

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str, timeout: float) -> None:
        with self._lock:
            if group_name in self._groups:
                raise WeightSyncError(f"{self._name}: update group {group_name!r} already exists")
            self._groups[group_name] = init_update_group(backend, master_address, master_port, world_size,
                                                         rank_offset, group_name, timeout)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, timeout: float) -> None:
        with self._lock:
            self._require_session("update_weights_from_distributed")
            pg = self._groups.get(group_name)
            if pg is None:
                raise WeightSyncError(f"{self._name}: update group {group_name!r} not initialised "
                                      f"(have {sorted(self._groups)})")
            bucket = FlatBucket.empty(names, dtypes, shapes, self.device)
            dist.broadcast(bucket.buffer, src=0, group=pg)
            self._apply(bucket.unflatten(), "update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name: str, timeout: float) -> None:
        with self._lock:
            pg = self._groups.pop(group_name, None)
            if pg is None:
                raise WeightSyncError(f"{self._name}: no update group {group_name!r} to destroy")
            destroy_update_group(pg)

    def update_weights_from_disk(self, path: str, timeout: float) -> None:
        from beamrl.models.beam.checkpoint import load_checkpoint

        with self._lock:
            try:
                _, state = load_checkpoint(path)
            except Exception as exc:
                raise WeightSyncError(f"{self._name}: update_weights_from_disk({path}) failed: {exc}") from exc
            self._apply(list(state.items()), "update_weights_from_disk")

    def update_weight_version(self, new_version: int, timeout: float) -> None:
        with self._lock:
            self.weight_version = new_version

    def set_weight_version(self, new_version: int, timeout: float) -> None:
        """Alias of `update_weight_version` (kept for callers written against the first draft)."""
        self.update_weight_version(new_version, timeout)

    def end_weight_update(self, new_version: int, timeout: float) -> None:
        with self._lock:
            if not self._in_session:
                raise WeightSyncError(f"{self._name}: no weight-update session is open; call "
                                      f"begin_weight_update() first")
            self._in_session, self.weight_version = False, new_version


def model_receiver(model: torch.nn.Module, name: str = "local", initial_version: int = 0) -> LocalWeightReceiver:
    """A receiver writing into a `BeamForCausalLM` (or any module with `load_hf_tensors`)."""
    load: Callable[[Sequence[tuple[str, torch.Tensor]]], object] = model.load_hf_tensors  # type: ignore[attr-defined]
    device = next(model.parameters()).device
    return LocalWeightReceiver(load, name=name, device=device, initial_version=initial_version)
