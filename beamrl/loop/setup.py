"""Setting up a run: the resolved pieces every step reads (`RunContext`), Ray, the actor groups, and what a run must
release at the end (`Resources`).

Order matters and is kept here: how the run starts (`run_dir.plan_start`: an earlier run's outputs are refused,
resumed or replaced) is decided by the driver first; then the model config, the placement plan (a layout that
cannot be placed fails by field), the start-up checks (`beamrl.recipe.preflight`: checkpoint tensors, tokenizer,
data source, reward functions) and the prompts load, all before anything is written. Only then the output
directory, rewards and metric loggers, then Ray and the placement groups, and every actor onto its slot's bundle.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from beamrl.cluster.placement import Placement
from beamrl.data.tokenizer_identity import TOKENIZER_DIGEST_FILE, tokenizer_digest
from beamrl.dtypes import torch_dtype
from beamrl.loop.colocated import engines_back_up_weights, engines_stage_memory
from beamrl.loop.groups import EngineGroup, TrainerGroup
from beamrl.loop.log import log
from beamrl.loop.checkpoints import step_of
from beamrl.loop.run_dir import StartPlan, delete_outputs
from beamrl.models.beam.config import BeamConfig
from beamrl.recipe.errors import RecipeError
from beamrl.recipe.schema import Recipe

# Shares of a slot's GPU (CPU worker slot) when actors share it: policy rank + reference rank + colocated engine
# process <= 1. A disaggregated engine process takes its first slot whole (its other slots are held by the
# placement group and used by its server).
POLICY_SHARE, REFERENCE_SHARE, ENGINE_SHARE = 0.6, 0.2, 0.2


class Resources:
    """What a run must release, released in reverse order of acquisition, each on its own (one failing
    teardown must not leak the others)."""

    def __init__(self) -> None:
        self._items: list[tuple[str, Callable[[], Any]]] = []

    def add(self, name: str, release: Callable[[], Any]) -> None:
        self._items.append((name, release))

    def move_to_end(self, name: str) -> None:
        """Release `name` first from now on (as if it were acquired last)."""
        for i, (n, fn) in enumerate(self._items):
            if n == name:
                self._items.append(self._items.pop(i))
                return

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
    placement: Placement  # who runs on which node and GPU (`beamrl.recipe.layout.placement_of`)
    api_key: str  # this run's secret for the engines' HTTP servers (SGLang --api-key)
    groups: Any = None  # the Ray placement groups (`beamrl.cluster.ray_groups.PlacementGroups`), once placed

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

    from beamrl.recipe.layout import placement_of

    config = model_config(recipe)  # first: a missing checkpoint leaves no output directory behind
    placement = placement_of(recipe)  # and a layout that cannot be placed neither
    checks = preflight(recipe, config)
    tokenizer = checks.tokenizer
    digest = None if tokenizer is None else tokenizer_digest(tokenizer)
    if digest is not None and start.resume_dir is not None:
        from beamrl.loop.resume_recipe import check_resume_tokenizer

        field = "data.tokenizer" if recipe.data.tokenizer is not None else "model.checkpoint"
        check_resume_tokenizer(start.out_dir, digest, field, recipe.data.tokenizer or recipe.model.checkpoint)
    data = load_prompts(recipe, tokenizer)
    log(f"checks passed: {'; '.join(checks.lines)}; {len(data)} prompts")
    out_dir, ckpt_root, resume_dir = start.out_dir, start.checkpoint_root, start.resume_dir
    if start.replace is not None:
        delete_outputs(start.replace, log)
    out_dir.mkdir(parents=True, exist_ok=True)
    if start.recipe_changed:  # what the earlier stretch ran with stays next to this run's recipe
        from beamrl.loop.resume_recipe import keep_earlier_recipe

        keep_earlier_recipe(out_dir, step_of(resume_dir))
    (out_dir / "recipe.yaml").write_text(recipe.to_yaml())
    if digest is not None:  # what a resume compares its tokenizer with (beamrl.data.tokenizer_identity)
        (out_dir / TOKENIZER_DIGEST_FILE).write_text(digest + "\n")
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
    return RunContext(recipe=recipe, out_dir=out_dir, checkpoint_root=ckpt_root, model=config, initial_checkpoint=init,
                      tokenizer=tokenizer, data=data, stop_ids=(int(tokenizer.eos_token_id),), rewards=rewards,
                      logger=logger, samples=samples, routing_replay=routing_replay,
                      return_routed_experts=return_routed_experts, resume_dir=resume_dir, placement=placement,
                      api_key=secrets.token_hex(32))


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


def start_ray(run: "RunContext", resources: Resources, verbose: bool = False) -> None:
    """CPU: a private local Ray with one simulated node per recipe node, each declaring cluster.gpus_per_node worker
    slots (its own short temp dir: parallel runs must not share Ray's sockets). GPU: join the cluster that
    `launch/` started. Then the placement groups of the plan (`run.groups`). Every worker filters third-party
    warnings unless `verbose`."""
    import ray

    from beamrl.cluster.ray_groups import PlacementGroups
    from beamrl.cluster.ray_start import (WORKER_SLOT, connect_cluster_ray, init_local_ray, new_temp_dir,
                                          node_resource, start_rehearsal_cluster)
    from beamrl.third_party_output import worker_runtime_env

    env = worker_runtime_env(verbose)

    recipe = run.recipe
    cl = recipe.cluster
    tmp: Path | None = None
    stop = ray.shutdown
    if cl.device == "cpu":
        # The run's processes see no GPU on a machine that has one: Ray does not hide GPUs from actors that ask for
        # none, and a CPU recipe must run on the CPU (the trainer refuses another device: TrainerSetup.device).
        env = {**env, "env_vars": {**env.get("env_vars", {}), "CUDA_VISIBLE_DEVICES": ""}}
        tmp = new_temp_dir()
        if cl.num_nodes == 1:
            init_local_ray(num_cpus=2, temp_dir=tmp, resources={WORKER_SLOT: cl.gpus_per_node, node_resource(0): 1},
                           runtime_env=env)
        else:
            t0 = time.perf_counter()
            stop = start_rehearsal_cluster(cl.num_nodes, cl.gpus_per_node, tmp, runtime_env=env).shutdown
            log(f"rehearsal: local Ray cluster of {cl.num_nodes} simulated node(s) x {cl.gpus_per_node} worker "
                f"slot(s) up in {time.perf_counter() - t0:.1f} s")
    else:
        connect_cluster_ray(runtime_env=env)

    def shutdown() -> None:
        stop()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    resources.add("ray", shutdown)
    run.groups = PlacementGroups(run.placement, recipe.timeouts.health_s, log=log)
    resources.add("placement groups", run.groups.remove)


def trainer_setup(recipe: Recipe, model: BeamConfig, lr: float | None = None):
    """The `TrainerSetup` of every rank: the trainer section (with `lr` replaced for the SFT warm start, which
    trains every weight even in a LoRA run: it makes the base that the adapters then train on)."""
    from beamrl.trainer.megatron.worker import TrainerSetup

    trainer = recipe.trainer if lr is None else recipe.trainer.model_copy(update={"lr": lr, "lora": None})
    seed = trainer.seed if trainer.seed is not None else recipe.run.seed
    return TrainerSetup(model=model, trainer=trainer, dtype=recipe.model.dtype, seed=seed,
                        timeout_s=recipe.timeouts.train_step_s, device=recipe.cluster.device)


def start_trainer(run: RunContext, hf_checkpoint: str, lr: float | None = None,
                  reference: bool = False) -> TrainerGroup:
    """The Megatron ranks (one actor each), rank r on the bundle of the plan's slot for rank r: the rank numbers
    come from the plan, not from the order Ray starts actors in."""
    r = run.recipe
    share = REFERENCE_SHARE if reference else POLICY_SHARE
    options = [run.groups.actor_options(t.slot, share) for t in run.placement.trainer]
    t0 = time.perf_counter()
    unit = "slot" if run.cpu else "GPU"
    labels = [f"node {t.slot.node}, {unit} {t.slot.gpu}" for t in run.placement.trainer]
    group = TrainerGroup(trainer_setup(r, run.model, lr), hf_checkpoint, len(options), r.timeouts.train_step_s,
                         options, labels=labels)
    where = "; ".join(f"rank {k} on {lb} (pid {pid})" for k, (lb, pid) in enumerate(zip(labels, group.process_ids)))
    log(f"{'reference' if reference else 'trainer'}: {len(options)} Megatron rank(s) ready in "
        f"{time.perf_counter() - t0:.1f} s: {where}")
    return group


def engine_factories(run: RunContext, checkpoint: str) -> list[list]:
    """Per engine of the plan, one picklable factory per node (`beamrl.rollout.engines.ENGINES`), node-rank order."""
    from beamrl.rollout.engines import EngineLaunch

    r = run.recipe
    device = "cpu" if run.cpu else "cuda"
    # Colocated GPU engines release weights / KV cache while the trainer runs (needs SGLang's memory saver).
    memory_saver = engines_stage_memory(r)
    backup = engines_back_up_weights(r)
    return [node_factories(r.rollout, EngineLaunch(
        checkpoint=checkpoint, dtype=r.model.dtype, device=device, seed=r.run.seed + e.index, name=e.name,
        start_timeout=r.timeouts.generate_s, return_routed_experts=run.return_routed_experts,
        memory_saver=memory_saver, weights_cpu_backup=backup, api_key=run.api_key, lora=r.trainer.lora), e,
        run.groups) for e in run.placement.engines]


def node_factories(rollout, launch, engine, groups) -> list:
    """The factories of one planned engine (`EnginePlacement`), one per node: `launch` with the node's rank, its
    first GPU and (on GPU) the GPU ids of its node as Ray placed them (`PlacementGroups.gpu_ids`)."""
    from beamrl.rollout.engines import engine_factory

    base = engine_factory(rollout, replace(launch, nnodes=engine.nnodes))
    out = []
    for part in engine.nodes:
        gpus = groups.gpu_ids(part.node)
        out.append(base.with_launch(node_rank=part.node_rank, base_gpu_id=part.base_gpu,
                                    visible_gpus=None if gpus is None else tuple(gpus)))
    return out


def engines_start_with_trainer(r: Recipe) -> bool:
    """Whether the engines may start while the trainer starts: not where they share GPUs with it (the colocated
    GPU engines of `engines_stage_memory`), since an engine sizes its memory (KV cache) from what is free on its GPU
    when it starts."""
    return not engines_stage_memory(r)


def engine_start_bound_s(r: Recipe) -> float:
    """How long an engine group's start can take: each of its three phases (reserve ports, start, report TP sizes)
    waits up to `timeouts.generate_s`; plus a minute."""
    return 3 * r.timeouts.generate_s + 60


def start_engines(run: RunContext, checkpoint: str) -> EngineGroup:
    """The rollout engines: one actor per node of each engine, on the bundle of its first slot (colocated: a
    share of the GPU it shares with a trainer rank)."""
    r = run.recipe
    factories = engine_factories(run, checkpoint)
    share = ENGINE_SHARE if r.placement.mode == "colocated" else 1.0
    options = [[run.groups.actor_options(part.slots[0], share) for part in e.nodes] for e in run.placement.engines]
    t0 = time.perf_counter()
    engines = EngineGroup(factories, r.timeouts.generate_s, options)
    n_proc = sum(len(e.nodes) for e in run.placement.engines)
    pids = "; ".join(f"{name} pid(s) {engines.pids(k)}" for k, name in enumerate(engines.names))
    log(f"rollout: {len(factories)} {r.rollout.engine} engine(s) ({n_proc} node process(es)) ready in "
        f"{time.perf_counter() - t0:.1f} s: {pids}")
    return engines
