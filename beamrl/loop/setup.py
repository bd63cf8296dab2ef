"""Setting up a run: the resolved pieces every step reads (`RunContext`), Ray, the actor groups, and what a run must
release at the end (`Resources`).

Order matters and is kept here: how the run starts (`run_dir.plan_start`: an earlier run's outputs are refused,
resumed or replaced) is decided by the driver first; then the model config, the start-up checks
(`beamrl.recipe.preflight`: checkpoint tensors, tokenizer, data source, reward functions) and the prompts load,
all before anything is written. Only then the output directory, rewards and metric loggers, then Ray.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from beamrl.dtypes import torch_dtype
from beamrl.loop.groups import EngineGroup, TrainerGroup
from beamrl.loop.log import log
from beamrl.loop.checkpoints import step_of
from beamrl.loop.run_dir import StartPlan, delete_outputs
from beamrl.models.beam.config import BeamConfig
from beamrl.recipe.errors import RecipeError
from beamrl.recipe.schema import Recipe

# GPU shares when actors share a GPU: policy rank + reference rank + colocated engine <= 1.
POLICY_SHARE, REFERENCE_SHARE, ENGINE_SHARE = 0.6, 0.2, 0.2


class Resources:
    """What a run must release, released in reverse order of acquisition, each on its own (one failing
    teardown must not leak the others)."""

    def __init__(self) -> None:
        self._items: list[tuple[str, Callable[[], Any]]] = []

    def add(self, name: str, release: Callable[[], Any]) -> None:
        self._items.append((name, release))

    def release(self, name: str) -> None:
        """Release one resource now (e.g. the metric loggers, flushed before the summary is written)."""
        for i, (n, fn) in enumerate(self._items):
            if n == name:
                del self._items[i]
                fn()
                return

    def close(self) -> None:
        while self._items:
            name, release = self._items.pop()
            try:
                release()
            except Exception as e:  # noqa: BLE001 - report and go on releasing the rest
                log(f"warning: closing {name} failed: {type(e).__name__}: {e}")


@dataclass
class RunContext:
    """What the pieces of a step read: the recipe plus what set-up resolved from it."""

    recipe: Recipe
    out_dir: Path
    checkpoint_root: Path
    model: BeamConfig
    initial_checkpoint: str  # the HF checkpoint every actor loads first
    tokenizer: Any
    data: Any  # beamrl.data.PromptLoader
    stop_ids: tuple[int, ...]
    rewards: Any  # beamrl.rewards.RewardManager
    logger: Any  # beamrl.metrics.MultiLogger
    samples: Any  # beamrl.metrics.samples.SampleLog (logging.samples)
    routing_replay: bool  # algorithm.routing_replay resolved (null: on for MoE models)
    return_routed_experts: bool  # rollout.return_routed_experts resolved (null: follows routing_replay)
    resume_dir: Path | None

    @property
    def cpu(self) -> bool:
        return self.recipe.cluster.device == "cpu"


def model_config(recipe: Recipe) -> BeamConfig:
    """The Beam config of the run (checkpoint config.json, or the preset with `model.config_overrides`)."""
    from beamrl.recipe.model_spec import require_model_config

    ckpt = recipe.model.checkpoint
    if ckpt is not None and not (Path(ckpt) / "config.json").is_file():  # --dry-run plans without it; a run cannot
        raise RecipeError("model.checkpoint", ckpt, "no Beam checkpoint (config.json) there on this machine; a "
                          "training run loads it (`--dry-run` checks the layout without it)")
    return require_model_config(recipe)[0]


def initial_checkpoint(recipe: Recipe, config: BeamConfig, out_dir: Path) -> str:
    """`model.checkpoint`, or a seeded random checkpoint written once into the output directory."""
    if recipe.model.checkpoint is not None:
        return recipe.model.checkpoint
    from beamrl.models.beam.checkpoint import save_checkpoint
    from beamrl.models.beam.weights import random_tensors

    seed = recipe.model.seed if recipe.model.seed is not None else recipe.run.seed
    path = out_dir / f"init_checkpoint_seed{seed}"
    if not (path / "config.json").exists():
        save_checkpoint(config, random_tensors(config, seed, torch_dtype(recipe.model.dtype)), path)
    return str(path)


def prepare_run(recipe: Recipe, start: StartPlan, resources: Resources) -> RunContext:
    """Everything before the actors; what must be released is added to `resources`. Nothing is written until
    the start-up checks passed and the prompts loaded (a failure there is a `RecipeError` naming the field)."""
    from beamrl.metrics import build_metrics_logger
    from beamrl.metrics.samples import SampleLog
    from beamrl.recipe.preflight import load_prompts, preflight
    from beamrl.rewards import RewardManager

    config = model_config(recipe)  # first: a missing checkpoint leaves no output directory behind
    checks = preflight(recipe, config)
    tokenizer = checks.tokenizer
    data = load_prompts(recipe, tokenizer)
    log(f"checks passed: {'; '.join(checks.lines)}; {len(data)} prompts")
    out_dir, ckpt_root, resume_dir = start.out_dir, start.checkpoint_root, start.resume_dir
    if start.replace is not None:
        delete_outputs(start.replace, log)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "recipe.yaml").write_text(recipe.to_yaml())
    torch.manual_seed(recipe.run.seed)
    init = initial_checkpoint(recipe, config, out_dir)
    rewards = RewardManager(recipe.rewards, recipe.reward_pool, log=log)
    rewards.start()
    resources.add("rewards", rewards.close)
    truncate_step_files(out_dir, step_of(resume_dir) if resume_dir else 0)
    logger = build_metrics_logger(recipe.logging, out_dir, recipe.run.name, recipe.run.num_steps, recipe.to_dict())
    resources.add("logger", logger.close)
    samples = SampleLog(out_dir, recipe.logging.console, recipe.run.num_steps)
    resources.add("samples", samples.close)
    a, ro = recipe.algorithm, recipe.rollout
    routing_replay = bool(a.routing_replay if a.routing_replay is not None else bool(config.moe_layers))
    return_routed_experts = bool(ro.return_routed_experts if ro.return_routed_experts is not None
                                 else routing_replay)
    return RunContext(recipe, out_dir, ckpt_root, config, init, tokenizer, data, (int(tokenizer.eos_token_id),),
                      rewards, logger, samples, routing_replay, return_routed_experts, resume_dir)


STEP_FILES = ("metrics.jsonl", "samples.jsonl")  # one JSON object per line, each with the step it belongs to


def truncate_step_files(out_dir: Path, first_step: int) -> None:
    """Keep the metrics.jsonl and samples.jsonl lines of steps before `first_step` (a fresh run starts empty; a
    resumed run drops the steps after its checkpoint, which it recomputes)."""
    for name in STEP_FILES:
        path = out_dir / name
        if not path.exists():
            continue
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < first_step]
        path.write_text("".join(ln + "\n" for ln in keep))


def check_launchable(recipe: Recipe) -> None:
    """Layouts that `--dry-run` plans but this loop cannot launch yet fail here, by name, before any actor."""
    r = recipe
    if r.cluster.device == "cpu":
        return
    if r.rollout.engine_tp > r.cluster.gpus_per_node:
        raise NotImplementedError(
            f"rollout.engine_tp={r.rollout.engine_tp} spans several nodes (cluster.gpus_per_node="
            f"{r.cluster.gpus_per_node}); beamrl does not launch multi-node SGLang engines yet (docs/rl-loop.md)")
    if r.placement.mode == "colocated" and r.rollout.engine_tp != 1:
        raise NotImplementedError(f"placement.mode=colocated with rollout.engine_tp={r.rollout.engine_tp}: "
                                  f"colocated GPU engines are launched one GPU each (engine_tp 1) for now")


def start_ray(recipe: Recipe, resources: Resources, verbose: bool = False) -> None:
    """CPU: a private local Ray (its own short temp dir: parallel runs must not share Ray's sockets). GPU: join
    the cluster that `launch/` started. Every worker filters third-party warnings unless `verbose`."""
    import ray

    from beamrl.loop.ray_utils import connect_cluster_ray, init_local_ray
    from beamrl.third_party_output import worker_runtime_env

    env = worker_runtime_env(verbose)

    tmp: Path | None = None
    if recipe.cluster.device == "cpu":
        tmp = Path(tempfile.mkdtemp(prefix="beamrl-ray-", dir="/tmp"))
        n_trainer = recipe.trainer.num_gpus
        n_reference = n_trainer if recipe.algorithm.kl.reference else 0
        init_local_ray(num_cpus=n_trainer + n_reference + recipe.rollout.num_engines + 2, temp_dir=tmp,
                       runtime_env=env)
    else:
        connect_cluster_ray(runtime_env=env)

    def shutdown() -> None:
        ray.shutdown()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    resources.add("ray", shutdown)


def trainer_setup(recipe: Recipe, model: BeamConfig, lr: float | None = None):
    """The `TrainerSetup` of every rank: the trainer section (with `lr` replaced for the SFT warm start, which
    trains every weight even in a LoRA run: it makes the base that the adapters then train on)."""
    from beamrl.trainer.megatron.worker import TrainerSetup

    trainer = recipe.trainer if lr is None else recipe.trainer.model_copy(update={"lr": lr, "lora": None})
    seed = trainer.seed if trainer.seed is not None else recipe.run.seed
    return TrainerSetup(model=model, trainer=trainer, dtype=recipe.model.dtype, seed=seed,
                        timeout_s=recipe.timeouts.train_step_s)


def start_trainer(run: RunContext, hf_checkpoint: str, lr: float | None = None,
                  reference: bool = False) -> TrainerGroup:
    """The Megatron ranks (one actor each). CPU: one core-slot per actor; GPU: a rank per GPU, shared with the
    KL reference ranks and colocated engines."""
    r = run.recipe
    n = r.trainer.num_gpus
    share = REFERENCE_SHARE if reference else POLICY_SHARE
    options = [{"num_cpus": 1} if run.cpu else {"num_cpus": 1, "num_gpus": share} for _ in range(n)]
    t0 = time.perf_counter()
    group = TrainerGroup(trainer_setup(r, run.model, lr), hf_checkpoint, n, r.timeouts.train_step_s, options)
    log(f"trainer: {n} Megatron rank(s) ready in {time.perf_counter() - t0:.1f} s")
    return group


def engine_factories(run: RunContext, checkpoint: str) -> list:
    """One picklable factory per engine of `rollout.engine` (`beamrl.rollout.engines.ENGINES`)."""
    from beamrl.rollout.engines import EngineLaunch, engine_factory

    r = run.recipe
    ro = r.rollout
    device = "cpu" if run.cpu else "cuda"
    # Colocated GPU engines release weights / KV cache while the trainer runs (needs SGLang's memory saver).
    memory_saver = r.placement.mode == "colocated" and device == "cuda"
    return [engine_factory(ro, EngineLaunch(
        checkpoint=checkpoint, dtype=r.model.dtype, device=device, seed=r.run.seed + i, name=f"{ro.engine}-{i}",
        port=30000 + 10 * i, start_timeout=r.timeouts.generate_s, return_routed_experts=run.return_routed_experts,
        memory_saver=memory_saver, lora=r.trainer.lora)) for i in range(ro.num_engines)]


def start_engines(run: RunContext, checkpoint: str) -> EngineGroup:
    """The rollout engines (one actor each): a core-slot on CPU; engine_tp GPUs disaggregated, a share of one
    GPU colocated."""
    r = run.recipe
    factories = engine_factories(run, checkpoint)
    gpus = ENGINE_SHARE if r.placement.mode == "colocated" else r.rollout.engine_tp
    options = [{"num_cpus": 1} if run.cpu else {"num_cpus": 1, "num_gpus": gpus} for _ in factories]
    t0 = time.perf_counter()
    engines = EngineGroup(factories, r.timeouts.generate_s, options)
    log(f"rollout: {len(factories)} {r.rollout.engine} engine(s) ready in {time.perf_counter() - t0:.1f} s")
    return engines
