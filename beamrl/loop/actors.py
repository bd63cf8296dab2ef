"""Ray actors of a run: trainer ranks (Megatron) and rollout engines.

Actors are thin: they hold one object (`MegatronTrainer`, an engine) and forward calls, so the same objects
run in tests without Ray. Every call from the driver goes through `ray_get` with a timeout."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
import torch


@dataclass(frozen=True)
class TrainerRankSpec:
    """What a trainer rank needs to join its job."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    num_threads: int = 1


@ray.remote
class TrainerActor:
    """One Megatron trainer rank (`beamrl.trainer.megatron.MegatronTrainer`)."""

    def __init__(self, spec: TrainerRankSpec, trainer_config, hf_checkpoint: str | None):
        os.environ.update(RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=spec.master_addr, MASTER_PORT=str(spec.master_port))
        torch.set_num_threads(spec.num_threads)
        from beamrl.trainer.megatron.worker import MegatronTrainer

        self.rank = spec.rank
        self.trainer = MegatronTrainer(trainer_config, hf_checkpoint=hf_checkpoint)

    def ready(self) -> bool:
        return True

    def compute_logprobs(self, batch, temperature: float, return_entropy: bool, replay: bool):
        self.trainer.set_routing_replay(replay)
        return self.trainer.compute_logprobs(batch, temperature=temperature, return_entropy=return_entropy)

    def train_step(self, micro_batches, loss_fn, replay: bool):
        self.trainer.set_routing_replay(replay)
        return self.trainer.train_step(micro_batches, loss_fn)

    def save_checkpoint(self, directory: str) -> str:
        return str(self.trainer.save_checkpoint(directory))

    def load_checkpoint(self, directory: str) -> None:
        self.trainer.load_checkpoint(directory)

    def sync_weights(self, receivers: list, engine_names: list[str], version: int, transport: str,
                     bucket_bytes: int, timeout: float, progress: bool = False):
        """Collective over trainer ranks: every rank streams the HF export; rank 0 ships the buckets."""
        from beamrl.loop.weight_sync import push_weights

        return push_weights(self.trainer, self.rank, receivers, engine_names, version, transport,
                            bucket_bytes, timeout, progress)

    def export_hf_checkpoint(self, out_dir: str, bucket_bytes: int) -> str | None:
        from beamrl.loop.weight_sync import save_hf_export

        return save_hf_export(self.trainer, self.rank, out_dir, bucket_bytes)

    def shutdown(self) -> None:
        self.trainer.shutdown()


@ray.remote
class EngineActor:
    """A rollout engine (`RolloutEngine` + `WeightReceiver`) built in the actor from a picklable factory."""

    def __init__(self, factory, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.engine = factory()

    def ready(self) -> bool:
        return True

    def call(self, method: str, *args, **kwargs):
        """Forward one protocol call (`generate`, `score`, `health`, `begin_weight_update`, ...)."""
        return getattr(self.engine, method)(*args, **kwargs)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def shutdown(self) -> None:
        self.engine.shutdown()
