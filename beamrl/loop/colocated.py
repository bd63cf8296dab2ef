"""Colocated placement: the trainer and the engines hand the devices back and forth within each step.

Order (the anchors' staged order; docs/colocated.md):
  rollout   the engines hold weights, KV cache and CUDA graphs; the trainer sleeps
  ->        the engines release everything (`release_memory`, colocated GPUs)      `before_train`
  ->        the trainer (and the KL reference) wake                                 `before_train`
  train
  sync      the engines resume their weights, the buckets arrive, version, probe    (the sync orchestrator)
  ->        the trainer (and the reference) sleep                                   `before_rollout` (next step)
  ->        the engines resume KV cache and CUDA graphs                             `before_rollout`
so the trainer's state and the engines' KV cache are never on the devices together. The trainer sleeps at the
start of a step, not at the end of the previous one: a checkpoint save at the end of a step needs it awake.

`trainer_sleeps(recipe)` resolves `trainer.sleep_during_rollout` (null: on for colocated placement on cuda).
"""

from __future__ import annotations

import time

from beamrl.loop.groups import EngineGroup, TrainerGroup
from beamrl.recipe.schema import Recipe

GIB = 2**30
#: What colocated GPU engines take back once the trainer sleeps (after a sync that resumed only their weights).
KV_TAGS = ("kv_cache", "cuda_graph")


def trainer_sleeps(recipe: Recipe) -> bool:
    """`trainer.sleep_during_rollout`, with null resolved: on for colocated placement on cuda, off otherwise."""
    from beamrl.trainer.megatron.config import sleeps_during_rollout

    return sleeps_during_rollout(recipe.trainer.sleep_during_rollout, recipe.placement.mode, recipe.cluster.device)


def engines_stage_memory(recipe: Recipe) -> bool:
    """Colocated GPU engines release their memory for training and resume it in the staged order."""
    return recipe.placement.mode == "colocated" and recipe.cluster.device != "cpu"


def engines_back_up_weights(recipe: Recipe) -> bool:
    """Whether engines keep the weights they release in host memory (`EngineLaunch.weights_cpu_backup`). Only
    LoRA needs it: its adapter-only syncs do not resend the base weights. Every other sync after a release
    resends all of them, so a backup would be a full copy out and back per step for nothing (docs/colocated.md)."""
    from beamrl.loop.weight_sync import adapter_only_syncs

    return adapter_only_syncs(recipe.trainer.lora)


class ColocatedMemory:
    """The hand-over of device memory between a run's trainer groups and its engines (module docstring).

    `trainers`: the policy group and, if there is one, the KL reference group. `timeout`: each sleep / wake /
    release / resume call's limit."""

    def __init__(self, trainers: list[TrainerGroup], engines: EngineGroup, *, sleep: bool, staged: bool,
                 timeout: float) -> None:
        self.trainers, self.engines = trainers, engines
        self.sleep_enabled, self.staged, self.timeout = sleep, staged, timeout
        self._engines_released = False

    @property
    def resume_after_sync(self) -> tuple[str, ...]:
        """What the sync resumes at its end: everything, unless the trainer sleeps first (then `before_rollout`)."""
        return () if self.sleep_enabled else KV_TAGS

    def before_rollout(self) -> dict[str, float]:
        """The trainer sleeps, then the engines take back their KV cache and CUDA graphs. Returns the metrics."""
        out: dict[str, float] = {}
        if self.sleep_enabled:
            t0 = time.perf_counter()
            reports = [rep for g in self.trainers for rep in g.sleep(self.timeout)]
            out["time/trainer_sleep_s"] = time.perf_counter() - t0
            # per device: the largest rank (the ranks of one group are alike; policy and reference may share one)
            out["memory/trainer_asleep_gib"] = max(r["asleep_bytes"] for r in reports) / GIB
            out["memory/trainer_peak_gib"] = max(r["peak_bytes"] for r in reports) / GIB
            out["memory/trainer_offloaded_gib"] = sum(r["bytes"] for r in reports) / GIB
        if self.staged and self._engines_released and self.sleep_enabled:
            t0 = time.perf_counter()
            self.engines.call_all("resume_memory", self.timeout, tags=list(KV_TAGS))
            out["time/engine_resume_kv_s"] = time.perf_counter() - t0
        self._engines_released = False
        return out

    def before_train(self) -> dict[str, float]:
        """The engines release their memory, then the trainer wakes. Returns the metrics."""
        out: dict[str, float] = {}
        if self.staged:
            t0 = time.perf_counter()
            self.engines.call_all("release_memory", self.timeout, tags=None)
            self._engines_released = True
            out["time/engine_release_s"] = time.perf_counter() - t0
        if self.sleep_enabled:
            t0 = time.perf_counter()
            reports = [rep for g in self.trainers for rep in g.wake(self.timeout)]
            out["time/trainer_wake_s"] = time.perf_counter() - t0
            out["memory/trainer_awake_gib"] = max(r["awake_bytes"] for r in reports) / GIB
        return out
