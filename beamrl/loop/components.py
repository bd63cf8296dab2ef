"""Turn a recipe into the pieces of a run: model config, initial weights, trainer config, engine factories."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.models.beam.presets import preset

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def model_config(recipe) -> BeamConfig:
    """The Beam config of the run: the checkpoint's config.json, else the named preset (with the run dtype)."""
    m = recipe.model
    if m.checkpoint is not None:
        cfg = BeamConfig.from_json_file(m.checkpoint)
        if m.preset is not None and preset(m.preset).to_dict() != cfg.replace(dtype=preset(m.preset).dtype).to_dict():
            raise ValueError(f"model.checkpoint={m.checkpoint!r} does not hold the model.preset={m.preset!r} config")
        return cfg
    return preset(m.preset).replace(dtype=m.dtype)


def initial_checkpoint(recipe, config: BeamConfig, out_dir: Path) -> str:
    """The HF checkpoint every actor loads first: `model.checkpoint`, or a seeded random one written once."""
    if recipe.model.checkpoint is not None:
        return recipe.model.checkpoint
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_tensors

    seed = recipe.model.seed if recipe.model.seed is not None else recipe.run.seed
    path = out_dir / f"init_checkpoint_seed{seed}"
    if not (path / "config.json").exists():
        save_checkpoint(config, random_tensors(config, seed, _DTYPES[recipe.model.dtype]), path)
    return str(path)


def trainer_config(recipe, config: BeamConfig, lr: float | None = None):
    """`TrainerConfig` of the Megatron ranks from the recipe's trainer section."""
    from beamrl.trainer.megatron.parallel import ParallelConfig
    from beamrl.trainer.megatron.worker import OptimizerSettings, TrainerConfig

    t = recipe.trainer
    parallel = ParallelConfig(tp=t.tp, sp=t.sp, ep=t.ep, etp=t.expert_tp, pp=t.pp, vpp=t.vpp)
    opt = OptimizerSettings(lr=lr if lr is not None else t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.grad_clip,
                            use_distributed_optimizer=t.distributed_optimizer)
    seed = t.seed if t.seed is not None else recipe.run.seed
    return TrainerConfig(model=config, parallel=parallel, optimizer=opt, dtype=recipe.model.dtype, seed=seed,
                         use_fused_kernels=t.use_fused_kernels, recompute=t.recompute == "full",
                         timeout_s=recipe.timeouts.train_step_s)


@dataclass(frozen=True)
class NativeEngineFactory:
    """Builds the embedded engine inside its actor (picklable)."""

    checkpoint: str
    dtype: str
    device: str
    seed: int
    name: str

    def __call__(self):
        from beamrl.rollout.native import NativeEngine, NativeEngineConfig

        return NativeEngine(NativeEngineConfig(model_path=self.checkpoint, dtype=self.dtype, device=self.device,
                                               seed=self.seed, name=self.name))


@dataclass(frozen=True)
class SGLangEngineFactory:
    """Builds an SGLang engine adapter inside its actor (picklable)."""

    checkpoint: str
    recipe_rollout: dict
    device: str
    seed: int
    name: str

    def __call__(self):
        from beamrl.rollout.sglang import engine_from_recipe

        return engine_from_recipe(self.checkpoint, self.recipe_rollout, device=self.device, seed=self.seed,
                                  name=self.name)


def engine_factories(recipe, checkpoint: str) -> list:
    r = recipe.rollout
    device = "cpu" if recipe.cluster.device == "cpu" else "cuda"
    out = []
    for i in range(r.num_engines):
        name = f"{r.engine}-{i}"
        if r.engine == "native":
            out.append(NativeEngineFactory(checkpoint, recipe.model.dtype, device, recipe.run.seed + i, name))
        else:
            out.append(SGLangEngineFactory(checkpoint, r.model_dump(mode="json"), device, recipe.run.seed + i, name))
    return out


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """A per-request sampling seed, stable across resumes (hash of run seed, step and request index)."""
    h = hashlib.blake2b(f"{run_seed}/{step}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF
