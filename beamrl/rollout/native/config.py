"""`NativeEngineConfig`: how to build the embedded rollout engine (docs/native-engine.md)."""

from __future__ import annotations

from dataclasses import dataclass

from beamrl.dtypes import RUN_DTYPES
from beamrl.models.beam.lora_config import LoRAConfig


class NativeEngineConfigError(ValueError):
    """A field of `NativeEngineConfig` is invalid; the message names it."""


@dataclass
class NativeEngineConfig:
    """model_path: a Beam checkpoint directory (SGLang format). dtype: the serving dtype (float32 is exact and,
    on CPUs without native bf16 GEMMs, faster). max_batch_size: requests decoded together. seed: source of the
    per-request seeds of requests that give none. name: labels errors and weight-sync reports. num_threads: if
    set, `torch.set_num_threads` for this (engine) process: tiny models decode fastest with 1 intra-op thread,
    and an oversubscribed CPU makes more threads much slower. rollback: undo a failed weight-update session from
    host copies of what it overwrote (None: on CPU only; docs/weight-sync.md, "Failures"). lora: the trainer's
    `trainer.lora`: the engine then accepts adapter-only syncs for it (docs/lora.md); None: full syncs only.
    weights_cpu_backup: `release_memory(['weights'])` keeps a host copy (pinned on CUDA, allocated once) that
    `resume_memory` restores; False (SGLang's `enable_weights_cpu_backup` default): the weights are dropped, and
    after `resume_memory` the engine serves nothing until a full weight update (or `update_weights_from_disk`)
    has loaded every weight. A colocated run with full syncs does exactly that every step, so there the copy out
    and back is pure cost (docs/colocated.md)."""

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 64
    seed: int = 0
    name: str = "native-0"
    weight_version: int = 0
    num_threads: int | None = None
    rollback: bool | None = None
    lora: LoRAConfig | None = None
    weights_cpu_backup: bool = True

    def __post_init__(self) -> None:
        if not self.model_path:
            raise NativeEngineConfigError("NativeEngineConfig.model_path is empty")
        if self.dtype not in RUN_DTYPES:
            raise NativeEngineConfigError(f"NativeEngineConfig.dtype={self.dtype!r}; allowed: {list(RUN_DTYPES)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise NativeEngineConfigError(f"NativeEngineConfig.device={self.device!r}; allowed: 'cpu', 'cuda[:i]'")
        if self.max_batch_size < 1:
            raise NativeEngineConfigError(f"NativeEngineConfig.max_batch_size={self.max_batch_size} must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise NativeEngineConfigError(f"NativeEngineConfig.num_threads={self.num_threads} must be >= 1 or None")
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise NativeEngineConfigError(f"NativeEngineConfig.lora must be a LoRAConfig, got {type(self.lora).__name__}")
        if self.weight_version < 0:
            raise NativeEngineConfigError(f"NativeEngineConfig.weight_version={self.weight_version} must be >= 0")
