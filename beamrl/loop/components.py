"""Turn a recipe into the pieces of a run: model config, initial weights, trainer config, engine factories."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from beamrl.models.beam.config import BeamConfig
from beamrl.recipe.errors import RecipeError

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def model_config(recipe) -> BeamConfig:
    """The Beam config of the run (checkpoint config.json, or the preset with `model.config_overrides`)."""
    from beamrl.recipe.model_spec import require_model_config

    if recipe.model.checkpoint is not None and recipe.model.config_overrides:
        raise ValueError("model.config_overrides applies to a preset's random init; a checkpoint carries its own "
                         "config.json")
    ckpt = recipe.model.checkpoint
    if ckpt is not None and not (Path(ckpt) / "config.json").is_file():  # --dry-run plans without it; a run cannot
        raise RecipeError("model.checkpoint", ckpt, "no Beam checkpoint (config.json) there on this machine; a "
                          "training run loads it (`--dry-run` checks the layout without it)")
    return require_model_config(recipe)[0]


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
                            use_distributed_optimizer=t.distributed_optimizer,
                            cpu_offload_fraction=t.optimizer_offload_fraction,
                            grad_reduce_in_fp32=t.main_grads_dtype == "fp32")
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
    """Builds an SGLang engine inside its actor (picklable). CPU: the in-process CPU engine (tests, laptops).
    GPU: an HTTP server subprocess owned by the actor (production; `docs/sglang.md`)."""

    checkpoint: str
    rollout: dict
    dtype: str
    device: str
    seed: int
    name: str
    port: int
    start_timeout: float

    def config(self):
        from beamrl.rollout.sglang import SGLangEngineConfig

        r = self.rollout
        if self.device == "cpu":
            return SGLangEngineConfig.cpu_test(self.checkpoint, dtype=self.dtype, random_seed=self.seed,
                                               enable_return_routed_experts=bool(r["return_routed_experts"]))
        return SGLangEngineConfig(
            model_path=self.checkpoint, tp_size=r["engine_tp"], mem_fraction_static=r["mem_fraction"],
            dtype=self.dtype, device="cuda", attention_backend=r["attention_backend"],
            enable_return_routed_experts=bool(r["return_routed_experts"]),
            enable_deterministic_inference=r["deterministic"], swa_full_tokens_ratio=r["swa_full_tokens_ratio"],
            enable_memory_saver=bool(r["memory_saver"]),
            random_seed=self.seed, port=self.port, extra_args=dict(r["server_args"]))

    def __call__(self):
        if self.device == "cpu":
            from beamrl.rollout.sglang.engine import SGLangEngine

            return SGLangEngine(self.config(), start_timeout=self.start_timeout)
        from beamrl.rollout.sglang.http_engine import SGLangHTTPEngine

        return SGLangHTTPEngine.launch(self.config(), start_timeout=self.start_timeout)


def engine_factories(recipe, checkpoint: str, return_routes: bool) -> list:
    r = recipe.rollout
    device = "cpu" if recipe.cluster.device == "cpu" else "cuda"
    # Colocated GPU engines release weights / KV cache while the trainer runs (needs SGLang's memory saver).
    rollout = dict(r.model_dump(mode="json"), return_routed_experts=return_routes,
                   memory_saver=recipe.placement.mode == "colocated" and device == "cuda")
    out = []
    for i in range(r.num_engines):
        name = f"{r.engine}-{i}"
        if r.engine == "native":
            out.append(NativeEngineFactory(checkpoint, recipe.model.dtype, device, recipe.run.seed + i, name))
        else:
            out.append(SGLangEngineFactory(checkpoint, rollout, recipe.model.dtype, device, recipe.run.seed + i,
                                           name, 30000 + 10 * i, recipe.timeouts.generate_s))
    return out


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """A per-request sampling seed, stable across resumes (hash of run seed, step and request index)."""
    h = hashlib.blake2b(f"{run_seed}/{step}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF
